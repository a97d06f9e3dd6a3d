package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"google.golang.org/grpc/mem"
)

// Lanes: on a session whose two ends allow it, the gRPC stream, the control
// stream and the stream path's payloads each run on a connection of their
// own, a lane (a UCX endpoint on a UCX session, a TCP connection on a TCP
// one), rather than on a stream of the multiplexer. A multiplexed stream costs every message two
// goroutine hand-offs on the way out (yamux's Write waits for its send loop)
// and one on the way in (its receive loop feeds the stream), and its 256 KiB
// initial window costs a bulk payload a round trip; on a lane, the reader and
// the writer use the connection directly. The keepalive stays on the
// multiplexer, and so do bulk streams where there is no bulk lane.
//
// The bulk lane carries frames both ways. A frame is a piece of one
// transfer (at most laneFrameMax bytes) behind a header naming the transfer's
// request, its total length and the piece's offset, or a transfer's abort.
// Writers take turns frame by frame, so transfers in flight together share the
// lane instead of queueing behind one another; each transfer's frames come in
// order. The reader puts each piece into the destination of the pull it
// names, or discards the transfer's pieces when that pull is gone or does not
// fit, so one transfer given up never desynchronises the others.

// The wide lane: between two hosts that UCX reaches over its tcp transport
// alone, UCX's stream API moves bulk data at about half the kernel's TCP
// speed over the same network, while it still wins for small transfers
// (README, two hosts). There the client opens a second frame lane over the
// server's TCP listener, the wide lane, and transfers of WideLaneMin bytes
// or more go on it; the rest stay on the bulk lane. A transfer's frames, its
// abort included, all go on the lane its length picks, so they keep their
// order. The client opens the wide lane before the session is up, after its
// bulk lane and before its gRPC lane, so no transfer begins before either
// end knows whether the session has one. The server takes a wide lane only
// while the session's token still opens lanes (until its gRPC, control and
// bulk lanes are all open): a client that opens it later than its own code
// does can at worst split a transfer of its own session over two lanes,
// which the readers refuse as out of order, ending that session.

// WideLaneMin is the size in bytes of the smallest transfer that goes on a
// wide lane (Session.WideLane).
const WideLaneMin = 4 << 20

// frameLane is a lane that carries bulk frames: its conn, once there, and
// the turn its writers take, one frame at a time.
type frameLane struct {
	onceConn
	turn chan struct{} // buffered 1
}

func (l *frameLane) init() {
	l.ready = make(chan struct{})
	l.turn = make(chan struct{}, 1)
}

// conn returns the lane's conn, or nil while it has none (yet).
func (l *frameLane) conn() net.Conn {
	select {
	case <-l.ready:
		return l.c
	default:
		return nil
	}
}

// bulkLane returns the session's bulk lane, or nil while it has none (yet):
// the caller then opens a multiplexed bulk stream.
func (s *Session) bulkLane() net.Conn { return s.bulk.conn() }

// WideLane reports whether the session has a wide lane: a TCP connection
// beside a UCX session between two hosts that UCX reaches over its tcp
// transport alone, which carries the stream path's transfers of WideLaneMin
// bytes or more.
func (s *Session) WideLane() bool { return s.wide.conn() != nil }

// WideLaneFor reports whether a transfer of n bytes would go on the session's
// wide lane.
func (s *Session) WideLaneFor(n uint64) bool { return n >= WideLaneMin && s.WideLane() }

// laneFor returns the frame lane that carries the frames of a transfer of
// total bytes (the bulk lane, which the caller knows is there).
func (s *Session) laneFor(total uint64) *frameLane {
	if s.WideLaneFor(total) {
		return &s.wide
	}
	return &s.bulk
}

// writeLaneFrame writes bufs on the frame lane of a transfer of total bytes
// as one frame, whole, between the frames of other transfers, by ctx's
// deadline. An error wrapping ErrNoLaneTurn means nothing was written (ctx
// ended, or the session, while waiting for the turn); any other error may
// leave a frame cut short.
func (s *Session) writeLaneFrame(ctx context.Context, total uint64, bufs ...[]byte) error {
	l := s.laneFor(total)
	if err := s.laneTurn(ctx, l); err != nil {
		return err
	}
	defer func() { <-l.turn }()
	c := l.c
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetWriteDeadline(dl)
		defer c.SetWriteDeadline(time.Time{})
	}
	nb := net.Buffers(bufs)
	_, err := nb.WriteTo(c)
	return err
}

// noTurn marks err as the reason a frame or message waiting for its turn to
// write was not written.
func noTurn(err error) error { return fmt.Errorf("%w: %w", ErrNoLaneTurn, err) }

// laneTurn waits for l's turn, which the caller gives back (<-l.turn); an
// error wraps ErrNoLaneTurn.
func (s *Session) laneTurn(ctx context.Context, l *frameLane) error {
	if err := ctx.Err(); err != nil {
		return noTurn(err)
	}
	select {
	case l.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return noTurn(ctx.Err())
	case <-s.done:
		return noTurn(s.closedErr())
	}
}

// writeLaneFrameFrom writes a frame of hdr and body as writeLaneFrame does,
// for a body the caller may need back before the peer took it all: over TCP
// the write runs from body for at most quick, then letGo gets what of body
// is unwritten and returns the copy the rest is written from. letGo is called
// once in any case; after it the write reads body no more (with an empty
// rest: all of it was written, or the write failed). Over a lane that may
// not report a partial write (UCX), letGo gets the whole body first.
func (s *Session) writeLaneFrameFrom(ctx context.Context, total uint64, hdr, body []byte, quick time.Duration, letGo func(rest []byte) []byte) error {
	var rest []byte // what letGo gets
	called := false
	release := func(r []byte) []byte {
		called = true
		return letGo(r)
	}
	defer func() {
		if !called {
			letGo(rest)
		}
	}()
	l := s.laneFor(total)
	if err := s.laneTurn(ctx, l); err != nil {
		return err
	}
	defer func() { <-l.turn }()
	c := l.c
	dl, hasDL := ctx.Deadline()
	defer c.SetWriteDeadline(time.Time{})
	if !overTCP(c) {
		body = release(body)
		if hasDL {
			_ = c.SetWriteDeadline(dl)
		}
		nb := net.Buffers{hdr, body}
		_, err := nb.WriteTo(c)
		return err
	}
	q := time.Now().Add(quick)
	if hasDL && dl.Before(q) {
		q = dl
	}
	_ = c.SetWriteDeadline(q)
	nb := net.Buffers{hdr, body}
	_, err := nb.WriteTo(c)
	var ne net.Error
	if err == nil || !errors.As(err, &ne) || !ne.Timeout() || q.Equal(dl) {
		return err // written, or failed: the frame is whole or the lane broken
	}
	// The quick part is over: the rest of the frame goes from letGo's copy.
	left := 0
	for _, b := range nb {
		left += len(b)
	}
	bodyLeft := min(left, len(body))
	hdrLeft := hdr[len(hdr)-(left-bodyLeft):]
	cp := release(body[len(body)-bodyLeft:])
	if hasDL {
		_ = c.SetWriteDeadline(dl)
	} else {
		_ = c.SetWriteDeadline(time.Time{})
	}
	nb = net.Buffers{hdrLeft, cp}
	_, err = nb.WriteTo(c)
	return err
}

// overTCP reports whether c, a lane, runs over a TCP connection, whose writes
// report what they wrote when their deadline passes.
func overTCP(c net.Conn) bool {
	lc, ok := c.(*laneConn)
	if !ok {
		return false
	}
	_, tcp := lc.ep.(*net.TCPConn)
	return tcp
}

// frameLaneReader runs the reader of a frame lane (set by the out-of-band
// engine) once the lane is there; a reader that stops on an error ends the
// session.
func (s *Session) frameLaneReader(l *frameLane, name string) {
	defer s.wg.Done()
	select {
	case <-l.ready:
	case <-s.done:
		return
	}
	if err := s.handler.Lane(l.c); err != nil {
		select {
		case <-s.done:
		default:
			if errors.Is(err, io.EOF) {
				// The peer closed the lane: it ended the session (the lanes
				// of a closing session end in any order).
				s.closeWith(ErrPeerGone)
			} else {
				s.closeWith(fmt.Errorf("%w: %s: %w", ErrPeerGone, name, err))
			}
		}
	}
}

// laneRoles are the roles a lane may have, each opened at most once (a bit
// each in laneSlot.taken).
var laneRoles = map[byte]uint8{roleGRPC: laneGRPC, roleControl: laneControl, roleBulk: laneBulk, roleWide: laneWide}

const (
	laneGRPC uint8 = 1 << iota
	laneControl
	laneBulk
	laneWide
)

// allLaneRoles are the bits of the lanes every session with lanes opens: a
// slot with all of them open is forgotten. The wide lane is not one; a
// client that opens it does so before the gRPC lane.
const allLaneRoles = laneGRPC | laneControl | laneBulk

// useLane reports whether the session's gRPC and control streams run on
// lanes: both ends allow them and, on the client, the session knows where to
// dial them.
func (s *Session) useLane() bool {
	if s.cfg.noLane || !s.peer.Caps.Lanes {
		return false
	}
	if !s.client {
		return true
	}
	return s.laneAddr != "" && (s.transport != "ucx" || s.rctx != nil)
}

// wantWide reports whether the client opens a wide lane: it knows the
// server's TCP listener, and the session runs over UCX to another host whose
// rma_bw lanes all run over UCX's tcp transport. (oob's rmaOverTCPOnly asks
// the same of the lanes but counts none as tcp alone; here none opens no
// lane.)
func (s *Session) wantWide() bool {
	if s.transport != "ucx" || s.peer.SameHost || s.ep == nil || s.tcpLaneAddr == "" {
		return false
	}
	doms, err := s.ep.RMADomains()
	if err != nil || len(doms) == 0 {
		return false
	}
	for _, d := range doms {
		if d != "tcp" {
			return false
		}
	}
	return true
}

// openLanes opens the session's control and bulk lanes at once, the server
// taking each lane by its role in whatever order they come, and, when grpc
// (DialConn), its gRPC lane too: a UCX endpoint takes milliseconds to
// connect. The gRPC lane's endpoint connects meanwhile, but it names its
// session and role only once the other two are open (openLaneAfter): a
// server forgets the session's lanes once its gRPC stream is there
// (forgetLanes). The first to fail ends the others, its error is the one
// returned, and every lane opened is closed.
func (s *Session) openLanes(ctx context.Context, grpc bool) (control, bulk, grpcLane net.Conn, err error) {
	type opened struct {
		role byte
		c    *laneConn
		err  error
	}
	roles := []byte{roleControl, roleBulk, roleGRPC}
	if !grpc {
		roles = roles[:2]
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan opened, len(roles))
	othersOpen := make(chan struct{}) // closed once control and bulk are
	for _, role := range roles {
		var after <-chan struct{}
		if role == roleGRPC {
			after = othersOpen
		}
		go func() {
			c, err := s.openLaneAfter(ctx, role, after)
			done <- opened{role, c, err}
		}()
	}
	lanes := make(map[byte]net.Conn, len(roles))
	for range roles {
		o := <-done
		if o.err != nil && err == nil {
			err = o.err // the first failure; the others' may be the cancel below
			cancel()
		}
		if o.c != nil {
			lanes[o.role] = o.c
			if o.role != roleGRPC && lanes[roleControl] != nil && lanes[roleBulk] != nil {
				close(othersOpen)
			}
		}
	}
	if err != nil {
		s.closeLanes()
		return nil, nil, nil, err
	}
	return lanes[roleControl], lanes[roleBulk], lanes[roleGRPC], nil
}

// openWideLane opens the wide lane (client). Where it could not be dialed or
// the server refused it, it returns nil and no error: the session runs
// without one. Any other failure is the session's: the caller gave up; the
// request was written and no answer read, which leaves the server's side
// unknown (the server ends a session whose wide lane it took and then lost);
// or another connection holds the session's wide lane, where the server
// would send the session's large transfers.
func (s *Session) openWideLane(ctx context.Context) (net.Conn, error) {
	c, err := s.openLane(ctx, roleWide)
	switch {
	case err == nil:
		return c, nil
	case ctx.Err() != nil:
		// The caller gave up (Dial's context): not a server without a wide lane.
		return nil, err
	case errors.Is(err, errLaneUndialed) || errors.Is(err, errLaneRefused):
		s.log.Debug("no wide lane; large transfers stay on the bulk lane", "addr", s.tcpLaneAddr, "err", err)
		return nil, nil
	}
	return nil, err
}

// isEndpoint reports whether c, a lane's connection, is a UCX endpoint.
func isEndpoint(c net.Conn) bool {
	_, ok := c.(*rdma.Endpoint)
	return ok
}

// Why a lane did not open (openLane): its connection could not be made, so
// nothing reached the server; the server answered with a refusal; or another
// connection holds the lane's role on the session already, which only one
// that has the session's token can have opened: a client must not go on
// without the lane then, for the server sends over it.
var (
	errLaneUndialed = errors.New("not dialed")
	errLaneRefused  = errors.New("the server refused it")
	errLaneTaken    = errors.New("another connection holds this lane of the session")
)

// openLane dials the server's listener for a lane of the role and proves
// the session with its token (client): the UCX or TCP listener, as the
// session runs, and the TCP one for the wide lane.
func (s *Session) openLane(ctx context.Context, role byte) (*laneConn, error) {
	return s.openLaneAfter(ctx, role, nil)
}

// openLaneAfter is openLane that waits for after (if not nil) to close
// before it names the session and role: a UCX endpoint connects meanwhile,
// a TCP connection only then, for until it names them it holds one of the
// server's handshake slots for its host, which the lanes it waits for may
// be queued behind.
func (s *Session) openLaneAfter(ctx context.Context, role byte, after <-chan struct{}) (*laneConn, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.handshakeTimeout)
	defer cancel()
	var ep net.Conn
	var err error
	addr := s.laneAddr
	if role == roleWide {
		addr = s.tcpLaneAddr
	}
	overUCX := s.transport == "ucx" && role != roleWide
	wait := func() error {
		if after == nil {
			return nil
		}
		select {
		case <-after:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("gdrpc: open lane to %s: %w: %w", addr, errLaneUndialed, ctx.Err())
		}
	}
	var w *rdma.Worker
	if overUCX {
		if w = s.rctx.Worker(); w == nil {
			return nil, fmt.Errorf("gdrpc: open lane: UCX context has no worker: %w", rdma.ErrNotSupported)
		}
	}
	msg := append(append([]byte(laneMagic), s.token[:]...), role)
	var a admission
	for {
		if overUCX {
			ep, err = a.dial(ctx, w, addr)
		} else {
			if err := wait(); err != nil {
				return nil, err
			}
			var d net.Dialer
			ep, err = d.DialContext(ctx, "tcp", addr)
		}
		if err != nil {
			return nil, fmt.Errorf("gdrpc: open lane to %s: %w: %w", addr, errLaneUndialed, ctxErr(ctx, err))
		}
		if overUCX {
			if err := wait(); err != nil {
				_ = ep.Close()
				return nil, err
			}
		}
		ack, err := presentToken(ctx, ep, msg)
		switch {
		case overUCX && a.shed(ctx, err):
			if err := a.wait(ctx); err != nil {
				return nil, fmt.Errorf("gdrpc: open lane: %w", ctxErr(ctx, err))
			}
			continue
		case err != nil:
			return nil, fmt.Errorf("gdrpc: open lane: %w", err)
		case ack == upgradeAckTaken:
			_ = ep.Close()
			return nil, fmt.Errorf("gdrpc: open lane: %w", errLaneTaken)
		case ack != upgradeAckOK:
			_ = ep.Close()
			return nil, fmt.Errorf("gdrpc: open lane: %w", errLaneRefused)
		}
		return s.attachLane(ep, role)
	}
}

// attachLane adds ep to the session's lanes and returns its conn. It fails,
// closing ep, when the session is closed.
func (s *Session) attachLane(ep net.Conn, role byte) (*laneConn, error) {
	s.laneMu.Lock()
	if s.laneDone {
		s.laneMu.Unlock()
		_ = ep.Close()
		return nil, s.closedErr()
	}
	c := &laneConn{connCommon: newConnCommon(s, role), ep: ep}
	if tc, ok := ep.(*net.TCPConn); ok {
		c.raw, _ = tc.SyscallConn() // nil on error: ReadOnReady reads as Read does
		c.ready.fn = c.ready.read
	}
	s.lanes = append(s.lanes, c)
	s.laneMu.Unlock()
	return c, nil
}

// closeLanes closes the session's lanes and refuses later ones (the session
// is closing).
func (s *Session) closeLanes() { s.closeLanesLingering(time.Time{}) }

// closeLanesLingering is closeLanes; where until is not zero, a lane over TCP
// closes as lingerClose does, until then at the latest. Its conn is closed
// first: the session's readers of the lane read no more of it (one whose
// read was under way ends with that read), and what the peer still sends
// reaches none of the session's handlers.
func (s *Session) closeLanesLingering(until time.Time) {
	s.laneMu.Lock()
	lanes := s.lanes
	s.lanes, s.laneDone = nil, true
	s.laneMu.Unlock()
	// Together: a UCX lane's close waits up to 2 s for a peer that does not
	// answer, and a session has up to four.
	var wg sync.WaitGroup
	for _, c := range lanes {
		wg.Go(func() {
			if tc := tcpOf(c.ep); tc != nil && !until.IsZero() {
				c.closed.Store(true)
				_ = lingerClose(tc, until)
				return
			}
			_ = c.ep.Close()
		})
	}
	wg.Wait()
}

// serveLane takes a lane a client dialed: the token names the session
// (server side), the role what runs on it. It answers with the ack byte:
// upgradeAckOK, upgradeAckTaken where another connection holds the role on
// the session, 0 for any other refusal. The lane may arrive before the
// handshake made the session; it waits for it until ctx ends (the
// handshake timeout, or the listener's close). quiet, if not nil, watches
// the lane, which must send nothing until the ack: a lane that does is
// aborted.
func serveLane(ctx context.Context, l *Listener, ep net.Conn, token ID, role byte, quiet *silence) error {
	s, err := takeLaneSession(ctx, l, token, role, quiet.broken())
	var c *laneConn
	switch {
	case errors.Is(err, errEndedEarly):
		err = quiet.err()
	case err != nil:
	case !quiet.stop():
		err = quiet.err()
	case isEndpoint(ep) && s.transport != "ucx":
		// A TCP session's peer is not trusted with UCX: its handshake opened
		// no UCX listener, and a lane must not keep an endpoint that another
		// client's handshake let in for a moment (the listeners' lane slots
		// are the process's).
		err = errors.New("a lane over UCX on a TCP session")
	case role == roleGRPC && !s.grpcTaken.CompareAndSwap(false, true):
		err = fmt.Errorf("the session's gRPC stream: %w", errLaneTaken)
	case role == roleWide && s.transport != "ucx":
		err = errors.New("a wide lane on a TCP session")
	case role == roleWide && isEndpoint(ep):
		err = errors.New("a wide lane over UCX")
	case role == roleWide && s.peer.SameHost:
		// The client asks only where its endpoint's lanes for large puts are
		// all tcp (wantWide); the server does not second-guess that from its
		// own endpoint, whose lanes UCX chose separately, only that the
		// session runs between hosts.
		err = errors.New("a wide lane between processes of one host")
	default:
		c, err = s.attachLane(ep, role)
	}
	if err == nil && (role == roleControl && !s.ctrl.set(c) || role == roleBulk && !s.bulk.set(c) || role == roleWide && !s.wide.set(c)) {
		err = fmt.Errorf("the session's %q lane: %w", role, errLaneTaken)
	}
	switch {
	case errors.Is(err, errSpokeEarly), errors.Is(err, errEndedEarly):
		abortConn(ep)
		return err
	case err != nil:
		ack := byte(0)
		if errors.Is(err, errLaneTaken) {
			ack = upgradeAckTaken
		}
		refuse(ep, ack, quiet)
		return err
	}
	if _, err := ep.Write([]byte{upgradeAckOK}); err != nil {
		_ = c.Close()
		return err
	}
	if role == roleGRPC {
		s.grpcCh <- c // buffered 1, sent at most once (grpcTaken)
	}
	return nil
}

// laneSlot is where a server session that may get lanes is found by its
// token: made when the welcome offers lanes, proven once the client proved
// its id, filled when the session is up (with nil when the handshake fails
// or the session runs without lanes). A lane that comes before the session
// waits in it; only a proven slot opens the UCX listener (lanesExpected).
type laneSlot struct {
	token  ID
	once   sync.Once
	ready  chan struct{}
	s      *Session
	owner  *Listener // whose handshake made the slot: only its ports take the lanes
	taken  uint8     // laneRoles opened; guarded by laneWaiting
	proven bool      // counted in laneWaiting.proven; guarded by laneWaiting
}

var laneWaiting = struct {
	sync.Mutex
	m      map[ID]*laneSlot
	proven int // the slots in m whose client proved its id
}{m: map[ID]*laneSlot{}}

func expectLane(token ID, owner *Listener) *laneSlot {
	slot := &laneSlot{token: token, owner: owner, ready: make(chan struct{})}
	laneWaiting.Lock()
	laneWaiting.m[token] = slot
	laneWaiting.Unlock()
	return slot
}

// prove records that the slot's client proved its id: from now on the slot
// opens the UCX listener to lanes, until it is forgotten.
func (slot *laneSlot) prove() {
	laneWaiting.Lock()
	defer laneWaiting.Unlock()
	if laneWaiting.m[slot.token] == slot && !slot.proven {
		slot.proven = true
		laneWaiting.proven++
	}
}

// fill hands the slot its session, or nil: no lane for this token. The first
// call counts; a nil fill also forgets the slot.
func (slot *laneSlot) fill(s *Session) {
	slot.once.Do(func() {
		slot.s = s
		close(slot.ready)
		if s == nil {
			forgetLane(slot.token, slot)
		}
	})
}

// lanesExpected reports whether some session of this process, whose client
// proved its id, waits for a lane.
func lanesExpected() bool {
	laneWaiting.Lock()
	defer laneWaiting.Unlock()
	return laneWaiting.proven > 0
}

// takeLaneSession returns the session waiting for a lane of the role with
// this token. A token opens one lane of each role, and the gRPC lane last
// (openLanes): once it is taken, or the gRPC, control and bulk lanes all
// are, the token is forgotten, so that every lane after the gRPC lane is
// refused alike, whether or not the session took its gRPC stream yet (a
// wide lane comes before them or not at all).
func takeLaneSession(ctx context.Context, l *Listener, token ID, role byte, broken <-chan struct{}) (*Session, error) {
	bit, ok := laneRoles[role]
	if !ok {
		return nil, fmt.Errorf("unknown lane role %#x", role)
	}
	laneWaiting.Lock()
	slot := laneWaiting.m[token]
	laneWaiting.Unlock()
	if slot == nil || slot.owner != l {
		// A client dials its lanes where it dialed its handshake: a token
		// of another listener's handshake is none of this one's.
		return nil, errors.New("no session waits for a lane with this token")
	}
	select {
	case <-slot.ready:
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.Canceled) {
			return nil, fmt.Errorf("the listener closed: %w", net.ErrClosed)
		}
		return nil, errors.New("the session of this token did not come up")
	case <-broken:
		return nil, errEndedEarly // serveLane tells which
	}
	if slot.s == nil {
		return nil, errors.New("the session of this token runs without lanes")
	}
	laneWaiting.Lock()
	defer laneWaiting.Unlock()
	if slot.taken&bit != 0 {
		return nil, fmt.Errorf("the session's %q lane: %w", role, errLaneTaken)
	}
	slot.taken |= bit
	if role == roleGRPC || slot.taken&allLaneRoles == allLaneRoles {
		dropLaneLocked(token, slot)
	}
	return slot.s, nil
}

// forgetLane removes the slot of token if it is still slot.
func forgetLane(token ID, slot *laneSlot) {
	laneWaiting.Lock()
	dropLaneLocked(token, slot)
	laneWaiting.Unlock()
}

// dropLaneLocked removes the slot of token if it is still slot; the caller
// holds laneWaiting.
func dropLaneLocked(token ID, slot *laneSlot) {
	if laneWaiting.m[token] != slot {
		return
	}
	delete(laneWaiting.m, token)
	if slot.proven {
		laneWaiting.proven--
	}
}

// forgetLanes forgets the session's lane slot (server) once its gRPC stream
// is there. A client opens its other lanes before that one, so the slot
// waits then only for lanes an honest client never opens, and would keep
// the UCX listener taking connection requests for the session's life.
func (s *Session) forgetLanes() {
	if s.laneSlot != nil {
		forgetLane(s.token, s.laneSlot)
	}
}

// laneConn is a lane with gdrpc's error semantics (those of streamConn):
// timeouts are *TimeoutError, a failed peer is ErrPeerGone, and after Close
// every call fails with an error wrapping net.ErrClosed.
type laneConn struct {
	connCommon
	ep  net.Conn        // *rdma.Endpoint or a TCP conn
	raw syscall.RawConn // a TCP ep's, for ReadOnReady; nil for an endpoint
	// ready is ReadOnReady's read of raw, kept with the conn so that a read
	// allocates nothing (a closure over its results would escape to the
	// heap on every read). gRPC reads a conn from one goroutine at a time.
	ready readyRead
}

// readyRead is one ReadOnReady of a TCP lane: what it asks for, what the
// read found, and the callback raw.Read runs, made once.
type readyRead struct {
	size int
	pool mem.BufferPool
	buf  *[]byte
	n    int
	err  error
	fn   func(fd uintptr) bool
}

// read is the raw conn's callback: it takes a buffer only once the socket
// has bytes, and gives it back when it had none after all.
func (r *readyRead) read(fd uintptr) bool {
	r.buf = r.pool.Get(r.size)
	r.n, r.err = syscall.Read(int(fd), *r.buf)
	if r.err == syscall.EAGAIN || r.err == syscall.EWOULDBLOCK {
		r.pool.Put(r.buf)
		r.buf = nil
		return false // not readable yet: wait in Go's poller
	}
	return true
}

var _ net.Conn = (*laneConn)(nil)

func (c *laneConn) Read(b []byte) (int, error)  { return c.do("read", c.ep.Read, b) }
func (c *laneConn) Write(b []byte) (int, error) { return c.do("write", c.ep.Write, b) }

// ReadOnReady is gRPC's optional reader of a conn (its framer's reads that
// pin no memory): over TCP it waits for the socket to be readable before it
// takes a buffer of bufSize from pool, so an idle gRPC lane holds none, as a
// plain gRPC connection over TCP holds none; over a UCX endpoint it reads as
// Read does. It returns the buffer with n > 0 bytes read, or nil and an
// error (io.EOF once the peer closed), in the conn's terms. One goroutine at
// a time calls it, as gRPC's reader does.
func (c *laneConn) ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error) {
	if err := c.open("read"); err != nil {
		return nil, 0, err
	}
	if c.raw == nil {
		buf := pool.Get(bufSize)
		for {
			n, err := c.ep.Read(*buf)
			if err != nil {
				err = c.mapErr("read", err)
			}
			switch {
			case n > 0:
				return buf, n, err // the bytes first, as a Read's
			case err != nil:
				pool.Put(buf)
				return nil, 0, err
			}
		}
	}
	r := &c.ready
	r.size, r.pool, r.buf, r.n, r.err = bufSize, pool, nil, 0, nil
	if err := c.raw.Read(r.fn); err != nil {
		r.err = err // the poller's: a deadline, or the conn closed
	}
	buf, n, rerr := r.buf, r.n, r.err
	r.pool, r.buf, r.err = nil, nil, nil // nothing of this read stays reachable from the conn
	if rerr == nil && n > 0 {
		return buf, n, nil
	}
	if rerr == nil {
		rerr = io.EOF // a read of 0 bytes: the peer closed
	}
	if buf != nil {
		pool.Put(buf)
	}
	return nil, 0, c.mapErr("read", rerr)
}

// do runs a read or a write of the lane, its error in the conn's terms.
func (c *laneConn) do(op string, f func([]byte) (int, error), b []byte) (int, error) {
	if err := c.open(op); err != nil {
		return 0, err
	}
	n, err := f(b)
	if err != nil {
		err = c.mapErr(op, err)
	}
	return n, err
}

func (c *laneConn) mapErr(op string, err error) error {
	if err == io.EOF {
		return err
	}
	switch {
	case c.closed.Load():
		return c.opErr(op, net.ErrClosed)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return c.opErr(op, &TimeoutError{Op: op})
	case errors.Is(err, net.ErrClosed):
		// The session closed the lane under us.
		return c.opErr(op, c.sess.closedErr())
	}
	// The connection broke (*rdma.EndpointError, a reset TCP connection).
	return c.opErr(op, fmt.Errorf("%w: %w", ErrPeerGone, err))
}

// Close closes the lane (the peer reads what was written, then io.EOF).
// Closing the gRPC lane closes the session too, once the peer got everything
// (Session.closeGracefully).
func (c *laneConn) Close() error {
	c.closeOnceWith(func() { _ = c.ep.Close() })
	return nil
}

func (c *laneConn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

func (c *laneConn) SetReadDeadline(t time.Time) error {
	if err := c.open("set deadline"); err != nil {
		return err
	}
	return c.ep.SetReadDeadline(t)
}

func (c *laneConn) SetWriteDeadline(t time.Time) error {
	if err := c.open("set deadline"); err != nil {
		return err
	}
	return c.ep.SetWriteDeadline(t)
}
