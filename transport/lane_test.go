package transport

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
)

func init() {
	LeakChecks = append(LeakChecks, func() error {
		laneWaiting.Lock()
		defer laneWaiting.Unlock()
		if n := len(laneWaiting.m); n > 0 {
			return errors.New("gRPC lane slots left after their sessions closed")
		}
		return nil
	})
}

// lanePair dials one session with the given options on each side and returns
// both sessions and their gRPC conns.
func lanePair(t testing.TB, serverOpts, clientOpts []Option) (l *Listener, cs, ss *Session, cc, sc net.Conn) {
	t.Helper()
	l, err := Listen("127.0.0.1:0", serverOpts...)
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
	cs, err = Dial(ctx, l.Addr().String(), clientOpts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cs.Close() })
	cc, err = cs.Conn(ctx)
	require.NoError(t, err)
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
// ends both sessions.
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
		t.Run(tc.name, func(t *testing.T) {
			_, cs, ss, cc, sc := lanePair(t, tc.server(t), tc.client(t))
			require.Equal(t, tc.transport, cs.Transport())
			_, clientLane := cc.(*laneConn)
			_, serverLane := sc.(*laneConn)
			require.Equal(t, tc.lane, clientLane, "client conn %T", cc)
			require.Equal(t, tc.lane, serverLane, "server conn %T", sc)
			for _, s := range []*Session{cs, ss} {
				<-s.ctrl.ready
				_, ctrlLane := s.ctrl.c.(*laneConn)
				require.Equal(t, tc.lane, ctrlLane, "control conn %T", s.ctrl.c)
				if tc.lane {
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
			}
			// A control message crosses each way.
			for _, d := range [][2]*Session{{cs, ss}, {ss, cs}} {
				inbox := controlInbox(d[1])
				require.NoError(t, d[0].SendControl(context.Background(), testCtlEcho, []byte("rtr")))
				select {
				case p := <-inbox:
					require.Equal(t, "rtr", string(p))
				case <-time.After(10 * time.Second):
					t.Fatal("control message lost")
				}
			}
			require.Equal(t, "gdrpc+"+tc.transport, cc.LocalAddr().Network())

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
			// sessions close.
			require.NoError(t, cc.Close())
			_, err = sc.Read(buf)
			require.ErrorIs(t, err, io.EOF)
			for _, s := range []*Session{cs, ss} {
				select {
				case <-s.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("session still up after its gRPC conn closed")
				}
			}
			_, err = cc.Write(msg)
			require.ErrorIs(t, err, net.ErrClosed)
		})
	}
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
	refused(ss.token, 'X')         // no lane of that role

	_, err := cc.Write([]byte("still"))
	require.NoError(t, err)
	b := make([]byte, 5)
	require.NoError(t, sc.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = io.ReadFull(sc, b)
	require.NoError(t, err)
	require.Equal(t, "still", string(b))
}

// TestBulkLaneFrames: pieces on the bulk lane land in the destination of the
// pull their transfer names, interleaved with other transfers' pieces. A
// transfer for no pull, or too long for its pull's destination (which fails),
// is dropped; an aborted transfer fails its pull. The session lives on.
func TestBulkLaneFrames(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	piece := func(p *pull, req uint64, total int, off int, body string) {
		t.Helper()
		if p != nil {
			req = p.req
		}
		f := laneFrame{kind: laneData, req: req, total: uint64(total), off: uint64(off), n: uint64(len(body))}
		require.NoError(t, cs.writeLaneFrame(context.Background(), f.marshal(), []byte(body)))
	}
	p1, p2, p3, p4 := newPull(5), newPull(4), newPull(3), newPull(6)
	piece(nil, 1<<62, 8, 0, "nobo") // no such pull: dropped
	piece(p1, 0, 5, 0, "he")        // p1 begins
	piece(p3, 0, 3, 0, "e")         // p3 begins between p1's pieces
	piece(p2, 0, 8, 0, "too ")      // longer than p2's destination: p2 fails
	piece(nil, 1<<62, 8, 4, "dy's") // the rest of the dropped transfer
	piece(p1, 0, 5, 2, "llo")       // p1 done
	piece(p4, 0, 6, 0, "abc")       // p4 begins...
	piece(p2, 0, 8, 4, "long")      // dropped
	f := laneFrame{kind: laneAbort, req: p4.req, total: 6, off: 3}
	require.NoError(t, cs.writeLaneFrame(context.Background(), f.marshal())) // ...and is given up
	piece(p3, 0, 3, 1, "nd")                                                 // p3 done
	require.NoError(t, bulkResult(t, p1))
	require.ErrorContains(t, bulkResult(t, p2), "announces 8 bytes, destination holds 4")
	require.NoError(t, bulkResult(t, p3))
	require.ErrorContains(t, bulkResult(t, p4), "gave the transfer up")
	for p, want := range map[*pull]string{p1: "hello", p3: "end"} {
		b, err := p.dst.HostBytes()
		require.NoError(t, err)
		require.Equal(t, want, string(b))
	}
	requireLive(t, ss)
}

// TestBulkLaneBroken: a piece that does not continue its transfer breaks the
// lane; the transfers under way fail and the session ends.
func TestBulkLaneBroken(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	p := newPull(8)
	f := laneFrame{kind: laneData, req: p.req, total: 8, n: 4}
	require.NoError(t, cs.writeLaneFrame(context.Background(), f.marshal(), []byte("1234")))
	f.off = 6 // a gap
	f.n = 2
	// The server drops the lane on reading the header, so the body's write
	// may fail or not.
	_ = cs.writeLaneFrame(context.Background(), f.marshal(), []byte("78"))
	require.ErrorContains(t, bulkResult(t, p), "bulk lane closed mid-transfer")
	requireEnds(t, ss, "which is at 4 of 8")
}

// TestBulkLaneSettleBetweenFrames: a pull given up between two frames of
// its transfer settles at once (the reader holds the destination only while
// it reads a frame); the transfer's later frames are dropped, and the lane
// carries on.
func TestBulkLaneSettleBetweenFrames(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	ctx := context.Background()
	p := newPull(8)
	f := laneFrame{kind: laneData, req: p.req, total: 8, n: 4}
	require.NoError(t, cs.writeLaneFrame(ctx, f.marshal(), []byte("1234")))
	settled := make(chan struct{})
	go func() {
		p.settled()
		close(settled)
	}()
	select {
	case <-settled:
	case <-time.After(20 * time.Second):
		t.Fatal("settling waits for the rest of the transfer")
	}
	f.off = 4
	require.NoError(t, cs.writeLaneFrame(ctx, f.marshal(), []byte("5678")))
	next := newPull(3)
	g := laneFrame{kind: laneData, req: next.req, total: 3, n: 3}
	require.NoError(t, cs.writeLaneFrame(ctx, g.marshal(), []byte("end")))
	require.NoError(t, bulkResult(t, next))
	b, err := next.dst.HostBytes()
	require.NoError(t, err)
	require.Equal(t, "end", string(b))
	select {
	case err := <-p.bulk:
		t.Fatalf("a settled pull got an outcome: %v", err)
	default:
	}
	requireLive(t, ss)
}

// TestBulkLaneTooManyOpen: a peer that opens more transfers than the reader
// keeps breaks the lane and ends the session.
func TestBulkLaneTooManyOpen(t *testing.T) {
	ss, cs, _ := bulkLanePair(t)
	ctx := context.Background()
	for i := range maxLaneTransfers + 1 {
		f := laneFrame{kind: laneData, req: 1<<40 + uint64(i), total: 2, n: 1}
		if cs.writeLaneFrame(ctx, f.marshal(), []byte("x")) != nil {
			break // the server dropped the lane already
		}
	}
	requireEnds(t, ss, "more than 4096 transfers open")
}

// TestPushLane: a transfer longer than a frame arrives whole in pieces; a
// source shorter or longer than the transfer, or a context that ended, stops
// it with an abort that fails the receiver's pull, and the lane carries on.
func TestPushLane(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	ctx := context.Background()
	want := bytes.Repeat([]byte("0123456789abcdef"), (2*laneFrameMax+100)/16)
	p := newPull(len(want))
	require.NoError(t, pushLane(ctx, cs, &rtr{Req: p.req, Length: uint64(len(want))}, Source{Bytes: want}))
	require.NoError(t, bulkResult(t, p))
	got, err := p.dst.HostBytes()
	require.NoError(t, err)
	require.Equal(t, want, got)

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		src  string
		err  string
	}{
		{"short source", ctx, "abc", "the source holds 3 bytes, the transfer 5"},
		{"long source", ctx, "abcdefg", "the source holds 7 bytes, the transfer 5"},
		{"context ended", canceled, "abcde", context.Canceled.Error()},
	} {
		p := newPull(5)
		err := pushLane(tc.ctx, cs, &rtr{Req: p.req, Length: 5}, Source{Bytes: []byte(tc.src)})
		require.ErrorContains(t, err, tc.err, tc.name)
		require.ErrorContains(t, bulkResult(t, p), "gave the transfer up", tc.name)
	}
	requireLive(t, ss)
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

// bulkLanePair returns the two sessions of a TCP session with lanes, once
// the server has its bulk lane, and a function making pulls on the server.
func bulkLanePair(t *testing.T) (ss, cs *Session, newPull func(n int) *pull) {
	opts := []Option{WithMode(ModeTCP)}
	_, cs, ss, _, _ = lanePair(t, opts, opts)
	<-ss.bulk.ready
	require.NotNil(t, cs.bulkLane(), "the client has a bulk lane")
	return ss, cs, func(n int) *pull {
		dst, err := devicebuf.NewHostAllocator().Alloc(n)
		require.NoError(t, err)
		p := makePull(ss, dst)
		p.list()
		t.Cleanup(p.settled)
		return p
	}
}

// bulkResult waits for the outcome of p's bulk transfer.
func bulkResult(t *testing.T, p *pull) error {
	t.Helper()
	select {
	case err := <-p.bulk:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("no outcome for the pull")
	}
	return nil
}
