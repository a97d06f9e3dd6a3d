package oob

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// readingInto reports whether a bulk reader is writing into the destination
// of pull req.
func readingInto(req uint64) bool {
	pulls.Lock()
	defer pulls.Unlock()
	p := pulls.m[req]
	return p != nil && p.reading != nil
}

// reservedPulls returns the pulls through s not yet settled.
func reservedPulls(s *transport.Session) int {
	b := &stateOf(s).bounds
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pulls
}

// An owner that sends part of a pull's bytes on a bulk stream or the bulk
// lane, stalls, and then answers with a FIN (failed, or ok for a path the
// pull did not offer) fails the pull, but a destination the caller gave
// (Fetch, FetchBytes) is the caller's again once Fetch returns: Fetch waits
// for the bulk reader to stop writing into it. Here the owner finishes its
// frame, or closes its stream, once the pull is off the list (the FIN came
// and the pull waits for the reader), long before the reader's deadline.
func TestStalledBulkThenFIN(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lanes bool
		bytes bool // FetchBytes into a Go slice, not Fetch into a Buffer
		st    finStatus
		path  Path
		err   string
	}{
		{"multiplexed/fin-failed", false, false, finFailed, PathNone, "owner refused: nope"},
		{"multiplexed/fin-ok-unoffered-path", false, false, finOK, PathRDMA, "not offered"},
		{"lane/fin-failed", true, false, finFailed, PathNone, "owner refused: nope"},
		{"lane/fin-ok-unoffered-path", true, false, finOK, PathRDMA, "not offered"},
		{"lane/fin-failed/bytes", true, true, finFailed, PathNone, "owner refused: nope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const timeout = 5 * time.Second
			setTransferConfig(t, TransferConfig{Timeout: timeout})
			var owner atomic.Pointer[transport.Session]
			stalled := stallThenFIN(t, &owner, tc.lanes, &fin{Status: tc.st, Path: tc.path, Msg: "nope"})
			opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(tc.lanes)}
			_, cs, ss, _, _ := lanePair(t, opts, opts)
			owner.Store(ss)
			require.Equal(t, tc.lanes, stateOf(ss).link.Lane() != nil)
			finished := finishStalled(t, stalled, tc.lanes)

			const n = 1 << 20
			p := make([]byte, n)
			dst := devicebuf.HostFromBytes(p)
			d := Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			start := time.Now()
			var err error
			if tc.bytes {
				_, err = FetchBytes(ctx, d, p)
			} else {
				_, err = Fetch(ctx, d, dst)
			}
			elapsed := time.Since(start)
			require.ErrorContains(t, err, tc.err)
			require.Zero(t, reservedPulls(cs), "Fetch returned while the owner's reader wrote into the destination")
			require.Less(t, elapsed, timeout/2, "Fetch waited for the reader's deadline")
			require.NoError(t, waitFor(t, finished, "the owner's rest of the transfer"))
			if tc.lanes {
				// The rest of the frame landed before Fetch returned, and
				// nothing lands after: the lane carries on.
				require.Equal(t, bytes.Repeat([]byte{0xAA}, laneFrameMax/2), p[:laneFrameMax/2])
				require.Equal(t, bytes.Repeat([]byte{0xBB}, laneFrameMax/2), p[laneFrameMax/2:laneFrameMax])
			}
			dst.Release()
			require.True(t, dst.Released(), "the pull kept the destination after Fetch returned")
			require.Zero(t, numPulls())
			requireLive(t, cs)
			requireLive(t, ss)
		})
	}
}

// finishStalled takes the transfer the owner stalled, and once its pull is
// off the list (the caller's Fetch got the FIN and waits for the reader)
// sends the rest of the lane's frame, or closes the bulk stream. The
// returned channel gets the outcome.
func finishStalled(t *testing.T, stalled <-chan net.Conn, lane bool) <-chan error {
	done := make(chan error, 1)
	go func() {
		var c net.Conn
		select {
		case c = <-stalled:
		case <-time.After(testTimeout):
			done <- errors.New("the owner stalled no transfer")
			return
		}
		if !assert.Eventually(t, func() bool { return numPulls() == 0 }, testTimeout, time.Millisecond, "the pull leaves the list") {
			done <- errors.New("the pull stayed listed")
			return
		}
		if lane {
			_, err := c.Write(bytes.Repeat([]byte{0xBB}, laneFrameMax/2))
			done <- err
			return
		}
		done <- c.Close()
	}()
	return done
}

// A FIN ok for a path the owner writes by itself (offered), while a bulk
// reader it started still writes into the destination, fails the pull; Fetch
// returns once the reader stopped, for the destination is the caller's then.
func TestStalledBulkThenFINOfferedPath(t *testing.T) {
	const timeout = 5 * time.Second
	setTransferConfig(t, TransferConfig{Timeout: timeout})
	rc := ucxContext(t, "tcp")
	var owner atomic.Pointer[transport.Session]
	stalled := make(chan net.Conn, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		require.NotZero(t, m.Offers&PathRDMA)
		stalled <- halfBulk(t, s, m)
		require.Eventually(t, func() bool { return readingInto(m.Req) }, testTimeout, time.Millisecond, "the receiver reads into the destination")
		f := &fin{Req: m.Req, Status: finOK, Path: PathRDMA}
		require.NoError(t, sendControl(context.Background(), s, ctlFIN, f.marshal()))
		return true
	})
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX), transport.WithLanes(false)}
	_, cs, ss, _, _ := lanePair(t, ucx, ucx)
	owner.Store(ss)

	const n = 1 << 20
	dst, err := HostPool(rc).Alloc(n)
	require.NoError(t, err)
	finished := finishStalled(t, stalled, false)
	start := time.Now()
	_, err = Fetch(testContext(t), Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, dst)
	require.ErrorContains(t, err, "bulk data still arriving")
	require.Zero(t, reservedPulls(cs), "Fetch returned while the owner's reader wrote into the destination")
	require.Less(t, time.Since(start), timeout/2, "Fetch waited for the reader's deadline")
	require.NoError(t, waitFor(t, finished, "the stream's close"))
	dst.Release()
	require.True(t, dst.Released(), "the pull kept the destination after Fetch returned")
	requireLive(t, cs)
}

// stalledPair returns the client session of a pair over TCP (with lanes or
// not) whose server answers each RTR as stallThenFIN does with f, and the
// channel of its stalled connections; the transfer timeout is a minute.
func stalledPair(t *testing.T, lanes bool, f *fin) (*transport.Session, <-chan net.Conn) {
	setTransferConfig(t, TransferConfig{Timeout: time.Minute})
	var owner atomic.Pointer[transport.Session]
	stalled := stallThenFIN(t, &owner, lanes, f)
	opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(lanes)}
	_, cs, ss, _, _ := lanePair(t, opts, opts)
	owner.Store(ss)
	return cs, stalled
}

// stallThenFIN makes owner's session answer each RTR with half of a lane
// frame, or of a bulk stream, then, once the receiver reads into the
// destination, with f (for the RTR's request; nil: no answer). The stalled
// connection comes on the channel returned once the receiver reads.
func stallThenFIN(t *testing.T, owner *atomic.Pointer[transport.Session], lanes bool, f *fin) <-chan net.Conn {
	stalled := make(chan net.Conn, 1) // the bulk stream, or the lane, mid-transfer
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		link := stateOf(s).link
		if lanes {
			// A frame of laneFrameMax bytes, of which half arrives.
			lf := laneFrame{kind: laneData, req: m.Req, total: m.Length, n: laneFrameMax}
			_, err = link.Lane().Write(append(lf.marshal(), bytes.Repeat([]byte{0xAA}, laneFrameMax/2)...))
			require.NoError(t, err)
			defer func() { stalled <- link.Lane() }()
		} else {
			c, err := link.OpenBulk(context.Background())
			require.NoError(t, err)
			_, err = c.Write(append(bulkHeader(m.Req, m.Length), make([]byte, m.Length/2)...))
			require.NoError(t, err)
			defer func() { stalled <- c }()
		}
		require.Eventually(t, func() bool { return readingInto(m.Req) }, testTimeout, time.Millisecond, "the receiver reads into the destination")
		if f == nil {
			return true
		}
		answer := *f
		answer.Req = m.Req
		if err := sendControl(context.Background(), s, ctlFIN, answer.marshal()); err != nil {
			// The receiver may end the session as soon as the FIN reached
			// it (TestStalledBulkPastPullTime), before the send returns;
			// a FIN that never arrived fails the caller's assertions.
			select {
			case <-s.Done():
			default:
				t.Errorf("send the FIN: %v", err)
			}
		}
		return true
	})
	return stalled
}

// An owner that answers while its stalled frame or stream keeps the reader
// going past the pull's time (here: the caller's context ends while Fetch
// waits for the reader) has its session ended, which stops the reader:
// Fetch returns with nothing left writing into the caller's memory.
func TestStalledBulkPastPullTime(t *testing.T) {
	for _, lanes := range []bool{true, false} {
		t.Run(map[bool]string{true: "lane", false: "multiplexed"}[lanes], func(t *testing.T) {
			cs, stalled := stalledPair(t, lanes, &fin{Status: finFailed, Msg: "nope"})

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			taken := make(chan net.Conn, 1)
			go func() {
				// The owner stalled, then Fetch got the FIN and waits for
				// the reader: the caller's time is up.
				c := <-stalled
				assert.Eventually(t, func() bool { return numPulls() == 0 }, testTimeout, time.Millisecond, "the pull leaves the list")
				cancel()
				taken <- c
			}()
			const n = 1 << 20
			p := make([]byte, n)
			_, err := FetchBytes(ctx, Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, p)
			require.ErrorContains(t, err, "owner refused: nope")
			requireStallEnded(t, cs, p, taken)
		})
	}
}

// stallConn stops reading once stalled is set, until unstall closes: the
// peer's process stopped reading its socket (hung, stopped, or hostile).
type stallConn struct {
	net.Conn
	stalled atomic.Bool
	unstall chan struct{}
}

func (c *stallConn) Read(b []byte) (int, error) {
	if c.stalled.Load() {
		<-c.unstall
		return 0, io.EOF
	}
	return c.Conn.Read(b)
}

// A push over a multiplexed bulk stream (a session without a bulk lane)
// whose write blocks for the keepalive timeout ends the session on the
// pusher's own goroutine, while it holds its payload's use. The engine's
// Closed withdraws what was sent toward the peer, that payload among them,
// and waits for the use to end: it runs on a goroutine of its own, so the
// push fails and the payload is withdrawn instead of both waiting for good.
func TestPushWriteTimeoutEndsSession(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: 20 * time.Second})
	c1, c2 := net.Pipe()
	sc := &stallConn{Conn: c1, unstall: make(chan struct{})}
	side := func() []transport.Option {
		return []transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(Engine()),
			transport.WithKeepAlive(-1, 500*time.Millisecond)} // no pings: the write's timeout alone notices
	}
	// The client's small stream window: its reads of the bulk stream are
	// what open it further.
	cs, ss := transporttest.PairOver(t, sc, c2, append(side(), transport.WithWindow(256<<10)), side())
	t.Cleanup(func() { close(sc.unstall) }) // before the sessions close

	serveBulkOn(t, func() *transport.Session { return cs }, func(_ *transport.Session, c net.Conn) {
		defer c.Close()
		sc.stalled.Store(true)                       // the client stops reading its socket mid-push
		_, _ = io.ReadFull(c, make([]byte, 192<<10)) // what it buffered already: the window opens once more
		<-sc.unstall
	})

	payload := bytes.Repeat([]byte{7}, 8<<20)
	d := Offer(Source{Bytes: payload}, OfferOptions{})
	SentToward(ss, []Token{d.Token}) // a response's payload, sent toward the client
	m := &rtr{Req: 1, Token: d.Token, Length: d.Length, Offers: PathStream}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, sendControl(ctx, cs, ctlRTR, m.marshal()))
	select {
	case <-ss.Done():
		require.ErrorIs(t, ss.Err(), transport.ErrPeerGone)
	case <-time.After(20 * time.Second):
		t.Fatal("the server's session outlived its blocked write")
	}
	withdrawn := make(chan struct{})
	go func() {
		Withdraw(d.Token)
		close(withdrawn)
	}()
	select {
	case <-withdrawn:
	case <-time.After(20 * time.Second):
		// The sessions' cleanup would wait for good too: end the test binary
		// here, with every goroutine's stack.
		panic("withdrawing the pushed payload waits for the push that ended the session")
	}
	closed := make(chan struct{})
	go func() {
		_ = ss.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(20 * time.Second):
		panic("closing the server's session waits for its pusher")
	}
}

// halfBulk answers m, an RTR that came over s, as an owner that stalls:
// it opens a bulk stream, writes the header and half the bytes, and returns
// the stream, left open.
func halfBulk(t *testing.T, s *transport.Session, m *rtr) net.Conn {
	t.Helper()
	c, err := stateOf(s).link.OpenBulk(context.Background())
	require.NoError(t, err)
	_, err = c.Write(append(bulkHeader(m.Req, m.Length), make([]byte, m.Length/2)...))
	require.NoError(t, err)
	return c
}

// An owner that answers ok for the stream path while its frame or stream
// is stalled mid-body, the caller's context ending while Fetch waits for
// the rest: Fetch returns once nothing writes into the caller's memory any
// more (after a grace, the session to the owner ends), not with the reader
// still holding it for the owner's late bytes.
func TestStalledBulkThenFINOkCancelled(t *testing.T) {
	for _, lanes := range []bool{true, false} {
		t.Run(map[bool]string{true: "lane", false: "multiplexed"}[lanes], func(t *testing.T) {
			cs, stalled := stalledPair(t, lanes, &fin{Status: finOK, Path: PathStream})
			// The FIN as it reaches the caller's side, once handled there.
			delivered := make(chan uint64, 1)
			interceptControl(t, ctlFIN, func(s *transport.Session, payload []byte) bool {
				if s != cs {
					return false
				}
				handleFIN(s, payload)
				if f, err := parseFIN(payload); err == nil {
					delivered <- f.Req
				}
				return true
			})

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			taken := make(chan net.Conn, 1)
			go func() {
				c := <-stalled
				req := <-delivered
				pulls.Lock()
				p := pulls.m[req]
				pulls.Unlock()
				// Fetch took the FIN and waits for the stream's rest: the
				// caller's time is up.
				assert.NotNil(t, p)
				if p != nil {
					assert.Eventually(t, func() bool { return len(p.fin) == 0 }, testTimeout, time.Millisecond, "Fetch takes the FIN")
				}
				cancel()
				taken <- c
			}()
			fetchCancelledInStall(ctx, t, cs, taken)
		})
	}
}

// An owner that stalls its frame or stream mid-body and never answers, the
// caller's context ending meanwhile: Fetch returns once this process's
// reader writes into the caller's memory no more (after a grace, the
// session to the owner ends), not with the reader holding it until its own
// deadline for the owner's late bytes.
func TestStalledBulkUnansweredCancelled(t *testing.T) {
	for _, lanes := range []bool{true, false} {
		t.Run(map[bool]string{true: "lane", false: "multiplexed"}[lanes], func(t *testing.T) {
			cs, stalled := stalledPair(t, lanes, nil)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			taken := make(chan net.Conn, 1)
			go func() {
				c := <-stalled // the receiver reads into the caller's slice
				cancel()
				taken <- c
			}()
			fetchCancelledInStall(ctx, t, cs, taken)
		})
	}
}

// A caller that gives up a pull whose stream an honest owner is still
// sending: the reader stops writing into the caller's memory at its next
// piece, the rest of the stream goes into nothing, and the session stays.
func TestBulkCancelledMidStream(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: time.Minute})
	const n = 8 * readPiece
	var owner atomic.Pointer[transport.Session]
	resume := make(chan struct{})
	reading := make(chan struct{})
	sent := make(chan error, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, payload []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(payload)
		require.NoError(t, err)
		go func() {
			c, err := stateOf(s).link.OpenBulk(context.Background())
			if err != nil {
				sent <- err
				return
			}
			defer c.Close()
			if _, err := c.Write(append(bulkHeader(m.Req, m.Length), bytes.Repeat([]byte{0xAA}, readPiece)...)); err != nil {
				sent <- err
				return
			}
			assert.Eventually(t, func() bool { return readingInto(m.Req) }, testTimeout, time.Millisecond)
			close(reading)
			<-resume // the caller gave up meanwhile: the rest goes on as sent
			_, err = c.Write(bytes.Repeat([]byte{0xBB}, int(m.Length)-readPiece))
			sent <- err
		}()
		return true
	})
	opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(false)}
	_, cs, ss, _, _ := lanePair(t, opts, opts)
	owner.Store(ss)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-reading
		cancel()
		close(resume)
	}()
	p := make([]byte, n)
	_, err := FetchBytes(ctx, Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, p)
	require.ErrorIs(t, err, context.Canceled)
	got := bytes.Clone(p)
	require.NoError(t, waitFor(t, sent, "the owner's stream"))
	require.Eventually(t, func() bool { return reservedPulls(cs) == 0 }, testTimeout, time.Millisecond)
	require.Equal(t, got, p, "the owner's bytes reached the caller's slice after FetchBytes returned")
	require.Less(t, bytes.Count(p, []byte{0xBB}), n-readPiece, "the reader stopped at a piece: the rest went into nothing")
	requireLive(t, cs)
}

// fetchCancelledInStall runs FetchBytes of a 1 MiB payload over cs under
// ctx, which ends while the owner stalls the transfer, and asserts what
// follows (requireStallEnded).
func fetchCancelledInStall(ctx context.Context, t *testing.T, cs *transport.Session, taken <-chan net.Conn) {
	t.Helper()
	const n = 1 << 20
	p := make([]byte, n)
	_, err := FetchBytes(ctx, Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, p)
	require.ErrorIs(t, err, context.Canceled)
	requireStallEnded(t, cs, p, taken)
}

// requireStallEnded asserts what follows a Fetch into p, over cs, that
// returned while the owner stalled its transfer: nothing of the pull is
// left reading into p, the session to the owner ended as stalled, and the
// owner's late bytes on the stalled conn (taken) reach no reader.
func requireStallEnded(t *testing.T, cs *transport.Session, p []byte, taken <-chan net.Conn) {
	t.Helper()
	require.Zero(t, reservedPulls(cs), "FetchBytes returned while the owner's reader wrote into the slice")
	select {
	case <-cs.Done():
	case <-time.After(testTimeout):
		t.Fatal("the session to the owner outlived the stalled transfer")
	}
	require.ErrorIs(t, cs.Err(), errOwnerStalled)
	c := waitFor(t, taken, "the stalled transfer")
	_, _ = c.Write(bytes.Repeat([]byte{0xBB}, laneFrameMax/2)) // reaches no reader
	require.Equal(t, -1, bytes.IndexByte(p, 0xBB), "the owner's late bytes reached the caller's slice")
}
