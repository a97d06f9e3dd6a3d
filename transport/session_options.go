package transport

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
)

// Mode chooses the byte stream a session runs over.
type Mode string

const (
	// ModeAuto uses UCX when both ends have it and this process trusts its
	// peers (WithTrustPeers), and TCP otherwise. UCX assumes
	// trusted peers: its TCP transport writes wherever a peer's put says and
	// every context with RMA serves emulated puts and gets at any address, so
	// a peer that drives UCX itself reaches the whole process. Over TCP a
	// peer reaches only what the out-of-band engine offers it.
	ModeAuto Mode = "auto"
	// ModeUCX requires UCX: a session that cannot run over UCX fails. Asking
	// for it accepts that exposure (see ModeAuto); the paths meant for trusted
	// peers still need WithTrustPeers.
	ModeUCX Mode = "ucx"
	// ModeTCP never uses UCX: the session runs over the bootstrap TCP connection.
	ModeTCP Mode = "tcp"
)

// EnvTransport is the environment variable that sets the mode when no
// WithMode option is given: "ucx", "tcp" or "auto". It asks for "ucx" only in
// a process that trusts its peers (WithTrustPeers): elsewhere sessions and
// listeners fail to start, rather than take an environment's word that the
// peers are trusted.
const EnvTransport = "GDRPC_TRANSPORT"

// Defaults of the options.
const (
	DefaultKeepAliveInterval = 10 * time.Second
	DefaultKeepAliveTimeout  = 10 * time.Second
	DefaultHandshakeTimeout  = 10 * time.Second
	DefaultIdleTimeout       = 2 * time.Minute
	// DefaultHostSessions is what WithHostSessions sets unless given.
	DefaultHostSessions = 1024
	// DefaultWindow is the yamux per-stream receive window.
	DefaultWindow = 16 << 20
	// GRPCBufferSize is the gRPC write buffer size that suits a gdrpc conn:
	// it carries whole messages per write (a yamux frame, a UCX stream send),
	// so larger buffers mean fewer, larger writes.
	GRPCBufferSize = 256 << 10
	// GRPCReadBufferSize is the gRPC read buffer size of a gdrpc conn,
	// gRPC's own default. gRPC holds it for a connection's life, idle or
	// not, on both ends, and a larger one made no call faster: 256 KiB made
	// an idle connection over a TCP session cost 562 KiB, against 134 KiB.
	// gRPC reads that much at a time, and a UCX endpoint copies a Read of
	// at least 32 KiB straight from UCX into the reader's buffer: keep it
	// no smaller.
	GRPCReadBufferSize = 32 << 10
)

// Option configures Dial, Listen and the sessions they make.
type Option func(*config)

type config struct {
	mode             Mode
	modeSet          bool
	logger           *slog.Logger
	defaultLogger    bool // no WithLogger: logger discards
	kaInterval       time.Duration
	kaTimeout        time.Duration
	handshakeTimeout time.Duration
	idleTimeout      time.Duration
	idleCheck        func(s *Session, busy bool) // tests: called after each look of the idle watcher
	rdmaCtx          *rdma.Context
	identity         *Identity
	window           uint32
	metrics          SessionMetrics
	noLane           bool
	engine           Engine
	trustPeers       bool
	hostSessions     int
	// grpcWithLanes: a client opens its gRPC lane with its control and bulk
	// lanes, in newSession (DialConn), rather than in Conn.
	grpcWithLanes bool
}

// SessionMetrics receives session events. Implementations must be cheap and
// safe for concurrent use.
type SessionMetrics interface {
	// SessionUp reports a new session and the transport it runs over.
	SessionUp(transport string, client bool)
	// SessionDown reports a closed session and why (see Session.Err).
	SessionDown(transport string, client bool, err error)
	// Fallback reports a session that stayed on TCP although one side
	// offered UCX (the server, and the client could not upgrade; or the
	// client, and the server chose TCP), and why, on the side that knows.
	Fallback(reason string)
}

type nopSessionMetrics struct{}

func (nopSessionMetrics) SessionUp(string, bool)          {}
func (nopSessionMetrics) SessionDown(string, bool, error) {}
func (nopSessionMetrics) Fallback(string)                 {}

// WithHostSessions bounds the connections a Listener keeps from one remote
// host (an IPv4 address, an IPv6 /64) at once: its gdrpc sessions, from
// their handshake until they are released, and its plain gRPC clients'
// connections, until gRPC closes them. A peer's sessions each hold
// connections (a session's lanes are connections of their own),
// goroutines and the engine's per-session bounds, and its identities cost
// it nothing: without a bound per host, one host could hold every
// descriptor of the process. A handshake past the bound is refused (the
// client's Dial fails with a *RejectError), a plain connection past it is
// closed. n <= 0 means DefaultHostSessions. Dial ignores it.
func WithHostSessions(n int) Option {
	return func(c *config) { c.hostSessions = n }
}

// WithMetrics sets the receiver of session events. If nil or not given,
// events are dropped.
func WithMetrics(m SessionMetrics) Option {
	return func(c *config) { c.metrics = m }
}

// WithMode sets the transport mode. If not given, the environment variable
// GDRPC_TRANSPORT decides (EnvTransport), and if that is unset, ModeAuto.
func WithMode(m Mode) Option {
	return func(c *config) { c.mode, c.modeSet = m, true }
}

// WithLogger sets the logger; sessions log with the attributes component and
// session. If nil or not given, nothing is logged.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithKeepAlive sets how often a session pings its peer and how long it waits
// for the answer (and for any write to the underlying connection) before it
// declares the peer dead and closes the session. A dead peer is detected
// within about interval+timeout. If zero, 10 s and 10 s. A negative interval
// disables the keepalive.
func WithKeepAlive(interval, timeout time.Duration) Option {
	return func(c *config) { c.kaInterval, c.kaTimeout = interval, timeout }
}

// WithHandshakeTimeout bounds the handshake (including the UCX upgrade) and
// the opening of each stream. If zero, 10 s.
func WithHandshakeTimeout(d time.Duration) Option {
	return func(c *config) { c.handshakeTimeout = d }
}

// WithIdleTimeout closes a session that has been idle for d: its gRPC stream
// was never taken (Conn), and neither side opened a stream or sent a control
// message. A session whose gRPC stream is taken is never idle here (gRPC's
// own keepalive and idle settings govern it; closing that stream closes the
// session). An idle session is closed within d/4 after d with a cause
// wrapping ErrIdle. If zero, 2 minutes (DefaultIdleTimeout). A negative d
// disables it.
func WithIdleTimeout(d time.Duration) Option {
	return func(c *config) { c.idleTimeout = d }
}

// WithRDMAContext sets the UCX context sessions use. If nil or not given,
// rdma.Default().
func WithRDMAContext(rc *rdma.Context) Option {
	return func(c *config) { c.rdmaCtx = rc }
}

// WithIdentity sets the identity a session proves in its handshake: the
// process id it announces, and the key it signs the handshake with. It exists
// so tests can emulate several processes in one (NewIdentity). A peer that
// announces this identity's id without proving it (with the key) is rejected
// like any other impersonation; one that proves it holds the key, a session
// of this process to itself, is accepted. If nil or not given,
// LocalIdentity().
func WithIdentity(id *Identity) Option {
	return func(c *config) { c.identity = id }
}

// WithWindow sets the per-stream receive window of the multiplexer. If zero,
// 16 MiB; values below 256 KiB are raised to 256 KiB.
func WithWindow(n int) Option {
	return func(c *config) {
		if n > 0 {
			c.window = uint32(min(n, 1<<30))
		}
	}
}

// WithLanes sets whether a session runs its gRPC stream and its control
// stream on connections of their own, lanes (on: the default; UCX endpoints
// on a UCX session, TCP connections on a TCP one), or on streams of the
// session's multiplexer. A lane spares every message the multiplexer's
// goroutine hand-offs. Lanes are used only when both ends allow them and the
// session was made by Dial and a Listener (not over a caller's conn).
func WithLanes(on bool) Option {
	return func(c *config) { c.noLane = !on }
}

func newConfig(opts []Option) (*config, error) {
	c := &config{}
	for _, o := range opts {
		if o != nil {
			o(c)
		}
	}
	fromEnv := false
	if !c.modeSet || c.mode == "" {
		c.mode = ModeAuto
		if env := os.Getenv(EnvTransport); env != "" {
			c.mode, fromEnv = Mode(env), true
		}
	}
	switch c.mode {
	case ModeAuto, ModeUCX, ModeTCP:
	default:
		return nil, fmt.Errorf("gdrpc: unknown transport mode %q (want auto, ucx or tcp)", c.mode)
	}
	if fromEnv && c.mode == ModeUCX && !c.trustPeers {
		// The code asked for nothing; an environment must not turn a
		// process's peers trusted (ModeUCX says they are).
		return nil, fmt.Errorf("gdrpc: %s=ucx in a process that does not trust its peers: a UCX session lets its peer reach the whole process (see ModeAuto); trust them in code (WithTrustPeers) or unset it", EnvTransport)
	}
	if c.mode == ModeAuto && !c.trustPeers {
		// A UCX connection lets its peer write anywhere in this process (see
		// ModeAuto): untrusted peers get TCP sessions.
		c.mode = ModeTCP
	}
	if c.hostSessions <= 0 {
		c.hostSessions = DefaultHostSessions
	}
	if c.logger == nil {
		c.logger = slog.New(slog.DiscardHandler)
		c.defaultLogger = true
	}
	if c.metrics == nil {
		c.metrics = nopSessionMetrics{}
	}
	if c.kaInterval == 0 {
		c.kaInterval = DefaultKeepAliveInterval
	}
	if c.kaTimeout <= 0 {
		c.kaTimeout = DefaultKeepAliveTimeout
	}
	if c.handshakeTimeout <= 0 {
		c.handshakeTimeout = DefaultHandshakeTimeout
	}
	if c.idleTimeout == 0 {
		c.idleTimeout = DefaultIdleTimeout
	}
	if c.identity == nil {
		c.identity = LocalIdentity()
	}
	if c.window == 0 {
		c.window = DefaultWindow
	}
	c.window = max(c.window, 256<<10)
	return c, nil
}

// rdmaContext returns the configured UCX context, or rdma.Default().
func (c *config) rdmaContext() (*rdma.Context, error) {
	if c.rdmaCtx != nil {
		useCUDA(c.rdmaCtx, c.logger)
		return c.rdmaCtx, nil
	}
	if err := rdma.Available(); err != nil {
		return nil, err
	}
	rc, err := rdma.Default()
	useCUDA(rc, c.logger)
	return rc, err
}

// localCaps returns the caps to announce: announcedCaps(), with the UCX fields
// taken from the configured context when one was given.
func (c *config) localCaps() Caps {
	caps := announcedCaps().clone()
	if c.rdmaCtx != nil {
		u := ucxCaps(c.rdmaCtx)
		caps.UCX, caps.UCXVersion, caps.MemoryTypes, caps.UCXTransports = u.UCX, u.UCXVersion, u.MemoryTypes, u.UCXTransports
	}
	caps.Lanes = !c.noLane
	if c.engine != nil {
		caps.Codecs = append(caps.Codecs, c.engine.Codecs()...)
	}
	return caps
}

var ucxFallbackNoted sync.Once

// noteNoUCX reports once per process, at Info (through slog's default logger
// when no WithLogger was given), that sessions that could have used UCX run
// over TCP because UCX cannot be used here, and why; each dial or listen also
// logs it at Debug.
func (c *config) noteNoUCX(log *slog.Logger, err error) {
	log.Debug("UCX unavailable, TCP only", "err", err)
	c.infoOnce(&ucxFallbackNoted, log, "gdrpc: UCX cannot be used in this process; sessions run over TCP", "err", err)
}

// infoOnce logs msg at Info once per process (once, of once), through log,
// or slog's default logger when no WithLogger was given: what an operator
// should see even where the application set no logger.
func (c *config) infoOnce(once *sync.Once, log *slog.Logger, msg string, args ...any) {
	once.Do(func() {
		if c.defaultLogger {
			log = slog.Default()
		}
		log.Info(msg, args...)
	})
}

// WithEngine sets the engine that serves the sessions' out-of-band traffic
// (package oob's oob.Engine). Without one, a session carries the gRPC stream
// alone.
func WithEngine(e Engine) Option {
	return func(c *config) { c.engine = e }
}

// WithTrustPeers says whether the peers of these sessions are trusted (one
// cluster, one operator). Trusted peers get UCX sessions in ModeAuto, and the
// out-of-band engine lets them write wherever their keys say (UCX shared
// memory, CMA, CUDA IPC). Untrusted peers (the default) get TCP sessions in
// ModeAuto, and each destination is registered for its transfer alone. Either
// way a UCX session exposes more of a process to its peer than its transfers'
// memory: see the README's Security section.
func WithTrustPeers(on bool) Option {
	return func(c *config) { c.trustPeers = on }
}

// useCUDA lets rc register and move CUDA memory where both the loaded UCX and
// the CUDA driver can: UCX calls that may touch CUDA memory then run with a
// CUDA context current on the calling thread. Elsewhere rc keeps refusing CUDA
// memory, and GPU payloads take another path (cuda-ipc, staged, stream).
func useCUDA(rc *rdma.Context, log *slog.Logger) {
	if rc == nil || rc.CanMap(rdma.MemoryCUDA) || !rc.Info().HasMemoryType(rdma.MemoryCUDA) {
		return
	}
	t, err := devicebuf.CUDAThreadContexts()
	if err != nil {
		return
	}
	if err := rc.UseCUDA(t, 0); err != nil {
		log.Warn("UCX supports CUDA memory but cannot use this process's CUDA contexts", "err", err)
	}
}
