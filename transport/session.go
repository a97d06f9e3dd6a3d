package transport

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/gdrpc/gdrpc/rdma"
)

// Session errors.
var (
	// ErrSessionClosed is the cause of a session closed locally with Close. It
	// wraps net.ErrClosed.
	ErrSessionClosed = fmt.Errorf("gdrpc: session closed: %w", net.ErrClosed)
	// ErrPeerGone is the cause of a session whose connection ended: the peer
	// closed it, or the connection failed.
	ErrPeerGone = errors.New("gdrpc: connection to peer lost")
	// ErrKeepAlive is the cause of a session whose peer stopped answering
	// keepalive pings; the error is a *KeepAliveError.
	ErrKeepAlive = errors.New("gdrpc: peer did not answer keepalive")
	// ErrIdle is the cause of a session closed because it carried nothing for
	// its idle timeout (WithIdleTimeout).
	ErrIdle = errors.New("gdrpc: session idle")
	// ErrConnTaken reports a second Conn call on a session.
	ErrConnTaken = errors.New("gdrpc: the gRPC stream of this session was already taken")
)

// MaxControlPayload is the largest control message payload.
const MaxControlPayload = 1 << 20

const controlHeaderLen = 5

var sessionIDs atomic.Uint64

// Session is one connection to a peer process: a handshake, then a
// multiplexer (yamux) over the session's byte stream (a UCX endpoint or the
// TCP connection) carrying the keepalive, and the gRPC stream, the control
// stream and the stream path's bulk data, each on a lane of its own (lane.go)
// or, where either end has no lanes, on the multiplexer. Closing the gRPC
// stream conn closes the session.
type Session struct {
	id      uint64
	client  bool
	cfg     *config
	log     *slog.Logger
	lossLog *peerLog // server: the listener's, for a session lost (any peer can lose one)
	// peerWarns bounds the engine's lines about what the peer sent
	// (Link.WarnPeer): the listener's on a server, the session's own on a
	// client.
	peerWarns *peerLog
	peer      Peer
	token     ID
	handshake [sha256.Size]byte // sessionHash of the handshake
	inProcess atomic.Bool       // PeerInProcess found the other end here
	boot      [2]string         // the handshake connection's local and remote addresses
	transport string            // "ucx" or "tcp"
	under     *underConn
	ep        *rdma.Endpoint
	rctx      *rdma.Context
	mux       *yamux.Session

	localAddr, remoteAddr net.Addr
	laneAddr              string // client: where to dial the lanes ("" for none)
	tcpLaneAddr           string // client: the server's TCP listener, where a wide lane is dialed

	laneMu   sync.Mutex
	lanes    []*laneConn // the lanes opened so far, closed with the session (lane.go)
	laneDone bool        // the session closed: no lane any more
	laneSlot *laneSlot   // server: the slot lanes find the session by

	bulk frameLane // the bulk lane (lane.go)
	wide frameLane // the wide lane, for large transfers, where the session has one (lane.go)

	grpcTaken atomic.Bool
	grpcLane  net.Conn      // client: the gRPC lane newSession opened (DialConn), until Conn takes it
	grpcCh    chan net.Conn // server: the gRPC stream once the client opened it

	ctrl    onceConn      // the control stream (a multiplexed stream or a lane)
	ctrlSem chan struct{} // one writer at a time on the control stream
	// openers bounds the goroutines in the multiplexer's OpenStream
	// (openStream) to streamBacklog.
	openers chan struct{}

	rtt atomic.Int64

	// What keeps the session from being idle (idleFor): inUse counts what
	// holds it open (the gRPC stream once taken), traffic what it carried
	// (control messages, streams opened).
	inUse   atomic.Int32
	traffic atomic.Uint64

	done chan struct{}
	// connClosed is closed once the gRPC conn closed (closeGracefully).
	connClosed     chan struct{}
	connClosedOnce sync.Once
	muxClosed      chan struct{} // closed once the multiplexer and the connection are closed
	// releasedCtx is done once muxClosed is closed (AfterRelease).
	releasedCtx  context.Context
	markReleased context.CancelFunc
	closedRan    chan struct{} // closed once the handler's Closed returned
	closeOnce    sync.Once
	// ending is set once this side began an orderly close (its gRPC stream
	// closed): the peer's clean end of the connection, which that close
	// prompts, may then be seen before the close completes, and is no loss.
	ending atomic.Bool
	errMu  sync.Mutex
	err    error
	wg     sync.WaitGroup // internal goroutines
	// graceMu guards graceDone and graceShut: the orderly close's goroutine
	// (closeGracefully) runs the handler's Linger, which Close joins as it
	// does the session's other goroutines.
	graceMu   sync.Mutex
	graceDone chan struct{} // closed once that goroutine returned; nil while none started
	graceShut bool          // Close began: no orderly close starts any more

	link    *Link   // what the engine holds of the session
	handler Handler // the engine's side of the session (never nil)
}

// sessionSetup is what a handshake produced.
type sessionSetup struct {
	client      bool
	cfg         *config
	peer        Peer
	token       ID
	handshake   [sha256.Size]byte // sessionHash of the handshake
	boot        [2]string         // the handshake connection's local and remote addresses
	transport   string
	conn        net.Conn // TCP conn, pipe or UCX endpoint
	ep          *rdma.Endpoint
	rctx        *rdma.Context
	laneAddr    string          // client: where to dial lanes (the UCX or TCP listener); "" for none
	tcpLaneAddr string          // client: the server's TCP listener (the address dialed), for a wide lane
	laneSlot    *laneSlot       // server: where the lanes find the session
	lossLog     *peerLog        // server: the listener's per-peer log
	ctx         context.Context // client: bounds opening the control stream and lanes (the dial's handshake)
}

// connAddrs returns c's local and remote addresses as strings ("" for none).
func connAddrs(c net.Conn) [2]string {
	var a [2]string
	for i, addr := range []net.Addr{c.LocalAddr(), c.RemoteAddr()} {
		if addr != nil {
			a[i] = addr.Network() + " " + addr.String()
		}
	}
	return a
}

// yamuxLogger sends yamux's log lines to slog at debug level.
type yamuxLogger struct{ l *slog.Logger }

func (y yamuxLogger) Write(p []byte) (int, error) {
	y.l.Debug("yamux", "msg", string(p))
	return len(p), nil
}

func newSession(st sessionSetup) (*Session, error) {
	s := &Session{
		id:          sessionIDs.Add(1),
		client:      st.client,
		cfg:         st.cfg,
		peer:        st.peer,
		token:       st.token,
		handshake:   st.handshake,
		boot:        st.boot,
		transport:   st.transport,
		under:       newUnderConn(st.conn),
		ep:          st.ep,
		rctx:        st.rctx,
		grpcCh:      make(chan net.Conn, 1),
		ctrl:        onceConn{ready: make(chan struct{})},
		ctrlSem:     make(chan struct{}, 1),
		openers:     make(chan struct{}, streamBacklog),
		done:        make(chan struct{}),
		connClosed:  make(chan struct{}),
		muxClosed:   make(chan struct{}),
		closedRan:   make(chan struct{}),
		laneAddr:    st.laneAddr,
		tcpLaneAddr: st.tcpLaneAddr,
		lossLog:     st.lossLog,
		peerWarns:   st.lossLog,
	}
	if s.peerWarns == nil {
		s.peerWarns = newPeerLog(nil, peerLogEvery) // logTo only
	}
	s.releasedCtx, s.markReleased = context.WithCancel(context.Background())
	s.bulk.init()
	s.wide.init()
	role := "server"
	if s.client {
		role = "client"
	}
	s.log = st.cfg.logger.With("component", "gdrpc/transport", "session", s.id)
	s.localAddr, s.remoteAddr = st.conn.LocalAddr(), st.conn.RemoteAddr()

	yc := yamux.DefaultConfig()
	yc.AcceptBacklog = streamBacklog
	yc.EnableKeepAlive = false // our own keepalive, with our bounds (keepalive.go)
	yc.ConnectionWriteTimeout = st.cfg.kaTimeout
	yc.MaxStreamWindowSize = st.cfg.window
	yc.StreamOpenTimeout = st.cfg.handshakeTimeout
	yc.StreamCloseTimeout = time.Minute
	yc.LogOutput = nil
	yc.Logger = log.New(yamuxLogger{s.log}, "", 0)
	var err error
	if s.client {
		s.mux, err = yamux.Client(s.under, yc)
	} else {
		s.mux, err = yamux.Server(s.under, yc)
	}
	if err != nil {
		_ = st.conn.Close()
		return nil, fmt.Errorf("gdrpc: start multiplexer: %w", err)
	}

	// The lanes this session may get a reader for: a client's, those it
	// opened; a server's, those a client may open through its lane slot
	// (serveLane: a wide lane only between hosts over UCX).
	var bulkLane, wideLane bool
	if !s.client && st.laneSlot != nil && s.useLane() {
		bulkLane, wideLane = true, s.transport == "ucx" && !s.peer.SameHost
	}
	if s.client {
		ctx, cancel := context.WithTimeout(cmp.Or(st.ctx, context.Background()), st.cfg.handshakeTimeout)
		var c, b, w net.Conn
		if s.useLane() {
			// A wide lane comes before the gRPC lane (takeLaneSession):
			// then the gRPC lane waits for Conn.
			wide := s.wantWide()
			if c, b, s.grpcLane, err = s.openLanes(ctx, st.cfg.grpcWithLanes && !wide); err == nil && wide {
				if w, err = s.openWideLane(ctx); err != nil {
					s.closeLanes()
				}
			}
		} else {
			c, err = s.open(ctx, roleControl)
		}
		cancel()
		if err != nil {
			_ = s.mux.Close()
			if s.useLane() {
				return nil, fmt.Errorf("gdrpc: open the session's lanes: %w", err)
			}
			return nil, fmt.Errorf("gdrpc: open control stream: %w", err)
		}
		s.ctrl.set(c)
		bulkLane, wideLane = b != nil, w != nil
		if b != nil {
			s.bulk.set(b)
		}
		if w != nil {
			s.wide.set(w)
		}
	}

	s.link = &Link{s: s}
	if e := st.cfg.engine; e != nil {
		s.handler = e.Attach(s, s.link)
	} else {
		s.handler = noHandler{s}
	}
	if st.laneSlot != nil && s.useLane() {
		s.laneSlot = st.laneSlot // before the registry shares s: a close forgets it
	}
	// Counted before the registry shares s: a Close from then on waits for
	// the goroutines below, which start whatever happened meanwhile.
	readers := 4
	for _, on := range []bool{bulkLane, wideLane} {
		if on {
			readers++
		}
	}
	s.wg.Add(readers)
	// In the registry before a lane can find the session: a lane that fails
	// closes the session, and the close must find it there to take it out.
	registryAdd(s)
	s.cfg.metrics.SessionUp(s.transport, s.client)
	if st.laneSlot != nil {
		if s.useLane() {
			st.laneSlot.fill(s)
		} else {
			st.laneSlot.fill(nil)
		}
	}
	go s.monitor()
	go s.acceptLoop()
	go s.keepalive()
	go s.controlReader()
	if bulkLane {
		go s.frameLaneReader(&s.bulk, "bulk lane")
	}
	if wideLane {
		go s.frameLaneReader(&s.wide, "wide lane")
	}
	s.log.Debug("session up", "role", role, "transport", s.transport,
		"peer", s.peer.ID.String(), "same_host", s.peer.SameHost,
		"local", s.localAddr.String(), "remote", s.remoteAddr.String())
	return s, nil
}

// Speaks reports whether both ends announced codec: this side's engine
// serves it and the peer's does too.
func (s *Session) Speaks(codec string) bool {
	return s.cfg.engine != nil && slices.Contains(s.cfg.engine.Codecs(), codec) && s.peer.Caps.HasCodec(codec)
}

// TrustsPeer reports whether the session's peer is trusted (WithTrustPeers).
func (s *Session) TrustsPeer() bool { return s.cfg.trustPeers }

// ID returns a number that identifies the session in this process's logs.
func (s *Session) ID() uint64 { return s.id }

// Peer returns the peer as its handshake described it.
func (s *Session) Peer() Peer {
	p := s.peer
	p.Caps = p.Caps.clone()
	p.PublicKey = append(ed25519.PublicKey(nil), p.PublicKey...)
	return p
}

// PeerID returns the peer's proven process id: Peer().ID without copying
// the rest.
func (s *Session) PeerID() ID { return s.peer.ID }

// PeerSameHost reports whether the peer said it runs on this host:
// Peer().SameHost without copying the rest.
func (s *Session) PeerSameHost() bool { return s.peer.SameHost }

// Transport returns "ucx" or "tcp": what the session runs over.
func (s *Session) Transport() string { return s.transport }

// Endpoint returns the UCX endpoint the session runs over, or nil when it
// does not run over UCX.
func (s *Session) Endpoint() *rdma.Endpoint { return s.ep }

// RDMAContext returns the UCX context of the session's endpoint, or nil when the
// session does not run over UCX.
func (s *Session) RDMAContext() *rdma.Context {
	if s.ep == nil {
		return nil
	}
	return s.rctx
}

// IsClient reports whether this end dialed the session.
func (s *Session) IsClient() bool { return s.client }

// LocalAddr and RemoteAddr return the addresses of the underlying connection.
func (s *Session) LocalAddr() net.Addr  { return s.localAddr }
func (s *Session) RemoteAddr() net.Addr { return s.remoteAddr }

// RemoteHost returns the host the session's peer connected from, as a
// listener's per-host bounds count hosts: an IPv4 address, an IPv6 /64, or,
// for addresses of other kinds, the zero Prefix, which all such sessions
// share. Unlike the peer's id, which a peer may change at every handshake,
// it bounds what one host holds.
func (s *Session) RemoteHost() netip.Prefix { return hostOfAddr(s.remoteAddr) }

// RTT returns the round trip time the last keepalive ping measured, or 0.
func (s *Session) RTT() time.Duration { return time.Duration(s.rtt.Load()) }

// Done is closed when the session has closed, for any reason.
func (s *Session) Done() <-chan struct{} { return s.done }

// ConnClosed is closed once the session's gRPC conn closed: the session may
// stay up a while longer for out-of-band transfers still under way (the
// engine's Linger), but carries no further gRPC message. A session that
// closed without its gRPC conn closing first closes only Done.
func (s *Session) ConnClosed() <-chan struct{} { return s.connClosed }

// Err returns nil while the session is open, then why it closed:
// ErrSessionClosed after Close or an orderly close (the gRPC stream closed
// first, whichever side's connection ended first then), an error wrapping
// ErrKeepAlive or ErrPeerGone otherwise.
func (s *Session) Err() error {
	s.errMu.Lock()
	defer s.errMu.Unlock()
	return s.err
}

// closedErr is what calls on a closed session return: it wraps net.ErrClosed
// and the cause.
func (s *Session) closedErr() error {
	err := s.Err()
	if err == nil || errors.Is(err, net.ErrClosed) {
		if err == nil {
			err = ErrSessionClosed
		}
		return err
	}
	return fmt.Errorf("gdrpc: session %d closed: %w: %w", s.id, net.ErrClosed, err)
}

// Released is closed once the session's connections, its lanes among them,
// are closed and released: a write on them that returned before its bytes
// went (a UCX send cut short by its deadline stays in flight, reading its
// buffer) reads that buffer no more.
func (s *Session) Released() <-chan struct{} { return s.muxClosed }

// AfterRelease arranges for f to run on a goroutine of its own once the
// session is released (Released), as context.AfterFunc does: nothing waits
// for the release meanwhile. stop undoes it, reporting whether f had not
// started yet.
func (s *Session) AfterRelease(f func()) (stop func() bool) {
	return context.AfterFunc(s.releasedCtx, f)
}

// Close closes the session and everything on it: its streams, the underlying
// connection, its registry entry. It is idempotent and waits for the
// session's own goroutines and for the underlying connection to be released
// (a UCX endpoint whose peer does not answer lingers for up to 2 s; the TCP
// connections of an orderly close whose ping the peer answered wait up to
// lingerBound for the peer's end).
func (s *Session) Close() error {
	s.closeWith(nil)
	s.graceMu.Lock()
	s.graceShut = true
	grace := s.graceDone
	s.graceMu.Unlock()
	<-s.closedRan
	<-s.muxClosed
	s.wg.Wait()
	if grace != nil {
		<-grace // Linger returns once the session is done
	}
	s.handler.Join()
	return nil
}

// closeWith closes the session with a cause (nil: closed locally). It does not
// wait, so it may run on the session's own goroutines: the session leaves the
// registry and Done is closed at once; the multiplexer and the underlying
// connection close on their own goroutine (closing a UCX endpoint may take a
// while when the peer is gone).
func (s *Session) closeWith(cause error) { s.closeLingering(cause, false) }

// closeLingering is closeWith; where linger is true, the session's TCP
// connections close as lingerClose does, within lingerBound: the session
// ends an orderly close whose ping the peer answered, and the peer may still
// be writing (its own orderly close's ping, a notice on a lane), which a
// plain close would answer with a reset that the peer reports as a loss.
func (s *Session) closeLingering(cause error, linger bool) {
	if cause == ErrPeerGone {
		// Whichever reader saw the end first, name what ended it.
		if err := s.under.firstErr(); err != nil && !errors.Is(err, io.EOF) {
			cause = fmt.Errorf("%w: %w", ErrPeerGone, err)
		}
	}
	if cause == ErrPeerGone && s.ending.Load() {
		// The peer's clean end of an orderly close this side began came
		// first. A reset, a failed write or an engine's abort is still a
		// loss.
		cause = nil
	}
	first := false
	s.closeOnce.Do(func() {
		first = true
		if cause == nil {
			cause = ErrSessionClosed
		}
		s.errMu.Lock()
		s.err = cause
		s.errMu.Unlock()
		registryRemove(s)
		if s.laneSlot != nil {
			forgetLane(s.token, s.laneSlot)
		}
		close(s.done)
		go func() {
			var until time.Time
			if linger {
				until = time.Now().Add(lingerBound)
				if tcpOf(s.under.Conn) != nil {
					s.under.lingerUntil(until) // a UCX endpoint has its own linger
				}
			}
			s.closeLanesLingering(until)
			_ = s.mux.Close() // wakes every stream, then closes the underlying connection
			close(s.muxClosed)
			s.markReleased()
		}()
	})
	if !first {
		return
	}
	s.cfg.metrics.SessionDown(s.transport, s.client, cause)
	switch {
	case errors.Is(cause, net.ErrClosed):
		s.log.Debug("session closed")
	case cause == ErrPeerGone:
		s.log.Debug("session closed by peer")
	case errors.Is(cause, ErrIdle):
		s.log.Debug("session closed: idle", "idle_timeout", s.cfg.idleTimeout)
	case errors.Is(cause, errNoGRPCStream), errors.Is(cause, errTooManyAwaiting):
		s.log.Debug("session closed", "err", cause)
	case s.lossLog != nil:
		// A peer that completes handshakes with fresh keys loses a server
		// session per connection if it likes: the listener's bound on
		// such lines applies.
		s.lossLog.Info("session lost", "session", s.id, "err", cause)
	default:
		s.log.Info("session lost", "err", cause)
	}
	s.link.end()
	// The handler's Closed takes the engine's state, and the goroutine that
	// closed the session may be one of the engine's that holds some of it (a
	// push whose write failed, which holds its payload while it writes).
	go func() {
		defer close(s.closedRan)
		s.handler.Closed()
	}()
}

// gracefulCloseBound bounds how long closeGracefully waits for the peer.
const gracefulCloseBound = 2 * time.Second

// lingerBound bounds how long an orderly close's TCP connections wait for the
// peer's end (lingerClose). A peer that answered the close's ping closes its
// own within a round trip of reading this side's end.
const lingerBound = time.Second

// closeGracefully closes the session once the peer has received everything
// queued so far (the FIN of the gRPC stream above all): a ping is answered
// only after everything sent before it was read. It does not wait; the
// session closes within gracefulCloseBound whatever the peer does. It
// starts once: a later call, or one after Close began, does nothing.
func (s *Session) closeGracefully() {
	s.connClosedOnce.Do(func() { close(s.connClosed) })
	s.ending.Store(true)
	s.graceMu.Lock()
	defer s.graceMu.Unlock()
	if s.graceShut || s.graceDone != nil {
		return
	}
	select {
	case <-s.done:
		return
	default:
	}
	grace := make(chan struct{})
	s.graceDone = grace
	go func() {
		defer close(grace)
		s.handler.Linger() // bounded: out-of-band transfers still using the session finish
		t := time.AfterFunc(gracefulCloseBound, func() { s.closeWith(nil) })
		_, err := s.mux.Ping()
		t.Stop()
		s.closeLingering(nil, err == nil)
	}()
}

// monitor closes the session when the multiplexer dies (peer closed, I/O
// error, write timeout) or the UCX endpoint fails, and once it has been idle
// for the idle timeout (idleFor).
func (s *Session) monitor() {
	defer s.wg.Done()
	var epDone <-chan struct{}
	if s.ep != nil {
		epDone = s.ep.Done()
	}
	var idle idleWatch
	var tick <-chan time.Time
	if d := s.cfg.idleTimeout; d > 0 {
		t := time.NewTicker(max(d/4, time.Millisecond))
		defer t.Stop()
		tick, idle = t.C, idleWatch{since: time.Now(), seen: s.traffic.Load()}
	}
	for dead := false; !dead; {
		select {
		case <-s.done:
			return
		case <-s.mux.CloseChan():
			dead = true
		case <-epDone:
			dead = true
		case now := <-tick:
			if s.idleFor(&idle, now) {
				return
			}
		}
	}
	cause := s.under.firstErr()
	if s.ep != nil && s.ep.Err() != nil {
		cause = s.ep.Err()
	}
	if cause == nil || errors.Is(cause, io.EOF) {
		s.closeWith(ErrPeerGone)
		return
	}
	s.closeWith(fmt.Errorf("%w: %w", ErrPeerGone, cause))
}

// idleWatch is what monitor knows of a session's idleness: since when it
// carried nothing, and its traffic count then.
type idleWatch struct {
	since time.Time
	seen  uint64
}

// idleFor takes a look, at now, at whether the session has been idle for the
// idle timeout (nothing holds it open and it carried nothing), four times per
// timeout, and closes it if so (it reports whether it did).
func (s *Session) idleFor(w *idleWatch, now time.Time) bool {
	busy := s.inUse.Load() > 0
	if n := s.traffic.Load(); busy || n != w.seen {
		w.since, w.seen = now, n
	}
	if check := s.cfg.idleCheck; check != nil {
		check(s, busy)
	}
	if d := s.cfg.idleTimeout; !busy && now.Sub(w.since) >= d {
		s.closeWith(fmt.Errorf("%w for %v", ErrIdle, d))
		return true
	}
	return false
}

// open opens a stream with a role.
func (s *Session) open(ctx context.Context, role byte) (*streamConn, error) {
	select {
	case <-s.done:
		return nil, s.closedErr()
	default:
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	st, err := s.openStream(ctx)
	if err != nil {
		if errors.Is(err, yamux.ErrSessionShutdown) {
			return nil, s.closedErr()
		}
		return nil, fmt.Errorf("gdrpc: open stream: %w", err)
	}
	s.traffic.Add(1)
	c := newStreamConn(s, st, role)
	// Nothing reads the stream before it is returned: its read deadline
	// may go with the write's.
	unbind := bindDeadline(ctx, st)
	_, err = st.Write([]byte{role})
	unbind()
	if err != nil {
		_ = c.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, c.mapErr("open", err)
	}
	return c, nil
}

// openStream opens a multiplexed stream within ctx. yamux waits, without a
// bound of its own, while streamBacklog of this side's streams wait for the
// peer's acknowledgement; a stream it opens after ctx ended is closed. The
// goroutine that waits in yamux outlives ctx, until the peer acknowledges a
// stream or the session ends: at most streamBacklog of them wait at once,
// and an open past them waits for one within ctx, so that a peer that
// acknowledges none of the streams this side opens does not pile them up.
func (s *Session) openStream(ctx context.Context) (*yamux.Stream, error) {
	type opened struct {
		st  *yamux.Stream
		err error
	}
	select {
	case s.openers <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		return nil, s.closedErr()
	}
	res := make(chan opened, 1)
	go func() {
		st, err := s.mux.OpenStream()
		<-s.openers
		res <- opened{st, err}
	}()
	select {
	case r := <-res:
		return r.st, r.err
	case <-ctx.Done():
		go func() {
			if r := <-res; r.st != nil {
				_ = r.st.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

// acceptLoop takes the streams the peer opens and hands them on by role, on
// at most MaxStreamHandlers goroutines at once; while they are busy, further
// streams wait in the multiplexer's backlog (streamBacklog), and past it are
// reset. A stream is accepted only once a handler is free for it: accepting
// acknowledges it and opens its window to the session's (16 MiB by default),
// which a stream nobody reads would fill.
func (s *Session) acceptLoop() {
	defer s.wg.Done()
	slots := make(chan struct{}, MaxStreamHandlers)
	for {
		select {
		case slots <- struct{}{}:
		case <-s.done:
			return
		}
		st, err := s.mux.AcceptStream()
		if err != nil {
			return // the session is shutting down; monitor closes it
		}
		s.wg.Add(1)
		go func() {
			defer func() { <-slots }()
			s.serveStream(st)
		}()
	}
}

// serveStream reads the role byte of an accepted stream and dispatches it.
func (s *Session) serveStream(st *yamux.Stream) {
	defer s.wg.Done()
	if id := st.StreamID(); id%2 == 1 == s.client {
		// yamux's client opens odd ids and its server even ones, and its
		// OpenStream takes the next id of this side's without looking
		// whether the peer took it: a stream the peer opened under an id
		// of this side's would be dropped from yamux's map by this side's
		// next open, and a reader of it then never wakes, not even at the
		// session's close, whose wait for that reader never ends.
		s.refuseStream(st, fmt.Errorf("gdrpc: the peer opened stream %d, an id of this side's", id))
		return
	}
	var role [1]byte
	_ = st.SetReadDeadline(time.Now().Add(s.cfg.handshakeTimeout))
	if _, err := io.ReadFull(st, role[:]); err != nil {
		s.refuseStream(st, fmt.Errorf("gdrpc: the peer opened a stream without a role: %w", err))
		return
	}
	_ = st.SetReadDeadline(time.Time{})
	s.traffic.Add(1)
	c := newStreamConn(s, st, role[0])
	switch role[0] {
	case roleGRPC:
		if s.client || !s.grpcTaken.CompareAndSwap(false, true) {
			s.refuseStream(st, errors.New("gdrpc: the peer opened an unexpected gRPC stream"))
			return
		}
		s.grpcCh <- c // buffered 1, sent at most once
	case roleControl:
		if s.client || !s.ctrl.set(c) {
			s.refuseStream(st, errors.New("gdrpc: the peer opened an unexpected control stream"))
			return
		}
	case roleBulk:
		s.handler.Bulk(c) // on this goroutine, which Close joins
	default:
		s.refuseStream(st, fmt.Errorf("gdrpc: the peer opened a stream of unknown role %#x", role[0]))
	}
}

// refuseStream ends the session over a stream its peer broke the protocol
// with (unless the session is ending anyway). Closing the stream alone would
// not do: yamux keeps what the peer sends on a stream closed on this side,
// up to the stream's window, until the peer closes it too, so a peer that
// opened many would pin that much memory each.
func (s *Session) refuseStream(st net.Conn, cause error) {
	select {
	case <-s.done:
	default:
		s.closeWith(cause)
	}
	_ = st.Close()
}

// Conn returns the stream gRPC runs on (a lane or a multiplexed stream). On
// the client it opens it (once); on the server it waits, bounded by ctx and
// the session's life, for the client to open it (once). Closing the conn
// closes the session.
func (s *Session) Conn(ctx context.Context) (net.Conn, error) {
	if s.client {
		if !s.grpcTaken.CompareAndSwap(false, true) {
			return nil, ErrConnTaken
		}
		c := s.grpcLane
		s.grpcLane = nil
		var err error
		switch {
		case c != nil:
			// Opened with the session, which may have closed since (its
			// close closed the lane).
			select {
			case <-s.done:
				return nil, s.closedErr()
			default:
			}
		case s.useLane():
			c, err = s.openLane(ctx, roleGRPC)
		default:
			c, err = s.open(ctx, roleGRPC)
		}
		if err != nil {
			return nil, err
		}
		s.inUse.Add(1) // until the session closes: closing c closes it
		return c, nil
	}
	select {
	case c := <-s.grpcCh:
		s.inUse.Add(1)
		return c, nil
	case <-s.done:
		return nil, s.closedErr()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// onceConn is a conn a session gets once (its control stream, its bulk
// lane); ready is closed when it is there.
type onceConn struct {
	mu    sync.Mutex
	c     net.Conn
	ready chan struct{}
}

// set makes c the conn, unless there is one already.
func (o *onceConn) set(c net.Conn) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	select {
	case <-o.ready:
		return false
	default:
	}
	o.c = c
	close(o.ready)
	return true
}

// controlReader reads the control stream once there is one (the client opens
// it in newSession; the server gets it as a stream or a lane).
func (s *Session) controlReader() {
	defer s.wg.Done()
	select {
	case <-s.ctrl.ready:
		s.readControl(s.ctrl.c)
	case <-s.done:
	}
}

// sendControl sends one control message: [type u8][length u32 BE][payload] on
// the control stream. Writers are serialised; a message is never interleaved
// with another. ctx bounds the wait for the stream and for the turn to write;
// once a message starts going out it is sent whole, or the session ends: a
// peer that reads none of it for the keepalive timeout is taken for gone.
func (s *Session) sendControl(ctx context.Context, typ byte, payload []byte) error {
	if len(payload) > MaxControlPayload {
		return fmt.Errorf("gdrpc: control payload of %d bytes (max %d)", len(payload), MaxControlPayload)
	}
	if err := ctx.Err(); err != nil {
		return noTurn(err)
	}
	select {
	case <-s.ctrl.ready:
	case <-s.done:
		return noTurn(s.closedErr())
	case <-ctx.Done():
		return noTurn(ctx.Err())
	}
	select {
	case s.ctrlSem <- struct{}{}:
	case <-s.done:
		return noTurn(s.closedErr())
	case <-ctx.Done():
		return noTurn(ctx.Err())
	}
	defer func() { <-s.ctrlSem }()
	select {
	case <-s.done:
		return noTurn(s.closedErr()) // it closed while this waited: nothing goes
	default:
	}
	s.traffic.Add(1)
	buf := make([]byte, controlHeaderLen+len(payload))
	buf[0] = typ
	binary.BigEndian.PutUint32(buf[1:], uint32(len(payload)))
	copy(buf[controlHeaderLen:], payload)
	// A peer that keeps its keepalive going but stops reading the control
	// stream would hold this write, and every sender after it, for good:
	// one that reads nothing for a keepalive timeout is gone.
	_ = s.ctrl.c.SetWriteDeadline(time.Now().Add(s.cfg.kaTimeout))
	if _, err := s.ctrl.c.Write(buf); err != nil {
		// A partial message would corrupt the stream: the session is done.
		s.closeWith(fmt.Errorf("%w: control write: %w", ErrPeerGone, err))
		return s.closedErr()
	}
	return nil
}

// readControl reads control messages until the stream ends; a malformed frame
// closes the session. Messages are handled concurrently, each on a goroutine
// that handles no other meanwhile. A handler that is done waits for the next
// message while few others wait (maxIdleControlHandlers), so that a message
// seldom starts a goroutine: a fresh goroutine grows and copies its stack on
// the way into a push, on the transfer's path.
func (s *Session) readControl(c net.Conn) {
	slots := make(chan struct{}, MaxControlHandlers)
	next := make(chan controlMessage) // to a handler waiting for one
	var idle atomic.Int32             // handlers waiting on next, about
	var hdr [controlHeaderLen]byte
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			select {
			case <-s.done:
			default:
				if errors.Is(err, io.EOF) {
					s.closeWith(ErrPeerGone) // the peer ended the session
				} else {
					s.closeWith(fmt.Errorf("%w: control stream ended: %w", ErrPeerGone, err))
				}
			}
			return
		}
		n := binary.BigEndian.Uint32(hdr[1:])
		if n > MaxControlPayload {
			s.closeWith(fmt.Errorf("gdrpc: control message of %d bytes (max %d) from peer", n, MaxControlPayload))
			return
		}
		payload, err := s.readControlPayload(c, int(n))
		if err != nil {
			s.closeWith(fmt.Errorf("%w: control stream ended: %w", ErrPeerGone, err))
			return
		}
		s.traffic.Add(1)
		m := controlMessage{typ: hdr[0], payload: payload}
		select {
		case slots <- struct{}{}:
		case <-s.done:
			return
		}
		select {
		case next <- m:
		default:
			s.wg.Add(1) // this goroutine holds one: Close's Wait cannot have begun
			go s.handleControl(m, next, slots, &idle)
		}
	}
}

// readControlPayload reads the n bytes of a control message's payload
// within the keepalive timeout: a header alone must not hold a megabyte for
// the session's life.
func (s *Session) readControlPayload(c net.Conn, n int) ([]byte, error) {
	if err := c.SetReadDeadline(time.Now().Add(s.cfg.kaTimeout)); err != nil {
		return nil, err
	}
	b, err := readAnnounced(c, n, 64<<10)
	if err != nil {
		return nil, err
	}
	return b, c.SetReadDeadline(time.Time{})
}

// readAnnounced reads the n bytes a peer announced into memory that starts
// at first bytes and doubles as they arrive, so that what a peer merely
// announces costs nothing up front.
func readAnnounced(r io.Reader, n, first int) ([]byte, error) {
	b := make([]byte, 0, min(n, first))
	for len(b) < n {
		if len(b) == cap(b) {
			b = slices.Grow(b, min(n-len(b), len(b)))
		}
		// Never past n: slices.Grow may give more room than asked, and
		// what follows the n bytes on r is the next message's.
		k, err := r.Read(b[len(b):min(cap(b), n)])
		b = b[:len(b)+k]
		if err != nil && len(b) < n {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return b, nil
}

// controlMessage is a control message read, for a handler.
type controlMessage struct {
	typ     byte
	payload []byte
}

// maxIdleControlHandlers bounds the handlers of one session that wait for a
// message; the others end once done.
const maxIdleControlHandlers = 2

// handleControl handles m, then the messages next hands it while it is one of
// the few waiting, until the session ends. Each message holds a slot until it
// has been handled.
func (s *Session) handleControl(m controlMessage, next <-chan controlMessage, slots <-chan struct{}, idle *atomic.Int32) {
	defer s.wg.Done()
	for {
		s.handler.Control(m.typ, m.payload)
		<-slots
		if idle.Add(1) > maxIdleControlHandlers {
			idle.Add(-1)
			return
		}
		select {
		case m = <-next:
			idle.Add(-1)
		case <-s.done:
			return
		}
	}
}

// MaxControlHandlers bounds the control messages one session handles at once;
// the control reader waits for a free slot. At most oob's Limits.Pushes of the
// handlers run pushes (an RTR's handler may become its session's pusher); the
// others return quickly, so the bound is reached only by a peer flooding.
const MaxControlHandlers = 64

// MaxStreamHandlers bounds the streams of one session being served at once
// (a bulk stream is served until its transfer ends). An honest owner opens at
// most one per push it runs.
const MaxStreamHandlers = 256

// streamBacklog bounds the streams the peer opened that wait for a handler,
// unacknowledged, and those this side opened that wait for the peer's
// acknowledgement (yamux bounds both with one setting). A stream waiting for
// a handler holds at most yamux's initial window of what the peer sent (256
// KiB, in a buffer up to twice that), so the backlog bounds what a peer that
// opens streams faster than they are served pins in one session: 16 MiB. An
// honest peer opens at most one stream per push (Limits.Pushes, at most 32)
// beside its gRPC and control streams, and they are served at once.
const streamBacklog = 32
