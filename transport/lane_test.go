package transport

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

func init() {
	LeakChecks = append(LeakChecks, func() error {
		laneWaiting.Lock()
		defer laneWaiting.Unlock()
		if n := len(laneWaiting.m); n > 0 {
			return errors.New("gRPC lane slots left after their sessions closed")
		}
		if laneWaiting.proven != 0 {
			return errors.New("proven lane slots miscounted")
		}
		return nil
	})
}

// lanePair dials one session with the given options on each side and returns
// both sessions and their gRPC conns.
func lanePair(t testing.TB, serverOpts, clientOpts []Option) (l *Listener, cs, ss *Session, cc, sc net.Conn) {
	t.Helper()
	return lanePairDialing(t, serverOpts, clientOpts, false)
}

// lanePairDialing is lanePair, its client dialing with DialConn where
// dialConn says so (else Dial, then Conn).
func lanePairDialing(t testing.TB, serverOpts, clientOpts []Option, dialConn bool) (l *Listener, cs, ss *Session, cc, sc net.Conn) {
	t.Helper()
	l, err := Listen("127.0.0.1:0", append([]Option{WithEngine(testEngine{})}, serverOpts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	clientOpts = append([]Option{WithEngine(testEngine{})}, clientOpts...)
	if dialConn {
		cc, err = DialConn(ctx, l.Addr().String(), clientOpts...)
		require.NoError(t, err)
		cs = SessionOf(cc)
		require.NotNil(t, cs)
		t.Cleanup(func() { _ = cs.Close() })
	} else {
		cs, err = Dial(ctx, l.Addr().String(), clientOpts...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = cs.Close() })
		cc, err = cs.Conn(ctx)
		require.NoError(t, err)
	}
	select {
	case sc = <-accepted:
	case <-ctx.Done():
		t.Fatal("no conn accepted")
	}
	ss = SessionOf(sc)
	require.NotNil(t, ss)
	t.Cleanup(func() { _ = ss.Close() })
	return l, cs, ss, cc, sc
}

// TestLanes: the gRPC and control streams of a UCX session run on lanes when
// both ends allow it and on multiplexed streams when either does not; bytes
// and control messages cross either way, and closing the client's gRPC conn
// ends both sessions. The same holds for a client dialing with DialConn,
// whose gRPC lane opens together with its other lanes.
func TestLanes(t *testing.T) {
	ucx := func(t *testing.T) []Option {
		return []Option{WithRDMAContext(internalUCX(t)), WithMode(ModeUCX)}
	}
	tcp := func(*testing.T) []Option { return []Option{WithMode(ModeTCP)} }
	off := func(base func(*testing.T) []Option) func(*testing.T) []Option {
		return func(t *testing.T) []Option { return append(base(t), WithLanes(false)) }
	}
	for _, tc := range []struct {
		name           string
		server, client func(*testing.T) []Option
		transport      string
		lane           bool
	}{
		{"ucx/both", ucx, ucx, "ucx", true},
		{"ucx/server-off", off(ucx), ucx, "ucx", false},
		{"ucx/client-off", ucx, off(ucx), "ucx", false},
		{"tcp/both", tcp, tcp, "tcp", true},
		{"tcp/server-off", off(tcp), tcp, "tcp", false},
		{"tcp/client-off", tcp, off(tcp), "tcp", false},
	} {
		for _, dialConn := range []bool{false, true} {
			name := tc.name
			if dialConn {
				name += "/dialconn"
			}
			t.Run(name, func(t *testing.T) { testLanes(t, tc.server(t), tc.client(t), tc.transport, tc.lane, dialConn) })
		}
	}
}

// testLanes is a case of TestLanes: the session runs over transport, with
// lanes where lane says, its client dialing with DialConn where dialConn does.
func testLanes(t *testing.T, serverOpts, clientOpts []Option, transport string, lane, dialConn bool) {
	_, cs, ss, cc, sc := lanePairDialing(t, serverOpts, clientOpts, dialConn)
	require.Equal(t, transport, cs.Transport())
	_, clientLane := cc.(*laneConn)
	_, serverLane := sc.(*laneConn)
	require.Equal(t, lane, clientLane, "client conn %T", cc)
	require.Equal(t, lane, serverLane, "server conn %T", sc)
	for _, s := range []*Session{cs, ss} {
		<-s.ctrl.ready
		_, ctrlLane := s.ctrl.c.(*laneConn)
		require.Equal(t, lane, ctrlLane, "control conn %T", s.ctrl.c)
		if lane {
			select {
			case <-s.bulk.ready: // the server's may come after the gRPC lane
			case <-time.After(10 * time.Second):
				t.Fatal("no bulk lane")
			}
		} else {
			select {
			case <-s.bulk.ready:
				t.Fatal("a bulk lane without lanes")
			default:
			}
		}
		require.False(t, s.WideLane(), "a wide lane on one host")
	}
	// A control message crosses each way.
	for _, d := range [][2]*Session{{cs, ss}, {ss, cs}} {
		inbox := controlInbox(d[1])
		require.NoError(t, d[0].link.SendControl(context.Background(), testCtlEcho, []byte("rtr")))
		select {
		case p := <-inbox:
			require.Equal(t, "rtr", string(p))
		case <-time.After(10 * time.Second):
			t.Fatal("control message lost")
		}
	}
	require.Equal(t, "gdrpc+"+transport, cc.LocalAddr().Network())

	msg := []byte("over the lane")
	_, err := cc.Write(msg)
	require.NoError(t, err)
	buf := make([]byte, len(msg))
	require.NoError(t, sc.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = io.ReadFull(sc, buf)
	require.NoError(t, err)
	require.Equal(t, msg, buf)

	// A second Conn on the client is refused either way.
	_, err = cs.Conn(context.Background())
	require.ErrorIs(t, err, ErrConnTaken)

	// Closing the client's conn: the server reads the end, and both
	// sessions close. The test engine does not linger (the oob
	// engine waits for transfers, not for reads), so the server's
	// session may close, the client's having closed, before its
	// read saw the lane's end: then the read ends with the session.
	require.NoError(t, cc.Close())
	_, err = sc.Read(buf)
	if !errors.Is(err, io.EOF) {
		require.ErrorIs(t, err, net.ErrClosed)
	}
	for _, s := range []*Session{cs, ss} {
		select {
		case <-s.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("session still up after its gRPC conn closed")
		}
	}
	_, err = cc.Write(msg)
	require.ErrorIs(t, err, net.ErrClosed)
}

// TestLanesRefused: a lane that names no session, repeats a role already
// open, or has an unknown role is refused with a zero ack and closed; the
// session itself is unharmed.
func TestLanesRefused(t *testing.T) {
	t.Run("ucx", func(t *testing.T) {
		rc := internalUCX(t)
		testLanesRefused(t, []Option{WithRDMAContext(rc), WithMode(ModeUCX)}, func(ctx context.Context, l *Listener) (net.Conn, error) {
			return rc.Worker().Dial(ctx, l.UCXAddr().String())
		})
	})
	t.Run("tcp", func(t *testing.T) {
		testLanesRefused(t, []Option{WithMode(ModeTCP)}, func(ctx context.Context, l *Listener) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", l.Addr().String())
		})
	})
}

func testLanesRefused(t *testing.T, opts []Option, dial func(context.Context, *Listener) (net.Conn, error)) {
	l, _, ss, cc, sc := lanePair(t, opts, opts)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	refused := func(token ID, role byte) {
		t.Helper()
		c, err := dial(ctx, l)
		if errors.Is(err, rdma.ErrRejected) {
			return // the UCX listener expected no lane: turned away before it carried a byte
		}
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write(append(append([]byte(laneMagic), token[:]...), role))
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(20*time.Second)))
		b, err := io.ReadAll(c)
		require.Equal(t, []byte{0}, b, "a refusal, then the end")
		if err != nil {
			require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
		}
	}
	refused(newToken(), roleGRPC)  // no such session
	refused(ss.token, roleGRPC)    // its lanes are open already: the token is spent
	refused(ss.token, roleControl) // (the control lane too)
	refused(ss.token, roleWide)    // a wide lane comes before the gRPC lane or never
	refused(ss.token, 'X')         // no lane of that role

	requireCarries(t, cc, sc)
}

// TestWideLaneRefused: a server refuses, with a zero ack, a wide lane on a
// TCP session (whose bulk lane runs over TCP already) and on a UCX session
// between two processes of one host; the lane is closed.
func TestWideLaneRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    *Session
		why  string
	}{
		{"tcp", &Session{transport: "tcp"}, "a wide lane on a TCP session"},
		{"one-host", &Session{transport: "ucx", peer: Peer{SameHost: true}}, "between processes of one host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			token := newToken()
			slot := expectLane(token, nil)
			defer forgetLane(token, slot)
			tc.s.done = make(chan struct{})
			slot.fill(tc.s)
			c, peer := net.Pipe()
			got := make(chan []byte, 1)
			go func() {
				b, _ := io.ReadAll(peer)
				got <- b
			}()
			err := serveLane(laneWait(t), nil, c, token, roleWide, nil)
			require.ErrorContains(t, err, tc.why)
			require.Equal(t, []byte{0}, <-got, "a refusal, then the end")
			_, err = c.Write([]byte("x"))
			require.ErrorIs(t, err, io.ErrClosedPipe, "the lane is closed")
		})
	}
}

// TestWideLaneTaken: a second connection asking for a session's wide lane,
// which another holds already, gets the taken answer, and a client that
// gets it fails the session instead of going on without the lane, over
// which the server would send the session's large transfers.
func TestWideLaneTaken(t *testing.T) {
	token := newToken()
	slot := expectLane(token, nil)
	defer forgetLane(token, slot)
	s := &Session{transport: "ucx", done: make(chan struct{})}
	s.wide.init()
	slot.fill(s)
	answer := func() ([]byte, error) {
		c, peer := net.Pipe()
		got := make(chan []byte, 1)
		go func() {
			b := make([]byte, 1)
			n, _ := io.ReadFull(peer, b)
			got <- b[:n]
		}()
		err := serveLane(laneWait(t), nil, c, token, roleWide, nil)
		return <-got, err
	}
	ack, err := answer()
	require.NoError(t, err)
	require.Equal(t, []byte{upgradeAckOK}, ack, "the first takes the lane")
	require.True(t, s.WideLane())
	ack, err = answer()
	require.ErrorIs(t, err, errLaneTaken)
	require.Equal(t, []byte{upgradeAckTaken}, ack, "the second is told the lane is taken")
	s.closeLanes()

	// A client told so fails the session's setup.
	_, cs, _, cc, sc := lanePair(t, []Option{WithRDMAContext(internalUCX(t)), WithMode(ModeUCX)}, []Option{WithRDMAContext(internalUCX(t)), WithMode(ModeUCX)})
	cs.tcpLaneAddr = laneAnswerer(t, []byte{upgradeAckTaken})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := cs.openWideLane(ctx)
	require.ErrorIs(t, err, errLaneTaken)
	require.Nil(t, c)
	requireCarries(t, cc, sc) // openWideLane leaves ending the session to its caller
}

// TestLaneFor: a transfer's frames go on the wide lane from WideLaneMin bytes
// on, where the session has one, and on the bulk lane otherwise.
func TestLaneFor(t *testing.T) {
	s := &Session{done: make(chan struct{})}
	s.bulk.init()
	s.wide.init()
	bulk, bulkPeer := net.Pipe()
	wide, widePeer := net.Pipe()
	defer bulk.Close()
	defer wide.Close()
	s.bulk.set(bulk)
	write := func(total uint64) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- s.writeLaneFrame(context.Background(), total, []byte("frame")) }()
		select {
		case <-time.After(10 * time.Second):
			t.Fatal("the frame was not written")
		case err := <-done:
			require.NoError(t, err)
		}
	}
	// read reads a frame from c: a write that went to the other lane would
	// wait for a reader there (net.Pipe) and fail write's wait.
	read := func(c net.Conn) <-chan string {
		got := make(chan string, 1)
		go func() {
			b := make([]byte, 5)
			_, _ = io.ReadFull(c, b)
			got <- string(b)
		}()
		return got
	}

	got := read(bulkPeer)
	write(WideLaneMin) // no wide lane yet: the bulk lane
	require.Equal(t, "frame", <-got)
	require.False(t, s.WideLane())

	s.wide.set(wide)
	require.True(t, s.WideLane())
	for _, tc := range []struct {
		total uint64
		peer  net.Conn
	}{{WideLaneMin - 1, bulkPeer}, {WideLaneMin, widePeer}, {1 << 30, widePeer}, {0, bulkPeer}} {
		got := read(tc.peer)
		write(tc.total)
		require.Equal(t, "frame", <-got)
		require.Equal(t, tc.peer == widePeer, s.WideLaneFor(tc.total), "total %d", tc.total)
	}
}

// TestOpenWideLane: a client's wide lane that cannot be dialed, or that the
// server refuses, leaves the session without one and up; one whose request
// went out and got no answer is an error (the server's side is unknown).
func TestOpenWideLane(t *testing.T) {
	l, cs, _, cc, sc := lanePair(t, []Option{WithRDMAContext(internalUCX(t)), WithMode(ModeUCX)}, []Option{WithRDMAContext(internalUCX(t)), WithMode(ModeUCX)})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// Nothing listens there.
	gone, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	cs.tcpLaneAddr = gone.Addr().String()
	require.NoError(t, gone.Close())
	c, err := cs.openWideLane(ctx)
	require.NoError(t, err)
	require.Nil(t, c)

	// The server refuses it: the session's token opens no more lanes.
	cs.tcpLaneAddr = l.Addr().String()
	c, err = cs.openWideLane(ctx)
	require.NoError(t, err)
	require.Nil(t, c)

	// A listener that takes the request and closes without an answer.
	cs.tcpLaneAddr = laneAnswerer(t, nil)
	c, err = cs.openWideLane(ctx)
	require.Error(t, err)
	require.Nil(t, c)
	require.NotErrorIs(t, err, errLaneRefused)
	require.NotErrorIs(t, err, errLaneUndialed)

	// The caller gave up: an error, not a session without a wide lane.
	cs.tcpLaneAddr = l.Addr().String()
	gaveUp, giveUp := context.WithCancel(ctx)
	giveUp()
	c, err = cs.openWideLane(gaveUp)
	require.ErrorIs(t, err, context.Canceled)
	require.Nil(t, c)

	require.False(t, cs.WideLane())
	requireLive(t, cs)
	requireCarries(t, cc, sc)
}

// laneAnswerer returns the address of a listener that takes one lane
// request, answers it with answer (nothing, where nil) and closes.
func laneAnswerer(t *testing.T, answer []byte) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		m, err := l.Accept()
		if err != nil {
			return
		}
		defer m.Close()
		if _, err := io.ReadFull(m, make([]byte, len(laneMagic)+len(ID{})+1)); err == nil && answer != nil {
			_, _ = m.Write(answer)
		}
	}()
	return l.Addr().String()
}

// requireCarries checks that bytes written on cc still arrive on sc.
func requireCarries(t *testing.T, cc, sc net.Conn) {
	t.Helper()
	_, err := cc.Write([]byte("still"))
	require.NoError(t, err)
	b := make([]byte, 5)
	require.NoError(t, sc.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = io.ReadFull(sc, b)
	require.NoError(t, err)
	require.Equal(t, "still", string(b))
}

// requireEnds waits for s to close and checks why.
func requireEnds(t *testing.T, s *Session, why string) {
	t.Helper()
	select {
	case <-s.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the session did not close")
	}
	require.ErrorContains(t, s.Err(), why)
}

// requireLive checks that s has not closed.
func requireLive(t *testing.T, s *Session) {
	t.Helper()
	select {
	case <-s.Done():
		t.Fatalf("the session closed: %v", s.Err())
	default:
	}
}

// laneListener takes lane connections on a TCP listener of its own and
// hands each one, with the role it names, to named; accepted counts the
// connections made.
type laneListener struct {
	ln       net.Listener
	named    chan namedLane
	accepted atomic.Int32
}

type namedLane struct {
	c    net.Conn
	role byte
	err  error
}

func newLaneListener(t *testing.T) *laneListener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	l := &laneListener{ln: ln, named: make(chan namedLane, 8)}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			l.accepted.Add(1)
			t.Cleanup(func() { _ = c.Close() })
			go func() {
				msg := make([]byte, len(laneMagic)+len(ID{})+1)
				err := c.SetReadDeadline(time.Now().Add(handTimeout))
				if err == nil {
					_, err = io.ReadFull(c, msg)
				}
				l.named <- namedLane{c, msg[len(msg)-1], err}
			}()
		}
	}()
	return l
}

// next returns the next lane that named its role.
func (l *laneListener) next(t *testing.T) namedLane {
	t.Helper()
	select {
	case n := <-l.named:
		require.NoError(t, n.err)
		return n
	case <-time.After(handTimeout):
		t.Fatal("no lane named its role")
		return namedLane{}
	}
}

// laneClient is a client session of transport "tcp" whose lanes go to l.
func laneClient(l *laneListener) *Session {
	return &Session{client: true, transport: "tcp", laneAddr: l.ln.Addr().String(), token: ID{1, 2, 3}, cfg: &config{handshakeTimeout: handTimeout}}
}

type openedLanes struct {
	control, bulk, grpc net.Conn
	err                 error
}

// openAllLanes opens s's control, bulk and gRPC lanes together, as DialConn
// does, and hands over what came of it.
func openAllLanes(s *Session) <-chan openedLanes {
	opened := make(chan openedLanes, 1)
	go func() {
		var o openedLanes
		o.control, o.bulk, o.grpc, o.err = s.openLanes(context.Background(), true)
		opened <- o
	}()
	return opened
}

// TestGRPCLaneNamedLast: a client opening its gRPC lane together with its
// control and bulk lanes (DialConn) names its session and role on it only
// once the other two are open, for a server forgets a session's lanes once
// its gRPC stream is there (forgetLanes; releases before this one refused
// lanes that came later); over TCP it does not even connect it before, for
// a silent connection would hold one of the server's handshake slots for
// its host. Here the server answers the control and bulk lanes only once
// both named themselves, and the gRPC lane is the third to come.
func TestGRPCLaneNamedLast(t *testing.T) {
	l := newLaneListener(t)
	s := laneClient(l)
	opened := openAllLanes(s)
	first, second := l.next(t), l.next(t)
	require.ElementsMatch(t, []byte{roleControl, roleBulk}, []byte{first.role, second.role}, "the gRPC lane named itself before the others were open")
	require.EqualValues(t, 2, l.accepted.Load(), "the gRPC lane connected before the others were open")
	for _, n := range []namedLane{first, second} {
		_, err := n.c.Write([]byte{upgradeAckOK})
		require.NoError(t, err)
	}
	third := l.next(t)
	require.Equal(t, byte(roleGRPC), third.role)
	_, err := third.c.Write([]byte{upgradeAckOK})
	require.NoError(t, err)
	o := <-opened
	require.NoError(t, o.err)
	require.Equal(t, byte(roleControl), o.control.(*laneConn).role)
	require.Equal(t, byte(roleBulk), o.bulk.(*laneConn).role)
	require.Equal(t, byte(roleGRPC), o.grpc.(*laneConn).role)
	s.closeLanes()
}

// TestLanesOneRefused: when the server refuses one of the lanes opened
// together, the others are closed and the gRPC lane is never opened; the
// error says the lane was refused.
func TestLanesOneRefused(t *testing.T) {
	l := newLaneListener(t)
	s := laneClient(l)
	opened := openAllLanes(s)
	first, second := l.next(t), l.next(t)
	ack := func(n namedLane) byte {
		if n.role == roleBulk {
			return 0 // refused
		}
		return upgradeAckOK
	}
	for _, n := range []namedLane{first, second} {
		_, err := n.c.Write([]byte{ack(n)})
		require.NoError(t, err)
	}
	var o openedLanes
	select {
	case o = <-opened:
	case <-time.After(handTimeout):
		t.Fatal("openLanes did not return")
	}
	require.ErrorIs(t, o.err, errLaneRefused)
	require.Nil(t, o.control)
	require.Nil(t, o.bulk)
	require.Nil(t, o.grpc)
	// The control lane the server took is closed: it reads the end, or a
	// reset where the client closed it before it read the server's ack.
	for _, n := range []namedLane{first, second} {
		if n.role != roleControl {
			continue
		}
		require.NoError(t, n.c.SetReadDeadline(time.Now().Add(handTimeout)))
		_, err := n.c.Read(make([]byte, 1))
		if !errors.Is(err, syscall.ECONNRESET) {
			require.ErrorIs(t, err, io.EOF)
		}
	}
	require.EqualValues(t, 2, l.accepted.Load(), "the gRPC lane connected though its session failed")
}

// laneWait bounds serveLane's wait for a session, as a listener does with
// its handshake timeout.
func laneWait(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	t.Cleanup(cancel)
	return ctx
}
