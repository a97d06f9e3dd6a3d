package transport

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrpc/gdrpc/internal/wire"
	"github.com/gdrpc/gdrpc/rdma"
)

// Listener accepts gdrpc sessions on a TCP port, plus plain HTTP/2 (and TLS)
// clients on the same port. It implements net.Listener: Accept returns the
// gRPC stream conn of each new session, or the raw conn of a plain client, so
// it can be handed to grpc.Server.Serve. When UCX is usable it also runs one
// UCX listener on the same IP (ephemeral port) that sessions upgrade to.
type Listener struct {
	cfg  *config
	log  *slog.Logger
	plog *peerLog // per-connection failures any peer can cause
	tcp  net.Listener
	ucx  *rdma.Listener
	rctx *rdma.Context

	acceptCh  chan net.Conn
	done      chan struct{}
	closeOnce sync.Once
	// accepted are the gRPC conns Accept returned, until Shutdown takes them
	// or their session is released, which closes it (pruned, which Shutdown
	// waits for: a released session's handlers may still run); drained is
	// made by the first Shutdown and closed once it closed them.
	acceptedMu sync.Mutex
	accepted   map[net.Conn]struct{}
	pruned     sync.WaitGroup
	drained    chan struct{}
	// accepting counts the Accepts under way: one may have taken a conn
	// as Shutdown began, which then waits for it (acceptEnded, over
	// acceptedMu) and closes it with the rest (late).
	accepting   int
	acceptEnded *sync.Cond
	late        []net.Conn
	lateTaken   bool // Shutdown took late: later ones are closed at once

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	errMu    sync.Mutex
	fatalErr error

	pendMu  sync.Mutex
	pending map[ID]*pendingUpgrade
	proven  int // the pending upgrades whose client proved its id

	handshakes chan struct{} // a slot per connection before its handshake ends
	hosts      *hostShares   // the handshake slots' share-out between remote hosts
	conns      *hostConns    // the sessions and plain connections kept, by remote host
	ucxMu      sync.Mutex
	ucxSlots   int                  // a slot per UCX endpoint before it is handed on
	ucxHeld    int                  // the slots taken
	ucxHosts   map[netip.Prefix]int // the slots taken, by remote host (hostOfAddr)
	ucxPerHost int                  // the slots one host may hold: its share of the handshakes'
	shedding   chan struct{}        // a slot per endpoint being closed for want of a UCX slot (shed)

	awaitMu  sync.Mutex
	awaiting []*Session // sessions waiting for their gRPC stream, oldest first
}

// maxHandshakes bounds the connections a listener serves before they end
// their handshake (or show they are plain gRPC or a lane): each holds a
// goroutine and its first frame for up to the handshake timeout, and anyone
// who reaches the port can open them. Past it, connections wait for a slot
// in their host's queue (hostShares, which shares the slots out between
// hosts). It bounds the UCX
// endpoints being served before they reach their session likewise: past it,
// a new endpoint is closed at once; and the sessions that wait for their
// client's gRPC stream: past it, the one that waited longest is closed. A
// variable for tests.
var maxHandshakes = 1024

var _ net.Listener = (*Listener)(nil)

// pendingUpgrade is a session whose client was told to come over UCX. Its
// endpoint may come before the handshake checked the client's proof (on a
// UCX listener that another session holds open); it is acknowledged only
// after.
type pendingUpgrade struct {
	token   ID
	proven  chan struct{} // closed once the client proved its id
	counted bool          // in Listener.proven; guarded by pendMu
	gone    chan struct{} // closed when the handshake gives up on it

	mu        sync.Mutex
	ep        *rdma.Endpoint
	early     *early // reads ep from its ack until the handshake takes it
	ready     chan struct{}
	abandoned bool
}

// Listen listens on addr (host:port, TCP). With mode auto (the default) it
// also listens on UCX when UCX is usable; with mode ucx a missing UCX is an
// error; with mode tcp it never uses UCX.
func Listen(addr string, opts ...Option) (*Listener, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	tl, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("gdrpc: listen %s: %w", addr, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &Listener{
		cfg:      cfg,
		tcp:      tl,
		acceptCh: make(chan net.Conn),
		done:     make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		pending:  map[ID]*pendingUpgrade{},
		hosts:    newHostShares(),
		conns:    &hostConns{max: cfg.hostSessions},

		handshakes: make(chan struct{}, maxHandshakes),
		ucxSlots:   maxHandshakes,
		ucxHosts:   map[netip.Prefix]int{},
		shedding:   make(chan struct{}, maxShedding),
	}
	l.ucxPerHost = l.hosts.perHost
	l.log = cfg.logger.With("component", "gdrpc/listener", "addr", tl.Addr().String())
	l.plog = newPeerLog(l.log, peerLogEvery)
	if cfg.mode != ModeTCP {
		uerr := l.listenUCX()
		if uerr != nil {
			if cfg.mode == ModeUCX {
				cancel()
				_ = tl.Close()
				return nil, fmt.Errorf("gdrpc: listen %s: transport ucx required: %w", addr, uerr)
			}
			cfg.noteNoUCX(l.log, uerr)
		}
	}
	l.wg.Add(1)
	go l.acceptTCP()
	if l.ucx != nil {
		l.wg.Add(1)
		go l.acceptUCX()
	}
	l.log.Debug("listening", "ucx", l.ucx != nil)
	return l, nil
}

func (l *Listener) listenUCX() error {
	rctx, err := l.cfg.rdmaContext()
	if err != nil {
		return err
	}
	w := rctx.Worker()
	if w == nil {
		return fmt.Errorf("UCX context has no worker: %w", rdma.ErrNotSupported)
	}
	ip := l.tcp.Addr().(*net.TCPAddr).IP
	host := ip.String()
	if ip.IsUnspecified() {
		host = "0.0.0.0"
	}
	ul, err := w.Listen(net.JoinHostPort(host, "0"))
	if err != nil {
		return err
	}
	// UCX accepts a connection before it carries a byte, and an endpoint
	// reaches this process's memory (the README's Security): a request is
	// taken only while a handshake whose client proved its id waits for its
	// endpoint, or such a session for its lanes, not whenever someone
	// reaches the port.
	ul.SetFilter(l.admitsUCX)
	l.ucx, l.rctx = ul, rctx
	return nil
}

// expectsUCX reports whether a UCX connection request may be a client's: a
// handshake whose client proved its id waits for its upgrade, or such a
// session for a lane, and a slot is free to serve its endpoint (admitsUCX
// checks the requesting host's share too).
func (l *Listener) expectsUCX() bool {
	l.ucxMu.Lock()
	full := l.ucxHeld == l.ucxSlots
	l.ucxMu.Unlock()
	if full {
		// Every slot holds an endpoint yet to send its token: a client's
		// request turned away now is made again (upgradeUCX), where one
		// taken would be closed.
		return false
	}
	l.pendMu.Lock()
	n := l.proven
	l.pendMu.Unlock()
	return n > 0 || lanesExpected()
}

// admitsUCX is the UCX listener's filter: a request is taken while a client
// is expected (expectsUCX) and the requesting host holds fewer than its share
// of the slots, so that one host's endpoints that never send a token cannot
// take every slot and keep the other hosts' clients off UCX.
func (l *Listener) admitsUCX(remote net.Addr) bool {
	if !l.expectsUCX() {
		return false
	}
	host := hostOfAddr(remote)
	l.ucxMu.Lock()
	defer l.ucxMu.Unlock()
	return l.ucxHosts[host] < l.ucxPerHost
}

// takeUCXSlot takes a slot for an endpoint from host, or reports that every
// slot is taken. Requests that came together pass the filter together, so a
// host may be served past its share by what waited in UCX's accept backlog
// at once: those are served (an honest client's burst, whose surplus closed
// would fail its upgrade or lane rather than be dialed again), and the
// filter turns the host away until it is back within its share.
func (l *Listener) takeUCXSlot(host netip.Prefix) bool {
	l.ucxMu.Lock()
	defer l.ucxMu.Unlock()
	if l.ucxHeld == l.ucxSlots {
		return false
	}
	l.ucxHeld++
	l.ucxHosts[host]++
	return true
}

func (l *Listener) releaseUCXSlot(host netip.Prefix) {
	l.ucxMu.Lock()
	defer l.ucxMu.Unlock()
	l.ucxHeld--
	if l.ucxHosts[host]--; l.ucxHosts[host] <= 0 {
		delete(l.ucxHosts, host)
	}
}

// Addr returns the TCP address clients dial.
func (l *Listener) Addr() net.Addr { return l.tcp.Addr() }

// UCXAddr returns the address of the UCX listener sessions upgrade to, or nil
// when the listener does not use UCX.
func (l *Listener) UCXAddr() net.Addr {
	if l.ucx == nil {
		return nil
	}
	return l.ucx.Addr()
}

// Accept returns the gRPC stream conn of the next session (SessionOf gives
// the session), or the raw conn of a plain HTTP/2 or TLS client. Failed
// handshakes are logged, never returned. After Close it returns an error
// wrapping net.ErrClosed.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case <-l.done:
		return nil, l.closedErr()
	default:
	}
	l.acceptedMu.Lock()
	l.accepting++
	l.acceptedMu.Unlock()
	defer func() {
		l.acceptedMu.Lock()
		l.accepting--
		if l.accepting == 0 && l.acceptEnded != nil {
			l.acceptEnded.Broadcast()
		}
		l.acceptedMu.Unlock()
	}()
	select {
	case c := <-l.acceptCh:
		return l.keep(c)
	case <-l.done:
		return nil, l.closedErr()
	}
}

// keep notes c, a conn Accept returns, for Shutdown, until its session is
// released. A plain client's raw conn is
// not noted: it carries no out-of-band transfer to wait for, and the gRPC
// server's Stop closes it. A conn that comes after Shutdown began is not
// returned: Shutdown closes it.
func (l *Listener) keep(c net.Conn) (net.Conn, error) {
	l.acceptedMu.Lock()
	defer l.acceptedMu.Unlock()
	if l.drained != nil {
		if SessionOf(c) == nil || l.lateTaken {
			// A plain client's, which no gRPC server gets now, or one
			// later than the Shutdown waits for: its session closes as
			// its conn does, on its own.
			_ = c.Close()
		} else {
			l.late = append(l.late, c)
		}
		return nil, l.closedErr()
	}
	if SessionOf(c) == nil {
		return c, nil
	}
	if l.accepted == nil {
		l.accepted = map[net.Conn]struct{}{}
	}
	l.accepted[c] = struct{}{}
	SessionOf(c).AfterRelease(func() { l.forget(c) })
	return c, nil
}

// forget drops c, an accepted conn whose session was released, and closes
// the session. Once Shutdown took the conns it has nothing to do: Shutdown
// closes them.
func (l *Listener) forget(c net.Conn) {
	l.acceptedMu.Lock()
	defer l.acceptedMu.Unlock()
	if _, ok := l.accepted[c]; !ok {
		return
	}
	delete(l.accepted, c)
	s := SessionOf(c)
	l.pruned.Go(func() { _ = s.Close() }) // before Shutdown's Wait: Shutdown takes acceptedMu first
}

func released(s *Session) bool {
	select {
	case <-s.Released():
		return true
	default:
		return false
	}
}

// Shutdown is Close that also ends the sessions Accept returned: it closes
// their gRPC conns (those the gRPC server did not close already), which
// closes each session gracefully, once its out-of-band transfers are over
// (LingerIdle after the last, at most the transfer timeout) and the peer
// read what was sent, and returns once they are closed (those released
// before it too; a TCP session whose ping the peer answered waits up to 1 s
// more for the peer's end of its connections). A response's
// payloads are pulled by the client after its call ended: a server that
// exits after grpc.Server's Stop or GracefulStop cuts those pulls short,
// one that calls Shutdown first does not. Once ctx is done, the sessions
// still closing are closed at once, their transfers fail, and Shutdown
// returns ctx's error. The raw conns of plain gRPC clients are the gRPC
// server's to close (its Stop or GracefulStop), as over any listener. A
// Shutdown called meanwhile returns with the first, or with its own
// context's error at its end.
func (l *Listener) Shutdown(ctx context.Context) error {
	_ = l.Close() // Accept returns at once from here on
	l.acceptedMu.Lock()
	first := l.drained == nil
	if first {
		l.drained = make(chan struct{})
		l.acceptEnded = sync.NewCond(&l.acceptedMu)
		for l.accepting > 0 {
			l.acceptEnded.Wait()
		}
	}
	drained := l.drained
	var conns map[net.Conn]struct{}
	if first { // a later Shutdown, come while this one waited, takes nothing
		conns = l.accepted
		for _, c := range l.late {
			if conns == nil {
				conns = map[net.Conn]struct{}{}
			}
			conns[c] = struct{}{}
		}
		l.accepted, l.late, l.lateTaken = nil, nil, true
	}
	l.acceptedMu.Unlock()
	if !first {
		select {
		case <-drained:
			return nil // done already, whatever ctx says
		default:
		}
		select {
		case <-drained:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	defer close(drained)
	cut := make(chan struct{})
	stop := context.AfterFunc(ctx, func() { close(cut) })
	defer stop()
	var wg sync.WaitGroup
	var cutShort atomic.Bool
	for c := range conns {
		wg.Go(func() {
			if CloseGracefully(c, cut) {
				cutShort.Store(true)
			}
		})
	}
	wg.Wait()
	l.pruned.Wait()
	if cutShort.Load() {
		return ctx.Err()
	}
	return nil
}

// CloseGracefully closes c, a session's gRPC conn (DialConn's or Accept's;
// a second close of it does nothing), which closes its session gracefully,
// and waits until the session is closed and its goroutines ended; once cut
// is closed it closes the session at once, and reports that it did. A conn
// of no session is closed.
func CloseGracefully(c net.Conn, cut <-chan struct{}) (cutShort bool) {
	s := SessionOf(c)
	if s == nil {
		_ = c.Close()
		return false
	}
	select {
	case <-cut: // no graceful close, which over UCX may wait for the peer
		cutShort = !released(s)
	default:
		// The conn's own close may wait too: a multiplexed stream's end is
		// a frame, which waits behind a peer that reads nothing, up to the
		// keepalive timeout (the session's Close below ends that wait).
		closed := make(chan struct{})
		go func() {
			defer close(closed)
			_ = c.Close()
		}()
		defer func() { <-closed }()
		select {
		case <-s.Released():
		case <-cut:
			cutShort = !released(s)
		}
	}
	_ = s.Close() // waits for the session's goroutines
	return cutShort
}

func (l *Listener) closedErr() error {
	l.errMu.Lock()
	ferr := l.fatalErr
	l.errMu.Unlock()
	if ferr != nil {
		return &net.OpError{Op: "accept", Net: "gdrpc", Addr: l.tcp.Addr(), Err: fmt.Errorf("%w: %w", net.ErrClosed, ferr)}
	}
	return &net.OpError{Op: "accept", Net: "gdrpc", Addr: l.tcp.Addr(), Err: net.ErrClosed}
}

// Close stops accepting, closes the UCX listener, fails the handshakes in
// progress and closes the sessions not yet returned by Accept. Sessions
// already accepted stay up (Shutdown ends them). It is idempotent and waits
// for the listener's goroutines.
func (l *Listener) Close() error {
	l.shut()
	l.wg.Wait()
	return nil
}

// shut stops accepting and closes the TCP and UCX listeners, once.
func (l *Listener) shut() {
	l.closeOnce.Do(func() {
		close(l.done)
		l.cancel()
		_ = l.tcp.Close()
		l.shutHosts()
		if l.ucx != nil {
			_ = l.ucx.Close()
		}
	})
}

func (l *Listener) fail(err error) {
	l.errMu.Lock()
	if l.fatalErr == nil {
		l.fatalErr = err
	}
	l.errMu.Unlock()
	l.shut()
}

func (l *Listener) acceptTCP() {
	defer l.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := l.tcp.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || isTemporary(err) {
				l.log.Warn("accept failed; retrying", "err", err, "backoff", backoff)
				t := time.NewTimer(backoff)
				select {
				case <-t.C:
				case <-l.done:
					t.Stop()
					return
				}
				backoff = min(backoff*2, time.Second)
				continue
			}
			l.log.Error("accept failed; listener closing", "err", err)
			l.fail(err)
			return
		}
		backoff = 5 * time.Millisecond
		l.admit(c)
	}
}

func isTemporary(err error) bool {
	t, ok := err.(interface{ Temporary() bool })
	return ok && t.Temporary()
}

// deliver hands a conn to Accept, or closes it when the listener closes.
func (l *Listener) deliver(c net.Conn) {
	select {
	case l.acceptCh <- c:
	case <-l.done:
		_ = c.Close()
	}
}

// errTooManyAwaiting closes a session that waited for its gRPC stream (or
// for Accept) longest when maxHandshakes others wait too.
var errTooManyAwaiting = errors.New("gdrpc: too many sessions of the listener waited for their gRPC stream or for Accept")

// errNoGRPCStream closes a session whose client opened no gRPC stream in
// time: a peer can cause it with each handshake, so it is logged at Debug.
var errNoGRPCStream = errors.New("gdrpc: the client opened no gRPC stream")

// await counts s among the sessions that wait for their gRPC stream, then
// for Accept, until the returned function runs. Its handshake slot is free
// by then (its lanes need slots of their own), so this bound keeps a peer
// that completes handshakes and opens no gRPC stream from holding sessions
// (connections, lanes, goroutines) without one until each times out, and
// sessions from piling up while the server does not accept. Past maxHandshakes
// the one that waited longest is closed, not the newest: an honest client
// opens its stream at once, so a peer would have to complete that many
// handshakes within that time to push one out.
func (l *Listener) await(s *Session) (done func()) {
	l.awaitMu.Lock()
	var oldest *Session
	if len(l.awaiting) >= maxHandshakes {
		oldest = l.awaiting[0]
		l.awaiting = slices.Delete(l.awaiting, 0, 1)
	}
	l.awaiting = append(l.awaiting, s)
	l.awaitMu.Unlock()
	if oldest != nil {
		oldest.closeWith(errTooManyAwaiting)
		// An honest session pushed out by someone's many handshakes.
		l.plog.Warn("session closed: too many wait for their gRPC stream or for Accept", "session", oldest.id, "peer", oldest.peer.ID, "limit", maxHandshakes)
	}
	return func() {
		l.awaitMu.Lock()
		if i := slices.Index(l.awaiting, s); i >= 0 {
			l.awaiting = slices.Delete(l.awaiting, i, i+1)
		}
		l.awaitMu.Unlock()
	}
}

// awaitingSessions returns how many sessions wait for their gRPC stream.
func (l *Listener) awaitingSessions() int {
	l.awaitMu.Lock()
	defer l.awaitMu.Unlock()
	return len(l.awaiting)
}

// serveTCP tells gdrpc from plain clients, runs the handshake, and hands the
// session's gRPC conn to Accept once the client opened it.
func (l *Listener) serveTCP(c net.Conn, host netip.Prefix) {
	defer l.wg.Done()
	s := l.handshakeTCP(c)
	l.release(host)
	if s == nil {
		return
	}
	// A session exists here to carry gRPC: one whose client opens no gRPC
	// stream would never reach gRPC (nor its limits on connections), and
	// control messages alone would keep it from the idle timeout.
	done := l.await(s)
	defer done()
	ctx, cancel := context.WithTimeout(l.ctx, l.cfg.handshakeTimeout)
	gc, err := s.Conn(ctx)
	cancel()
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			s.closeWith(fmt.Errorf("%w within %v", errNoGRPCStream, l.cfg.handshakeTimeout))
		}
		_ = s.Close()
		return
	}
	s.forgetLanes()
	// Still counted until Accept takes it: sessions that a server not (yet)
	// accepting lets pile up are bounded as those without a stream are.
	select {
	case l.acceptCh <- gc:
		return
	case <-l.done:
	case <-s.Done(): // pushed out by newer ones (await)
	}
	// Never served: closed at once, and the listener's Close waits for its
	// goroutines to end (wg).
	_ = gc.Close()
	_ = s.Close()
}

// handshakeTCP serves a connection until its handshake ends. It returns the
// session, or nil when the connection failed, was a lane, or went to Accept
// as a plain client.
func (l *Listener) handshakeTCP(c net.Conn) *Session {
	hctx, cancel := context.WithTimeout(l.ctx, l.cfg.handshakeTimeout)
	defer cancel()
	unbind := bindDeadline(hctx, c)
	var first [len(magic)]byte
	if _, err := io.ReadFull(c, first[:]); err != nil {
		unbind()
		_ = c.Close()
		l.log.Debug("connection closed before the handshake", "remote", c.RemoteAddr().String(), "err", err)
		return nil
	}
	if string(first[:]) == laneMagic {
		l.acceptLane(c, nil, unbind)
		return nil
	}
	if string(first[:]) != magic {
		if isHTTP2Preface(first[:]) || isTLSHello(first[:]) {
			unbind()
			host := hostOf(c)
			if !l.conns.take(host) {
				_ = c.Close()
				l.plog.Warn("plain client's connection closed: its host holds the listener's bound", "remote", c.RemoteAddr().String(), "limit", l.conns.max)
				return nil
			}
			l.deliver(&countedConn{replayConn: &replayConn{Conn: c, buf: first[:]}, give: func() { l.conns.give(host) }})
			return nil
		}
		unbind()
		_ = c.Close()
		l.plog.Warn("not a gdrpc, HTTP/2 or TLS client; closed", "remote", c.RemoteAddr().String(), "first_bytes", fmt.Sprintf("%q", first[:]))
		return nil
	}
	s, err := serverHandshake(hctx, l.cfg, c, true, l, unbind)
	unbind()
	if err != nil {
		_ = c.Close()
		l.plog.WarnErr("handshake failed", err, "remote", c.RemoteAddr().String())
		return nil
	}
	return s
}

// acceptLane serves a lane (TCP or UCX) whose magic was read, given what was
// read after it (got): it reads the rest of the token and the role byte, ends
// the handshake deadline (unbind) and hands the lane to its session.
func (l *Listener) acceptLane(c net.Conn, got []byte, unbind func()) {
	var rest [len(ID{}) + 1]byte // token, role
	n := copy(rest[:], got)
	_, err := io.ReadFull(c, rest[n:])
	unbind()
	if err == nil {
		var token ID
		copy(token[:], rest[:])
		var quiet *silence
		if isEndpoint(c) {
			quiet = watchSilence(c)
		}
		ctx, cancel := context.WithTimeout(l.ctx, l.cfg.handshakeTimeout)
		err = serveLane(ctx, l, c, token, rest[len(token)], quiet)
		cancel()
	} else {
		abortConn(c) // as serveUCX's endpoint before its token
	}
	if err != nil {
		l.plog.WarnErr("lane refused", err, "remote", c.RemoteAddr().String())
	}
}

// NewServerSession runs the server side of the handshake over conn (the
// client runs NewClientSession or Dial) and returns a session over conn
// (transport "tcp": no UCX upgrade). The session owns conn.
func NewServerSession(ctx context.Context, conn net.Conn, opts ...Option) (*Session, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	hctx, cancel := context.WithTimeout(ctx, cfg.handshakeTimeout)
	defer cancel()
	unbind := bindDeadline(hctx, conn)
	s, err := serverHandshake(hctx, cfg, conn, false, nil, unbind)
	unbind()
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("gdrpc: %w", ctxErr(hctx, err))
	}
	return s, nil
}

// remoteIPv4 reports whether conn's peer is at an IPv4 address (or one
// mapped into IPv6).
func remoteIPv4(conn net.Conn) bool {
	ta, ok := conn.RemoteAddr().(*net.TCPAddr)
	return ok && ta.IP.To4() != nil
}

// serverHandshake reads the hello (its magic already read if magicRead),
// answers, and, when it offered UCX, waits for the client's decision.
// unbind ends the handshake's deadline on conn (bindDeadline): a session
// that stays on conn starts reading it only after that, so that the
// deadline's end cannot fail the session's first read.
func serverHandshake(ctx context.Context, cfg *config, conn net.Conn, magicRead bool, l *Listener, unbind func()) (*Session, error) {
	version, body, err := readFrame(conn, magicRead)
	if err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF { // the header's read, as ReadFull returns them
			err = fmt.Errorf("%w: peer closed the connection before its hello: %w", ErrPeerGone, err)
		}
		if errors.Is(err, ErrMalformed) {
			_, _ = conn.Write(encodeReject(rejectMalformed, err.Error()))
		}
		return nil, fmt.Errorf("handshake: %w", err)
	}
	h, err := parseHello(version, body)
	if err != nil {
		var ve *VersionError
		if errors.As(err, &ve) {
			_, _ = conn.Write(encodeReject(rejectVersion, fmt.Sprintf("server speaks gdrpc protocol version %d, client %d", protocolVersion, ve.Remote)))
		} else {
			_, _ = conn.Write(encodeReject(rejectMalformed, err.Error()))
		}
		return nil, fmt.Errorf("handshake: %w", err)
	}
	self := cfg.identity
	if err := checkClaim(self, h.ID, h.Key); err != nil {
		_, _ = conn.Write(encodeReject(rejectIdentity, err.Error()))
		return nil, fmt.Errorf("handshake: %w", err)
	}
	// The session counts for its host from here until it is released: the
	// bound is on what a host holds, whatever identities it claims.
	var counted func() // uncounts the session, unless newSession made it
	if l != nil {
		host := hostOf(conn)
		if !l.conns.take(host) {
			why := fmt.Sprintf("the server keeps at most %d sessions from one host", l.conns.max)
			_, _ = conn.Write(encodeReject(rejectBusy, why))
			return nil, fmt.Errorf("handshake: %s", why)
		}
		counted = func() { l.conns.give(host) }
		defer func() {
			if counted != nil {
				counted()
			}
		}()
	}

	haveUCX := l != nil && l.ucx != nil
	// UCX endpoints are made over IPv4 alone (rdma.ErrIPv6): a client that
	// came over IPv6 would dial the UCX listener at an address it does not
	// listen on.
	overIPv4 := remoteIPv4(conn)
	canUCX := haveUCX && h.Caps.UCX && h.Mode != ModeTCP && cfg.mode != ModeTCP && overIPv4
	needUCX := h.Mode == ModeUCX || cfg.mode == ModeUCX
	if needUCX && !canUCX {
		var why string
		switch {
		case h.Mode == ModeTCP || cfg.mode == ModeTCP:
			why = "one side requires transport ucx, the other transport tcp"
		case !haveUCX:
			why = "transport ucx required but the server has no UCX listener"
		case !overIPv4:
			why = "transport ucx required but the client came over IPv6, and UCX sessions are made over IPv4"
		default:
			why = "transport ucx required but the client has no UCX"
		}
		_, _ = conn.Write(encodeReject(rejectMode, why))
		return nil, fmt.Errorf("handshake: %s", why)
	}

	caps := cfg.localCaps()
	if l != nil && !haveUCX && cfg.mode != ModeTCP {
		caps.UCX = false
	}
	if l == nil {
		caps.Lanes = false // no listener for the client to dial lanes to
	}
	w := welcome{
		ID:         self.ID(),
		HostID:     LocalHostID(),
		Caps:       caps,
		Transport:  "tcp",
		FallbackOK: !needUCX,
		Token:      newToken(),
		Key:        self.publicKey(),
		Nonce:      newNonce(),
	}
	// The endpoint and the lanes of the session are expected from here, so
	// that one which overtakes the client's proof waits for it; they count
	// for the UCX listener's filter only once the proof is checked (prove).
	var pu *pendingUpgrade
	var slot *laneSlot
	if canUCX {
		port := 0
		if ua, ok := l.ucx.Addr().(*rdma.Addr); ok {
			port = ua.Port
		} else if _, ps, err := net.SplitHostPort(l.ucx.Addr().String()); err == nil {
			port, _ = strconv.Atoi(ps)
		}
		if port <= 0 || port > 65535 {
			_, _ = conn.Write(encodeReject(rejectInternal, "server UCX listener has no port"))
			return nil, fmt.Errorf("handshake: UCX listener address %v has no port", l.ucx.Addr())
		}
		w.Transport, w.UCXPort = "ucx", uint16(port)
		pu = l.expect(w.Token)
		defer l.abandon(pu)
	}
	if caps.Lanes && h.Caps.Lanes {
		// The client may dial a lane as soon as its session is up, before
		// this side's is: the lane waits for it in this slot.
		slot = expectLane(w.Token, l)
		defer slot.fill(nil) // no-op once newSession filled it
	}
	welcomeFrame := encodeWelcome(w) // its signature is filled in below
	welcomeBody := welcomeFrame[frameHeaderLen:]
	sig := self.signTranscript(transcript(roleServerLabel, body, unsignedWelcome(welcomeBody)))
	copy(welcomeBody[len(welcomeBody)-signatureLen:], sig[:])
	if _, err := conn.Write(welcomeFrame); err != nil {
		return nil, fmt.Errorf("handshake: send welcome: %w", err)
	}
	// The client proves its id before anything else: no session, no UCX
	// endpoint, no lane for a peer that does not.
	version, proofBody, err := readFrame(conn, false)
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = fmt.Errorf("%w: peer closed the connection during the handshake", ErrPeerGone)
		}
		return nil, fmt.Errorf("handshake: read proof: %w", err)
	}
	p, err := parseProof(version, proofBody)
	if err == nil {
		err = checkSignature(self, h.ID, h.Key, transcript(roleClientLabel, body, welcomeBody), p.Signature)
	}
	if err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	// The lane slot first: once pu is proven the client's endpoint is
	// acknowledged, and its first lane may follow at once.
	if slot != nil && canUCX {
		// Only a session that may run over UCX may have lanes there: a
		// TCP session's slot opens no UCX listener of this process.
		slot.prove()
	}
	if pu != nil {
		l.prove(pu)
	}

	setup := sessionSetup{
		cfg:       cfg,
		peer:      Peer{ID: h.ID, PublicKey: append(ed25519.PublicKey(nil), h.Key[:]...), HostID: h.HostID, Caps: h.Caps, SameHost: h.HostID == LocalHostID()},
		token:     w.Token,
		transport: "tcp",
		conn:      conn,
		laneSlot:  slot,
		boot:      connAddrs(conn),
		handshake: sessionHash(body, welcomeBody, proofBody),
	}
	if l != nil {
		setup.lossLog = l.plog
	}
	if canUCX {
		var d [1]byte
		if _, err := io.ReadFull(conn, d[:]); err != nil {
			return nil, fmt.Errorf("handshake: read decision: %w", err)
		}
		switch d[0] {
		case decisionUCX:
			select {
			case <-pu.ready:
			case <-ctx.Done():
				return nil, fmt.Errorf("handshake: client chose UCX but its endpoint did not arrive: %w", ctx.Err())
			}
			pu.mu.Lock()
			ep, early := pu.ep, pu.early
			pu.ep = nil
			pu.mu.Unlock()
			if ep == nil {
				return nil, errors.New("handshake: UCX endpoint lost")
			}
			// What the client sent on the endpoint since its ack, which
			// nothing else read, is the session's first bytes.
			pre, err := early.stop()
			if err != nil {
				_ = ep.Close()
				return nil, fmt.Errorf("handshake: UCX endpoint: %w", err)
			}
			_ = conn.Close() // the bootstrap is done
			setup.transport, setup.conn, setup.ep, setup.rctx = "ucx", ep, ep, l.rctx
			if len(pre) > 0 {
				setup.conn = &replayConn{Conn: ep, buf: pre}
			}
		case decisionTCP:
			if needUCX {
				return nil, errors.New("handshake: client fell back to TCP but transport ucx is required")
			}
			l.plog.Info("client could not upgrade to UCX; session stays on TCP", "remote", conn.RemoteAddr().String())
			cfg.metrics.Fallback("client could not upgrade to UCX")
		default:
			return nil, fmt.Errorf("handshake: %w", wire.Malformed("unknown decision byte %d", d[0]))
		}
	}
	if err := ctx.Err(); err != nil {
		if setup.ep != nil {
			_ = setup.ep.Close()
		}
		return nil, err
	}
	if setup.ep == nil {
		unbind()
	}
	sess, err := newSession(setup)
	if err == nil && counted != nil {
		sess.AfterRelease(counted)
		counted = nil
	}
	return sess, err
}

// expect records that the handshake of token waits for its UCX endpoint.
func (l *Listener) expect(token ID) *pendingUpgrade {
	pu := &pendingUpgrade{token: token, proven: make(chan struct{}), gone: make(chan struct{}), ready: make(chan struct{})}
	l.pendMu.Lock()
	l.pending[token] = pu
	l.pendMu.Unlock()
	return pu
}

// prove records that the client of pu proved its id: its endpoint is
// acknowledged, and until it comes the UCX listener takes connection
// requests.
func (l *Listener) prove(pu *pendingUpgrade) {
	l.pendMu.Lock()
	if l.pending[pu.token] == pu && !pu.counted {
		pu.counted = true
		l.proven++
	}
	l.pendMu.Unlock()
	close(pu.proven)
}

// takePending removes and returns the pending upgrade of token, or nil.
func (l *Listener) takePending(token ID) *pendingUpgrade {
	l.pendMu.Lock()
	defer l.pendMu.Unlock()
	pu := l.pending[token]
	if pu != nil {
		l.dropPendingLocked(pu)
	}
	return pu
}

// dropPendingLocked forgets pu if it is still pending; the caller holds
// pendMu.
func (l *Listener) dropPendingLocked(pu *pendingUpgrade) {
	if l.pending[pu.token] != pu {
		return
	}
	delete(l.pending, pu.token)
	if pu.counted {
		l.proven--
	}
}

// abandon forgets a pending upgrade and closes an endpoint nobody took.
func (l *Listener) abandon(pu *pendingUpgrade) {
	l.pendMu.Lock()
	l.dropPendingLocked(pu)
	l.pendMu.Unlock()
	close(pu.gone)
	pu.mu.Lock()
	pu.abandoned = true
	ep := pu.ep
	pu.ep = nil
	pu.mu.Unlock()
	if ep != nil {
		_ = ep.Close()
	}
}

func (l *Listener) acceptUCX() {
	defer l.wg.Done()
	for {
		ep, err := l.ucx.Accept(l.ctx)
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			l.log.Warn("UCX accept failed", "err", err)
			// A failed connection request is not fatal; pace the retries.
			t := time.NewTimer(10 * time.Millisecond)
			select {
			case <-t.C:
			case <-l.done:
				t.Stop()
				return
			}
			continue
		}
		// The filter lets in any host within its share while some client
		// is expected, and an endpoint holds a goroutine until it presents
		// a token: past maxHandshakes of them, a new one is closed rather
		// than queued.
		host := hostOfAddr(ep.RemoteAddr())
		if !l.takeUCXSlot(host) {
			l.shed(ep)
			l.plog.Warn("UCX endpoint closed: too many before their token", "remote", ep.RemoteAddr().String(), "limit", l.ucxSlots)
			continue
		}
		l.wg.Add(1)
		go l.serveUCX(ep, host)
	}
}

// maxShedding bounds the endpoints a listener closes at once for want of a
// UCX slot.
const maxShedding = 8

// shed ends ep, an endpoint the listener has no slot for, unanswered: an
// honest client dials again when it sees the end or the reset (admission).
// It is closed on a goroutine of its own, for a close waits up to 2 s for a
// peer that does not answer, which would hold the accept loop from every
// other client; past maxShedding such closes at once, it is aborted (its
// peer sees a reset when UCX notices).
func (l *Listener) shed(ep *rdma.Endpoint) {
	select {
	case l.shedding <- struct{}{}:
		l.wg.Go(func() {
			defer func() { <-l.shedding }()
			_ = ep.Close()
		})
	default:
		_ = ep.Abort()
	}
}

// serveUCX checks the token a client sends first on a new UCX endpoint and
// hands the endpoint to the handshake waiting for it, once that handshake
// checked the client's proof.
func (l *Listener) serveUCX(ep *rdma.Endpoint, host netip.Prefix) {
	defer l.wg.Done()
	defer l.releaseUCXSlot(host)
	hctx, cancel := context.WithTimeout(l.ctx, l.cfg.handshakeTimeout)
	defer cancel()
	unbind := bindDeadline(hctx, ep)
	var msg [len(upgradeMagic) + 16]byte
	if _, err := io.ReadFull(ep, msg[:]); err != nil {
		unbind()
		// Aborted, not closed: a close waits for the peer's answer to its
		// end, and meanwhile UCX queues whatever the peer still sends, which
		// nobody reads; this side has sent nothing it must deliver.
		_ = ep.Abort()
		l.log.Debug("UCX endpoint ended before its token", "err", err)
		return
	}
	var token ID
	copy(token[:], msg[len(upgradeMagic):])
	if string(msg[:len(laneMagic)]) == laneMagic {
		l.acceptLane(ep, msg[len(laneMagic):], unbind)
		return
	}
	refuseEP := func(why string) {
		unbind()
		refuse(ep, 0, nil)
		l.plog.Warn(why, "remote", ep.RemoteAddr().String())
	}
	pu := l.takePending(token) // a token is good for one endpoint
	if string(msg[:len(upgradeMagic)]) != upgradeMagic || pu == nil {
		refuseEP("UCX endpoint with an unknown token; closed")
		return
	}
	// The client sends nothing more until the ack.
	quiet := watchSilence(ep)
	select {
	case <-pu.proven:
	case <-pu.gone:
	case <-hctx.Done():
	case <-quiet.broken():
	}
	if !quiet.stop() {
		unbind()
		_ = ep.Abort()
		if quiet.spoke {
			l.plog.Warn("UCX endpoint sent data before its ack; aborted", "remote", ep.RemoteAddr().String())
		} else {
			l.log.Debug("UCX endpoint ended before its ack")
		}
		return
	}
	select {
	case <-pu.proven:
	default:
		refuseEP("UCX endpoint for a handshake whose client did not prove its id; closed")
		return
	}
	_, err := ep.Write([]byte{upgradeAckOK})
	unbind()
	if err != nil {
		_ = ep.Close()
		return
	}
	pu.mu.Lock()
	if pu.abandoned {
		pu.mu.Unlock()
		_ = ep.Close()
		return
	}
	pu.ep = ep
	pu.early = readEarly(ep)
	close(pu.ready)
	pu.mu.Unlock()
}
