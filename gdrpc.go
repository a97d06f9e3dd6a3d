// Package gdrpc holds what a gdrpc client and server share: the options of
// their sessions and of the out-of-band transfers over them, and the types
// those options and a handler see. Packages dialer and listener take these
// options; package gdrcodec moves the payloads; package devicebuf holds them.
//
// Every option is scoped to the Dialer or Listener it is given to. The zero
// configuration (no options) is the safe one: peers are not trusted, so
// sessions run over TCP and each transfer exposes only its own destination.
package gdrpc

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Option configures the sessions of a Dialer or a Listener and the transfers
// over them.
type Option func(*Config)

// Config is what Options set; packages dialer and listener read it. Its zero
// value is the default of every field.
type Config struct {
	// TrustPeers: see WithTrustPeers.
	TrustPeers bool
	// Transport: see WithTransport. Empty means ModeAuto, or the environment
	// variable GDRPC_TRANSPORT.
	Transport Mode
	// Logger receives the sessions' and transfers' records; nil discards them.
	Logger *slog.Logger
	// Metrics receives session and transfer events; nil reports none.
	Metrics Metrics
	// Limits bound what one peer may hold; zero fields take their defaults.
	Limits Limits
	// TransferTimeout bounds one transfer; zero means oob.DefaultTransferTimeout.
	TransferTimeout time.Duration
	// Paths are the transfer paths allowed; zero means all.
	Paths Path
	// KeepAliveInterval and KeepAliveTimeout: see WithKeepAlive.
	KeepAliveInterval, KeepAliveTimeout time.Duration
	// IdleTimeout: see WithIdleTimeout.
	IdleTimeout time.Duration
	// HostSessions: see WithHostSessions; zero means the default.
	HostSessions int
	// ReceiveSpace: see WithReceiveSpace; zero means spaces that grow within
	// ReceiveSpaceLimit, negative none.
	ReceiveSpace int
	// ReceiveSpaceLimit: see WithReceiveSpaceLimit; zero means the default
	// (oob.DefaultReceiveSpaceLimit on a client, none on a server).
	ReceiveSpaceLimit int
	// StreamOrdered: see WithStreamOrdered.
	StreamOrdered bool
	// Session holds session options applied after the others (WithSessionOptions).
	Session []transport.Option
}

// WithTrustPeers says the peers are trusted (one cluster, one operator).
// Sessions in ModeAuto then move onto UCX, and transfers may use the paths
// through which a peer writes wherever its key says: UCX shared memory, CMA
// and CUDA IPC, the fastest on one host; a trusted owner's report of a
// transfer is taken at its word, so destinations are not cleared first.
// Untrusted peers (the default) get TCP sessions in ModeAuto, and each
// destination is registered for its transfer alone and cleared before a path
// whose arrival the receiver cannot count. Either way a UCX session exposes more of a process to its
// peer than its transfers' memory: see the README's Security section.
func WithTrustPeers() Option { return func(c *Config) { c.TrustPeers = true } }

// WithTransport chooses what sessions run over: ModeAuto (the default), ModeUCX
// or ModeTCP. ModeUCX accepts what a UCX session exposes (the whole process,
// README, Security), so use it only between trusted peers; the trusted paths
// and receive spaces still need WithTrustPeers.
func WithTransport(m Mode) Option { return func(c *Config) { c.Transport = m } }

// WithLogger sends the sessions' and transfers' log records to l.
func WithLogger(l *slog.Logger) Option { return func(c *Config) { c.Logger = l } }

// WithMetrics reports session and transfer events to m.
func WithMetrics(m Metrics) Option { return func(c *Config) { c.Metrics = m } }

// WithLimits bounds what one peer may hold (see Limits).
func WithLimits(l Limits) Option { return func(c *Config) { c.Limits = l } }

// WithTransferTimeout bounds one out-of-band transfer when the call's context
// has no earlier deadline; by default oob.DefaultTransferTimeout.
func WithTransferTimeout(d time.Duration) Option {
	return func(c *Config) { c.TransferTimeout = d }
}

// WithPaths restricts the out-of-band paths a transfer may take to p; by
// default all. Two paths can be turned off: PathCUDAIPC, and PathRDMA, which
// covers PathStaged too (a GPU payload staged through registered host memory
// moves by RDMA). PathStream is always allowed, and PathLocal (a payload of
// this process) is a plain copy whatever p says. WithPaths(PathStream) sends
// every payload over the session's stream.
func WithPaths(p Path) Option { return func(c *Config) { c.Paths = p } }

// WithKeepAlive sets how often an idle session is pinged and how long an
// answer may take before the session is dropped; zero values keep the
// defaults (10 s each), and a negative interval turns keepalive off.
func WithKeepAlive(interval, timeout time.Duration) Option {
	return func(c *Config) { c.KeepAliveInterval, c.KeepAliveTimeout = interval, timeout }
}

// WithIdleTimeout closes a session that carried nothing for d and holds no
// gRPC conn (a peer that connected and went quiet); zero keeps the default
// (2 minutes), negative turns it off.
func WithIdleTimeout(d time.Duration) Option { return func(c *Config) { c.IdleTimeout = d } }

// WithHostSessions bounds the connections a Listener keeps from one remote
// host (an IPv4 address, an IPv6 /64) at once, its gdrpc sessions and its
// plain gRPC clients' connections together; n <= 0 keeps the default
// (transport.DefaultHostSessions, 1,024). A peer's identities cost it
// nothing, so this is what bounds the connections, goroutines and
// per-session resources one host holds. A handshake past it is refused,
// and the client's dial fails with the reason; a plain connection past it
// is closed. Clients behind one address (a NAT) share it. Dialers ignore it.
func WithHostSessions(n int) Option { return func(c *Config) { c.HostSessions = n } }

// WithReceiveSpace sets the receive space a client advertises to each server
// it trusts: one space of n bytes per session; 0 or less, none. After the
// first payload a session pulls by rdma or cuda-ipc, the client sets aside n
// bytes of the memory that payload landed in (made by the same receive
// allocator) and hands the server its key; the server then writes the
// payloads of its responses straight there while it marshals them, and the
// client takes them with no rendezvous. A received buffer holds its range
// until it is released, and once the session closed its whole space;
// payloads that do not fit the free space take the rendezvous. Without this option a client's spaces grow with the payloads
// (WithReceiveSpaceLimit).
//
// Given to a Listener, it sets the space a server advertises to each
// trusted client for its requests: n bytes per session, after the first
// request payload the session pulled by rdma or cuda-ipc; none by default (a
// server would set memory aside for every connection). The client then
// writes the payloads of unary requests and client streams' messages there
// while gRPC marshals them, and the server's handler gets them with no
// rendezvous.
func WithReceiveSpace(n int) Option {
	return func(c *Config) {
		c.ReceiveSpace, c.ReceiveSpaceLimit = n, 0
		if n <= 0 {
			c.ReceiveSpace = -1
		}
	}
}

// WithReceiveSpaceLimit makes a session's receive spaces (WithReceiveSpace)
// grow with the payloads, within n bytes per session together; 0 or less,
// no space. A session sets aside room for four payloads of its first pull's
// size, at least oob.DefaultReceiveSpace (64 MiB) or n/4 where that is less
// (as much of n as is left, at most), and another such space whenever a
// later pull is of a size its spaces cannot hold twice: up to four spaces.
// A client does this by default, within
// oob.DefaultReceiveSpaceLimit (1 GiB). Given to a Listener, it gives each
// trusted client's session growing space for its requests' payloads, where
// a server otherwise advertises none: memory set aside after the payloads a
// client actually sends, not a fixed size for every connection. Options
// shared by a Dialer and a Listener give both this limit.
func WithReceiveSpaceLimit(n int) Option {
	return func(c *Config) {
		c.ReceiveSpace, c.ReceiveSpaceLimit = 0, n
		if n <= 0 {
			c.ReceiveSpace = -1
		}
	}
}

// WithStreamOrdered lets a client take a GPU payload that landed in its
// receive space while the server's copy into it still runs, instead of the
// receive waiting for the copy: the received devicebuf.Buffer is then
// Pending, and the application orders its work after the copy with
// Buffer.WaitOn(stream) (its kernels queue behind the copy, the CPU never
// waits) or waits with Buffer.Wait. devicebuf's copies wait by themselves.
// Payloads that came another way are complete on arrival, as without this
// option. Off by default: a received buffer's bytes are in place. It is a
// client's option: a Listener's sessions ignore it (a server's request is in
// place before its handler runs).
func WithStreamOrdered() Option { return func(c *Config) { c.StreamOrdered = true } }

// WithSessionOptions applies package transport's options to the sessions,
// after the others: for what only the session layer knows (a UCX context of
// one's own, the lanes, the multiplexer's window).
func WithSessionOptions(opts ...transport.Option) Option {
	return func(c *Config) { c.Session = append(c.Session, opts...) }
}

// Mode chooses what a session runs over.
type Mode = transport.Mode

// The modes.
const (
	ModeAuto = transport.ModeAuto // UCX when both ends have it and trust each other, else TCP
	ModeUCX  = transport.ModeUCX  // UCX or fail; says the peers are trusted
	ModeTCP  = transport.ModeTCP  // TCP only
)

// Limits bound what one peer may hold; see oob.Limits.
type Limits = oob.Limits

// Path is a way a payload travels, or a set of them.
type Path = oob.Path

// The paths.
const (
	PathCUDAIPC = oob.PathCUDAIPC // same host, GPU to GPU through a CUDA IPC handle
	PathRDMA    = oob.PathRDMA    // UCX put into the receiver's registered memory
	PathStream  = oob.PathStream  // the session's bulk stream
	PathStaged  = oob.PathStaged  // GPU memory through registered host staging
	PathLocal   = oob.PathLocal   // the owner is this process: a plain copy
)

// TransferInfo describes one finished transfer.
type TransferInfo = oob.TransferInfo

// Metrics receives session and transfer events. Implementations must be
// cheap and safe for concurrent use.
type Metrics interface {
	// SessionUp reports a new session and the transport it runs over ("ucx"
	// or "tcp").
	SessionUp(transport string, client bool)
	// SessionDown reports a closed session and why.
	SessionDown(transport string, client bool, err error)
	// SessionFallback reports a session that stayed on TCP although UCX was
	// offered, and why.
	SessionFallback(reason string)
	// Transfer reports one finished transfer, on both sides.
	Transfer(TransferInfo)
	// TransferFallback reports that a better path was not taken, and why.
	TransferFallback(wanted, took Path, reason string)
}

// Session is a gdrpc session: one connection to a peer process.
type Session = transport.Session

// SessionFromContext returns the session the RPC of ctx (a handler's or an
// interceptor's context) came over, or nil when it came over none.
func SessionFromContext(ctx context.Context) *Session { return transport.SessionFromContext(ctx) }

// SessionFromPeer returns the session an RPC's peer (peer.FromContext, or the
// grpc.Peer call option) came over, or nil when it came over none.
func SessionFromPeer(p *peer.Peer) *Session { return transport.SessionFromPeer(p) }

// NopMetrics is a Metrics that reports nothing; embed it to implement only
// the events one wants.
type NopMetrics struct{}

func (NopMetrics) SessionUp(string, bool)              {}
func (NopMetrics) SessionDown(string, bool, error)     {}
func (NopMetrics) SessionFallback(string)              {}
func (NopMetrics) Transfer(TransferInfo)               {}
func (NopMetrics) TransferFallback(Path, Path, string) {}

// HostMemory returns the process's pool of host memory that UCX allocated and
// registered once (plain host memory where UCX is unavailable): payloads that
// live there move by RDMA with no copy and no registration per call.
func HostMemory() *devicebuf.Pool { return oob.DefaultHostPool() }
