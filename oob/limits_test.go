package oob

import (
	"bytes"
	"context"
	"errors"
	"math"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// These tests play a hostile peer by hand: both ends of a session pair live
// in this process, and the test takes over what one end does with the
// control messages and bulk streams it receives.

// setTransferConfig sets c for the test and the defaults after it.
func setTransferConfig(tb testing.TB, c TransferConfig) {
	tb.Helper()
	SetTransferConfig(c)
	tb.Cleanup(func() { SetTransferConfig(TransferConfig{}) })
}

// interceptControl shows fn the control messages of type typ first; those it
// reports handled do not reach the engine's handler. Call it before the
// sessions it concerns exist; it is undone when the test ends.
func interceptControl(tb testing.TB, typ byte, fn func(s *transport.Session, payload []byte) (handled bool)) {
	tb.Helper()
	controlMu.Lock()
	orig := controlHandlers[typ]
	controlHandlers[typ] = func(s *transport.Session, p []byte) {
		if !runHook(func() bool { return fn(s, p) }) && orig != nil {
			orig(s, p)
		}
	}
	controlMu.Unlock()
	tb.Cleanup(func() {
		controlMu.Lock()
		controlHandlers[typ] = orig
		controlMu.Unlock()
	})
}

// runHook runs fn, a test's hook called on a session's goroutine, on a
// goroutine of its own and waits for it: an assertion that fails in it
// (FailNow: runtime.Goexit) fails the test and ends that goroutine, not the
// session's handler, whose end would stall the session and hide the failure
// behind a timeout. A hook that failed counts as having handled the message.
func runHook(fn func() bool) bool {
	handled, returned := false, false
	done := make(chan struct{})
	go func() {
		defer close(done)
		handled = fn()
		returned = true
	}()
	<-done
	return handled || !returned
}

// serveBulkOn makes fn serve the bulk streams the peer of the session s
// returns opens, in place of the engine's handler, until the test ends.
func serveBulkOn(tb testing.TB, s func() *transport.Session, fn func(bs *transport.Session, c net.Conn)) {
	controlMu.Lock()
	defer controlMu.Unlock()
	orig := bulkHandler
	bulkHandler = func(bs *transport.Session, c net.Conn) {
		if bs != s() {
			orig(bs, c)
			return
		}
		fn(bs, c)
	}
	tb.Cleanup(func() {
		controlMu.Lock()
		bulkHandler = orig
		controlMu.Unlock()
	})
}

// stallBulk makes the bulk streams that reach s wait, unread, until release
// is closed or s is done; each one that arrives is announced on the returned
// channel. Call it before the sessions exist; it is undone when the test
// ends.
func stallBulk(tb testing.TB, s func() *transport.Session, release <-chan struct{}) <-chan struct{} {
	tb.Helper()
	arrived := make(chan struct{}, 4096)
	serveBulkOn(tb, s, func(bs *transport.Session, c net.Conn) {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-bs.Done():
		}
		_ = c.Close()
	})
	return arrived
}

const testCtlMark = 0xE3

var marks = struct {
	once sync.Once
	mu   sync.Mutex
	ch   map[*transport.Session]chan struct{}
}{ch: map[*transport.Session]chan struct{}{}}

// markInbox returns the channel that receives a value for each testCtlMark
// message s reads: the control reader handles messages in order, so the mark
// arrives once every message sent before it was dispatched.
func markInbox(s *transport.Session) chan struct{} {
	marks.once.Do(func() {
		controlMu.Lock()
		controlHandlers[testCtlMark] = func(s *transport.Session, _ []byte) {
			marks.mu.Lock()
			ch := marks.ch[s]
			marks.mu.Unlock()
			if ch != nil {
				ch <- struct{}{}
			}
		}
		controlMu.Unlock()
	})
	ch := make(chan struct{}, 16)
	marks.mu.Lock()
	marks.ch[s] = ch
	marks.mu.Unlock()
	return ch
}

func waitFor[T any](tb testing.TB, ch <-chan T, what string) T {
	tb.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(testTimeout):
		tb.Fatalf("timed out waiting for %s", what)
	}
	var zero T
	return zero
}

const testTimeout = 20 * time.Second

func numPulls() int {
	pulls.Lock()
	defer pulls.Unlock()
	return len(pulls.m)
}

// smallHostPool gives the test a host pool of its own, of 8 MiB.
func smallHostPool(t *testing.T) *devicebuf.Pool {
	t.Helper()
	setTransferConfig(t, TransferConfig{PoolBytes: 8 << 20, Timeout: testTimeout})
	require.NoError(t, CloseHostPools())
	t.Cleanup(func() { require.NoError(t, CloseHostPools()) })
	return HostPool(nil)
}

// honestOffer offers n bytes, withdrawn when the test ends, and returns
// their descriptor as a peer of a new session pair (one that answers)
// would have sent it, with the bytes.
func honestOffer(t *testing.T, n int) (Descriptor, []byte) {
	t.Helper()
	_, receiver := pipePair(t)
	want := bytes.Repeat([]byte("honest"), n/6+1)[:n]
	d := Offer(Source{Bytes: want}, OfferOptions{})
	t.Cleanup(func() { Withdraw(d.Token) })
	d.Owner = receiver.Peer().ID
	require.Equal(t, []*transport.Session{receiver}, liveSessions(d.Owner))
	return d, want
}

// An owner that never answers its RTRs pins nothing once the calls gave up:
// the destinations go back to the pool, and another peer's call gets one.
func TestUnansweredRTRs(t *testing.T) {
	pool := smallHostPool(t)
	attacker, victim, rtrs := silentOwner(t, 64)

	// The attacker's descriptors take every destination the pool can give.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var fetches sync.WaitGroup
	errs := make(chan error, 64)
	const n = 1 << 20
	for range 64 {
		dst, err := pool.Alloc(n)
		if err != nil {
			require.ErrorIs(t, err, devicebuf.ErrExhausted)
			break
		}
		d := Descriptor{Owner: victim.Peer().ID, Token: Token(newToken()), Length: n, Kind: devicebuf.Host, Device: -1}
		fetches.Go(func() {
			_, err := Fetch(ctx, d, dst)
			dst.Release()
			errs <- err
		})
		waitFor(t, rtrs, "the RTR at the attacker")
	}
	require.NotZero(t, numPulls())
	cancel() // the calls give up
	fetches.Wait()
	close(errs)
	for err := range errs {
		var te *TransferError
		require.ErrorAs(t, err, &te)
		require.Equal(t, TransferCanceled, te.Kind, "%v", err)
	}

	// Released while the attacker stays connected.
	require.Eventually(t, func() bool { return numPulls() == 0 && pool.Stats().InUse == 0 },
		5*time.Second, 5*time.Millisecond, "destinations of unanswered RTRs still held: %d pulls, %d buffers", numPulls(), pool.Stats().InUse)
	select {
	case <-attacker.Done():
		t.Fatal("a stream-only pull ended the session")
	default:
	}

	// Another peer's call gets its destination and its bytes.
	d, want := honestOffer(t, n)
	dst, err := pool.Alloc(n)
	require.NoError(t, err, "another peer's destination")
	defer dst.Release()
	_, err = Fetch(context.Background(), d, dst)
	require.NoError(t, err)
	got, err := dst.HostBytes()
	require.NoError(t, err)
	require.True(t, bytes.Equal(want, got), "payload differs")
}

// A host pool full of the destinations of an owner that never answers does
// not fail another peer's pull: its destination comes from Go memory, and
// its bytes arrive.
func TestFullPoolFallsBack(t *testing.T) {
	pool := smallHostPool(t)
	_, victim, rtrs := silentOwner(t, 64)
	ctx, cancel := context.WithCancel(context.Background())
	var fetches sync.WaitGroup
	defer fetches.Wait()
	defer cancel() // on a failure: the attacker's pulls give up, then are waited for
	const n = 1 << 20
	for i := 0; pool.Stats().RegionBytes < 8<<20 || pool.Stats().BytesInUse < pool.Stats().RegionBytes; i++ {
		require.Less(t, i, 64, "the attacker's pulls did not fill the pool: %+v", pool.Stats())
		d := Descriptor{Owner: victim.Peer().ID, Token: Token(newToken()), Length: n, Kind: devicebuf.Host, Device: -1}
		fetches.Go(func() {
			dst, _, err := FetchFrom(ctx, d, pool)
			if dst != nil {
				dst.Release()
			}
			var te *TransferError
			if !errors.As(err, &te) || te.Kind != TransferCanceled {
				t.Errorf("the attacker's pull ended with %v, not canceled", err)
			}
		})
		waitFor(t, rtrs, "the RTR at the attacker")
	}
	_, err := pool.Alloc(n)
	require.ErrorIs(t, err, devicebuf.ErrExhausted, "the attacker holds the whole pool")

	d, want := honestOffer(t, n)
	dst, _, err := FetchFrom(context.Background(), d, pool)
	require.NoError(t, err, "another peer's pull with the pool full")
	require.True(t, dst.GoMemory(), "the destination comes from outside the pool")
	got, err := dst.HostBytes()
	require.NoError(t, err)
	require.True(t, bytes.Equal(want, got), "payload differs")
	dst.Release()

	cancel()
	fetches.Wait()
	require.Eventually(t, func() bool { return numPulls() == 0 && pool.Stats().InUse == 0 },
		5*time.Second, 5*time.Millisecond, "destinations still held: %d pulls, %d buffers", numPulls(), pool.Stats().InUse)
}

// A flood of RTRs whose pushes cannot finish runs a bounded number of pushes
// on a bounded number of goroutines; the rest wait in the session's queue,
// and RTRs beyond the queue are refused with a busy FIN.
func TestRTRFlood(t *testing.T) {
	const pushes, queue, flood = 4, 256, 1000
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{Pushes: pushes, PushQueue: queue}})
	var attacker *transport.Session
	release := make(chan struct{})
	streams := stallBulk(t, func() *transport.Session { return attacker }, release)
	var busy atomic.Int64
	interceptControl(t, ctlFIN, func(s *transport.Session, p []byte) bool {
		if s != attacker {
			return false
		}
		if f, err := parseFIN(p); err == nil && f.Status == finBusy {
			busy.Add(1)
		}
		return true
	})
	// A small window: a push of 1 MiB blocks until the attacker reads.
	attacker, owner := pipePair(t, transport.WithWindow(256<<10))
	mark := markInbox(owner)
	d := Offer(Source{Bytes: make([]byte, 1<<20)}, OfferOptions{Held: true})
	defer Withdraw(d.Token)
	before := runtime.NumGoroutine()

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for i := range flood {
		m := &rtr{Req: uint64(i + 1), Token: d.Token, Length: d.Length, Offers: PathStream}
		require.NoError(t, sendControl(ctx, attacker, ctlRTR, m.marshal()))
	}
	require.NoError(t, sendControl(ctx, attacker, testCtlMark, nil))
	waitFor(t, mark, "the mark after the flood")
	for range pushes {
		waitFor(t, streams, "a push")
	}
	// Every push runs, stalled; the others wait in the queue or were refused.
	require.Eventually(t, func() bool { return busy.Load() >= flood-pushes-queue }, testTimeout, time.Millisecond,
		"%d busy FINs", busy.Load())
	select {
	case <-streams:
		t.Fatalf("more than %d pushes at once", pushes)
	default:
	}
	// Handlers that just wrote their busy FINs may still be on their way
	// out: a goroutine kept for each RTR stays above the bound.
	var g int
	require.Eventually(t, func() bool {
		g = runtime.NumGoroutine() - before
		return g < 3*pushes+transport.MaxControlHandlers
	}, testTimeout, 10*time.Millisecond, "goroutines during a flood of %d RTRs", flood)
	t.Logf("%d goroutines more during the flood", g)

	close(release)
	require.NoError(t, attacker.Close())
	require.NoError(t, owner.Close())
}

// pushWatch reports the owner's side of each transfer to done, after waiting
// (bounded) for returned: a push still running once its session's Close
// returned sees returned closed.
type pushWatch struct {
	returned chan struct{}
	done     chan bool // whether Close had returned
}

func (w *pushWatch) Transfer(i TransferInfo) {
	if i.Pull {
		return
	}
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-w.returned:
		w.done <- true
	case <-t.C: // Close is waiting for this push, as it should
		w.done <- false
	}
}

func (w *pushWatch) Fallback(Path, Path, string) {}

// Close returns only once the session's pushes have.
func TestCloseJoinsPushes(t *testing.T) {
	w := &pushWatch{returned: make(chan struct{}), done: make(chan bool, 1)}
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Metrics: w})
	var attacker *transport.Session
	streams := stallBulk(t, func() *transport.Session { return attacker }, nil)
	attacker, owner := pipePair(t, transport.WithWindow(256<<10))
	d := Offer(Source{Bytes: make([]byte, 1<<20)}, OfferOptions{Held: true})
	defer Withdraw(d.Token)

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	m := &rtr{Req: 1, Token: d.Token, Length: d.Length, Offers: PathStream}
	require.NoError(t, sendControl(ctx, attacker, ctlRTR, m.marshal()))
	waitFor(t, streams, "the push")

	require.NoError(t, owner.Close())
	close(w.returned)
	require.False(t, waitFor(t, w.done, "the push's end"), "the push was still running when Close returned")
}

// A 0-byte payload is pulled like any other, into an empty buffer.
func TestZeroLengthPull(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout})
	_, receiver := pipePair(t)
	d := Offer(Source{Bytes: []byte{}}, OfferOptions{})
	d.Owner = receiver.Peer().ID
	b, _, err := FetchNew(context.Background(), d, func(n int) (*devicebuf.Buffer, error) {
		return nil, errors.New("no allocation for 0 bytes")
	})
	require.NoError(t, err)
	require.Zero(t, b.Len())
	b.Release()
	require.Zero(t, ReadStats().Offered, "the pulled entry left")
}

// An owner that stays silent on an RTR whose destination it could write by
// RDMA loses its session once the abandoned bound passes, and the
// destination is released.
func TestSilentOwnerOfExposedPull(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{Abandoned: 50 * time.Millisecond}})
	rc := ucxContext(t, "tcp")
	var attacker atomic.Pointer[transport.Session]
	rtrs := make(chan *rtr, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != attacker.Load() {
			return false
		}
		m, _ := parseRTR(p)
		rtrs <- m // and no answer
		return true
	})
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX)}
	_, victim, owner, _, _ := lanePair(t, append(ucx, transport.WithIdentity(transport.NewIdentity())), ucx)
	attacker.Store(owner)

	dst, err := HostPool(rc).Alloc(1 << 20)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fetched := make(chan error, 1)
	go func() {
		_, err := Fetch(ctx, Descriptor{Owner: victim.Peer().ID, Token: Token(newToken()), Length: 1 << 20, Kind: devicebuf.Host, Device: -1}, dst)
		dst.Release()
		fetched <- err
	}()
	m := waitFor(t, rtrs, "the RTR at the owner")
	require.NotZero(t, m.Offers&PathRDMA, "the destination is exposed by RDMA")
	cancel()
	var te *TransferError
	require.ErrorAs(t, waitFor(t, fetched, "the pull's end"), &te)
	require.Equal(t, TransferCanceled, te.Kind)

	waitFor(t, victim.Done(), "the end of the silent owner's session")
	require.ErrorIs(t, victim.Err(), errOwnerSilent)
	require.Eventually(t, func() bool { return numPulls() == 0 && HostPool(rc).Stats().InUse == 0 },
		5*time.Second, 5*time.Millisecond, "the destination is still held")
}

// A pull waits for room under the session's limits, and fails with
// TransferExhausted when its context ends first.
func TestPullWaitsForRoom(t *testing.T) {
	for _, tc := range []struct {
		name    string
		limits  Limits
		waiting func(victim *transport.Session) bool
	}{
		{"session", Limits{Pulls: 1}, func(victim *transport.Session) bool {
			stateOf(victim).bounds.mu.Lock()
			defer stateOf(victim).bounds.mu.Unlock()
			return stateOf(victim).bounds.room != nil
		}},
		// All sessions together: a peer's many sessions do not multiply what it
		// makes this process allocate.
		{"total", Limits{TotalPullBytes: 1 << 10}, func(*transport.Session) bool {
			pullTotal.mu.Lock()
			defer pullTotal.mu.Unlock()
			return pullTotal.room != nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) { testPullWaitsForRoom(t, tc.limits, tc.waiting) })
	}
}

func testPullWaitsForRoom(t *testing.T, limits Limits, waitingOn func(*transport.Session) bool) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: limits})
	_, victim, rtrs := silentOwner(t, 4)
	pull := func(ctx context.Context) <-chan error {
		errc := make(chan error, 1)
		go func() {
			d := Descriptor{Owner: victim.Peer().ID, Token: Token(newToken()), Length: 1 << 10, Kind: devicebuf.Host, Device: -1}
			_, err := FetchBytes(ctx, d, make([]byte, d.Length))
			errc <- err
		}()
		return errc
	}
	waiting := func() bool { return waitingOn(victim) }
	kind := func(err error) TransferErrorKind {
		var te *TransferError
		require.ErrorAs(t, err, &te)
		return te.Kind
	}

	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	first := pull(ctx1)
	waitFor(t, rtrs, "the first RTR")

	ctx2, cancel2 := context.WithCancel(context.Background())
	second := pull(ctx2)
	require.Eventually(t, waiting, testTimeout, time.Millisecond, "the second pull waits")
	cancel2()
	err := waitFor(t, second, "the second pull's end")
	require.Equal(t, TransferExhausted, kind(err), "%v", err)

	ctx3, cancel3 := context.WithCancel(context.Background())
	defer cancel3()
	third := pull(ctx3)
	require.Eventually(t, waiting, testTimeout, time.Millisecond, "the third pull waits")
	cancel1() // the first gives up: its room goes to the third
	require.Equal(t, TransferCanceled, kind(waitFor(t, first, "the first pull's end")))
	waitFor(t, rtrs, "the third RTR")
	cancel3()
	require.Equal(t, TransferCanceled, kind(waitFor(t, third, "the third pull's end")))
}

// Limits.TotalPullBytes holds for each engine against what all of them
// reserved: an engine whose total the others' pulls already exceed grants
// nothing more, however small its own pulls.
func TestTotalPullBytesAcrossEngines(t *testing.T) {
	big := transport.WithEngine(New(TransferConfig{Limits: Limits{PullBytes: 1000}}))
	small := transport.WithEngine(New(TransferConfig{Limits: Limits{PullBytes: 100}})) // TotalPullBytes 200
	_, bs := pipePair(t, big)
	_, ss := pipePair(t, small)
	release, err := reservePull(context.Background(), bs, bs, Token{}, 900)
	require.NoError(t, err)
	defer release()
	done, cancel := context.WithCancel(context.Background())
	cancel() // a reservation that would have to wait fails at once
	_, err = reservePull(done, ss, ss, Token{}, 100)
	require.ErrorContains(t, err, "Limits.TotalPullBytes", "900 bytes reserved through the big engine exceed the small one's total")
	release()
	r2, err := reservePull(done, ss, ss, Token{}, 100)
	require.NoError(t, err, "room again once the big engine's pull settled")
	r2()
}

// silentOwner returns a session pair whose client end, the attacker (the
// payloads' owner), takes every RTR the victim sends it, announces it on
// rtrs (buffered queued) and never answers. Call it before other sessions of
// the test exist; it is undone when the test ends.
func silentOwner(t *testing.T, queued int) (attacker, victim *transport.Session, rtrs <-chan struct{}) {
	t.Helper()
	ch := make(chan struct{}, queued)
	interceptControl(t, ctlRTR, func(s *transport.Session, _ []byte) bool {
		if s != attacker {
			return false
		}
		ch <- struct{}{} // and no answer
		return true
	})
	attacker, victim = pipePair(t)
	return attacker, victim, ch
}

// A pull of a third party's payload, named in a message that came over
// another session, is charged to that session, and takes at most half the
// RTRs in flight of the session to the owner: a peer naming another's
// payloads spends its own budget, and the owner's own messages still get
// their pulls.
func TestThirdPartyPullChargedToSender(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{Pulls: 2}})
	owner, toOwner, rtrs := silentOwner(t, 4) // the owner takes RTRs and does not answer yet
	fwd, toFwd := pipePair(t)                 // a peer that names the owner's payloads
	_, fwdConn := transporttest.Conns(t, fwd, toFwd)
	_, ownerConn := transporttest.Conns(t, owner, toOwner)
	fromFwd := peer.NewContext(context.Background(), &peer.Peer{Addr: fwdConn.RemoteAddr()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fromOwner := peer.NewContext(ctx, &peer.Peer{Addr: ownerConn.RemoteAddr()})
	pull := func(ctx context.Context) <-chan error {
		errc := make(chan error, 1)
		go func() {
			d := Descriptor{Owner: toOwner.PeerID(), Token: Token(newToken()), Length: 1 << 10, Kind: devicebuf.Host, Device: -1}
			_, err := FetchBytes(ctx, d, make([]byte, d.Length))
			errc <- err
		}()
		return errc
	}
	waiting := func(s *transport.Session) func() bool {
		return func() bool {
			b := &stateOf(s).bounds
			b.mu.Lock()
			defer b.mu.Unlock()
			return b.room != nil
		}
	}

	first := pull(fromFwd)
	waitFor(t, rtrs, "the forwarded pull's RTR")
	require.Equal(t, 1, chargedPulls(toFwd), "the forwarder pays")
	fctx, fcancel := context.WithCancel(fromFwd)
	second := pull(fctx)
	require.Eventually(t, waiting(toOwner), testTimeout, time.Millisecond,
		"the forwarder's second pull waits: forwarded pulls hold half the owner's session's RTRs")
	require.Equal(t, 1, chargedPulls(toFwd), "the forwarder's own budget has room")
	fcancel()
	require.Equal(t, TransferExhausted, kindOfErr(t, waitFor(t, second, "the second forwarded pull's end")))

	// The owner's own message takes the other half.
	own := pull(fromOwner)
	waitFor(t, rtrs, "the owner's own pull's RTR")
	require.Equal(t, 2, chargedPulls(toOwner), "the owner's session: its own pull and the forwarded one's RTR")
	require.Equal(t, 1, chargedPulls(toFwd))

	cancel()
	require.Equal(t, TransferCanceled, kindOfErr(t, waitFor(t, own, "the owner's pull's end")))
	require.NoError(t, toOwner.Close()) // the forwarded pull ends with the owner's session
	require.Error(t, waitFor(t, first, "the forwarded pull's end"))
	require.Eventually(t, func() bool { return numPulls() == 0 && chargedPulls(toFwd) == 0 }, testTimeout, time.Millisecond,
		"the forwarder's budget is given back")
}

// chargedPulls returns the pulls charged to s that are not settled.
func chargedPulls(s *transport.Session) int {
	b := &stateOf(s).bounds
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pulls
}

func kindOfErr(t *testing.T, err error) TransferErrorKind {
	t.Helper()
	var te *TransferError
	require.ErrorAs(t, err, &te)
	return te.Kind
}

// A peer's message that names a payload of this process's own (a held
// request it was sent, say) is copied here with no session to the owner: the
// copy is charged to the session the message came over, within its limits,
// as a pull through another session would be. The application's own local
// pulls are not charged.
func TestLocalOwnerPullCharged(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{PullBytes: 1 << 20, TotalPullBytes: 1 << 20, Pulls: 1}})
	attacker, victim := pipePair(t)
	_, victimConn := transporttest.Conns(t, attacker, victim)
	fromPeer := peer.NewContext(testContext(t), &peer.Peer{Addr: victimConn.RemoteAddr()})
	allocs := 0
	alloc := func(k int) (*devicebuf.Buffer, error) {
		allocs++
		require.Equal(t, 1, chargedPulls(victim), "the copy is charged to the session the message came over")
		return devicebuf.HostFromBytes(make([]byte, k)), nil
	}

	big := Offer(Source{Bytes: bytes.Repeat([]byte{7}, 8<<20)}, OfferOptions{Held: true})
	defer Withdraw(big.Token)
	_, _, err := FetchNew(fromPeer, big, alloc)
	require.Equal(t, TransferExhausted, kindOfErr(t, err), "8 MiB over Limits.PullBytes")
	require.Zero(t, allocs)

	small := Offer(Source{Bytes: bytes.Repeat([]byte{9}, 512<<10)}, OfferOptions{Held: true})
	defer Withdraw(small.Token)
	b, path, err := FetchNew(fromPeer, small, alloc)
	require.NoError(t, err)
	require.Equal(t, PathLocal, path)
	got, err := b.HostBytes()
	require.NoError(t, err)
	require.Equal(t, bytes.Repeat([]byte{9}, 512<<10), got)
	b.Release()
	require.Equal(t, 1, allocs)
	require.Zero(t, chargedPulls(victim), "given back once copied")

	b, _, err = FetchNew(testContext(t), big, devicebuf.NewHostAllocator().Alloc)
	require.NoError(t, err, "the application's own pull")
	b.Release()
}

// A third party's pull through, or charged to, sessions that closed fails at
// once: the bounds of sessions the engine no longer serves are one shared
// value, never locked twice.
func TestThirdPartyPullClosedSessions(t *testing.T) {
	_, a := pipePair(t)
	_, b := pipePair(t)
	require.NoError(t, a.Close())
	require.NoError(t, b.Close())
	require.Eventually(t, func() bool { return !served(a) && !served(b) }, testTimeout, time.Millisecond)
	errc := make(chan error, 1)
	go func() {
		_, err := reservePull(testContext(t), a, b, Token{}, 1<<10)
		errc <- err
	}()
	require.Equal(t, TransferUnavailable, kindOfErr(t, waitFor(t, errc, "the reservation's end")))
}

// offerFilled offers n bytes of byte(n>>12); the offer is withdrawn when
// the test ends.
func offerFilled(t *testing.T, n int) Descriptor {
	d := Offer(Source{Bytes: bytes.Repeat([]byte{byte(n >> 12)}, n)}, OfferOptions{})
	t.Cleanup(func() { Withdraw(d.Token) })
	return d
}

// pullFilled pulls d, offered by offerFilled, and checks its bytes.
func pullFilled(ctx context.Context, t *testing.T, d Descriptor) {
	t.Helper()
	b, _, err := FetchNew(ctx, d, devicebuf.NewHostAllocator().Alloc)
	require.NoError(t, err)
	defer b.Release()
	got, err := b.HostBytes()
	require.NoError(t, err)
	require.Equal(t, bytes.Repeat([]byte{byte(d.Length >> 12)}, int(d.Length)), got)
}

// A call whose peer leaves the payloads of its messages unpulled has its
// next message held back, within the message's context, once they reach
// Limits.UnpulledBytes; a pull or a withdrawal makes room. Another call to
// the same peer is not held back by it. A message larger than the limit on
// its own goes once nothing of its call waits unpulled. A message one of
// whose payloads left the outbox while it waited fails, and so does one
// whose session closed.
func TestUnpulledBytesBound(t *testing.T) {
	const limit = 1 << 20
	setTransferConfig(t, TransferConfig{Limits: Limits{UnpulledBytes: limit}})
	_, ss := pipePair(t)
	peer := ss.PeerID()
	offer := func(n int) Descriptor { return offerFilled(t, n) }
	unpulled := func(f *Flow) int64 {
		box.mu.Lock()
		defer box.mu.Unlock()
		return f.bytes.Load()
	}
	waiting := func(f *Flow) func() bool {
		return func() bool {
			box.mu.Lock()
			defer box.mu.Unlock()
			return f.room != nil
		}
	}
	ctx := testContext(t)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()

	var call, other Flow
	d1 := offer(768 << 10)
	require.NoError(t, call.Send(cancelled, ss, 0, []Token{d1.Token}), "room for the first")
	require.Equal(t, int64(768<<10), unpulled(&call))
	d2 := offer(512 << 10)
	require.ErrorIs(t, call.Send(cancelled, ss, 0, []Token{d2.Token}), context.Canceled, "past the limit")
	require.Equal(t, int64(768<<10), unpulled(&call), "a message held back counts for nothing")
	d3 := offer(512 << 10)
	require.NoError(t, other.Send(cancelled, ss, 0, []Token{d3.Token}), "another call to the same peer")
	require.Equal(t, int64(1280<<10), Unpulled(peer))

	sent := make(chan error, 1)
	go func() { sent <- call.Send(ctx, ss, 0, []Token{d2.Token}) }()
	pullFilled(ctx, t, d1)
	require.NoError(t, <-sent, "the pull of the first made room")
	require.Equal(t, int64(512<<10), unpulled(&call))

	// Larger than the limit, alone.
	d4 := offer(2 * limit)
	go func() { sent <- call.Send(ctx, ss, 0, []Token{d4.Token}) }()
	require.Eventually(t, waiting(&call), 10*time.Second, time.Millisecond)
	Withdraw(d2.Token)
	require.NoError(t, <-sent)
	require.Equal(t, int64(2*limit), unpulled(&call))

	// A payload that leaves the outbox while its message waits.
	d5, d6 := offer(4096), offer(4096)
	go func() { sent <- call.Send(ctx, ss, 0, []Token{d5.Token, d6.Token}) }()
	require.Eventually(t, waiting(&call), 10*time.Second, time.Millisecond)
	Withdraw(d6.Token) // as its lease ending would
	Withdraw(d4.Token)
	require.ErrorContains(t, <-sent, "left the outbox")
	require.Zero(t, unpulled(&call))

	// The session closes while a message waits.
	d7 := offer(limit)
	require.NoError(t, call.Send(ctx, ss, 0, []Token{d7.Token}))
	go func() { sent <- call.Send(ctx, ss, 0, []Token{d5.Token}) }()
	require.Eventually(t, waiting(&call), 10*time.Second, time.Millisecond)
	require.NoError(t, ss.Close())
	require.ErrorContains(t, <-sent, "the session closed")
	require.Zero(t, Unpulled(peer), "the last session to the peer closed")
	require.Zero(t, unpulled(&call))
	require.Zero(t, unpulled(&other))
	require.False(t, Offered(d7.Token))
	box.mu.Lock()
	require.NotContains(t, box.toward, peer, "nothing kept for the peer")
	box.mu.Unlock()
}

// TestFlowTrackWait: a client call's Flow counts the payloads of its
// messages that leave after their first pull (Track), not held ones nor ones
// another Flow counts, and Wait holds its next message back while they are
// over Limits.UnpulledBytes: until a pull or a withdrawal takes them under,
// or the wait's context ends.
func TestFlowTrackWait(t *testing.T) {
	const limit = 1 << 20
	setTransferConfig(t, TransferConfig{Limits: Limits{UnpulledBytes: limit}})
	unpulled := func(f *Flow) int64 {
		box.mu.Lock()
		defer box.mu.Unlock()
		return f.bytes.Load()
	}
	ctx := testContext(t)
	var f, other Flow
	d1, d2, d3 := offerFilled(t, 768<<10), offerFilled(t, 512<<10), offerFilled(t, 512<<10)
	held := Offer(Source{Bytes: make([]byte, 2*limit)}, OfferOptions{Held: true})
	defer Withdraw(held.Token)
	other.Track([]Token{d2.Token})
	f.Track([]Token{d1.Token, d2.Token, held.Token, d1.Token})
	require.Equal(t, int64(768<<10), unpulled(&f), "d1 once; d2 is another's; a held payload stays after its pulls")
	require.False(t, f.Over(nil))
	require.NoError(t, f.Wait(ctx, nil))
	f.Track([]Token{d3.Token})
	require.True(t, f.Over(nil))

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, f.Wait(cancelled, nil), context.Canceled)
	waited := make(chan error, 1)
	go func() { waited <- f.Wait(ctx, nil) }()
	require.Eventually(t, func() bool { return ReadStats().Waiting == 1 }, 10*time.Second, time.Millisecond)
	pullFilled(ctx, t, d1)
	require.NoError(t, <-waited, "the pull of the first made room")
	require.Equal(t, int64(512<<10), unpulled(&f))
	require.Zero(t, ReadStats().Waiting)
	Withdraw(d3.Token)
	Withdraw(d2.Token)
	require.Zero(t, unpulled(&f))
	require.Zero(t, unpulled(&other))

	// A payload a call's Send binds to a peer (the same message sent as a
	// server's response too) counts for that call alone.
	_, ss := pipePair(t)
	d4 := offerFilled(t, 2*limit)
	f.Track([]Token{d4.Token})
	require.True(t, f.Over(ss))
	var response Flow
	require.NoError(t, response.Send(ctx, ss, 0, []Token{d4.Token}))
	require.Zero(t, unpulled(&f))
	require.Equal(t, int64(2*limit), unpulled(&response))

	// The wait ends with the session.
	d5 := offerFilled(t, 2*limit)
	f.Track([]Token{d5.Token})
	go func() { waited <- f.Wait(ctx, ss) }()
	require.Eventually(t, func() bool { return ReadStats().Waiting == 1 }, 10*time.Second, time.Millisecond)
	require.NoError(t, ss.Close())
	require.ErrorContains(t, <-waited, "the session closed")
}

// TestPeerUnpulledBytesBound: what one peer process left unpulled, all its
// calls together, is bounded: past the bound a message waits for the
// peer's pulls of any call's payloads, within its context and its
// payloads' lease. A message larger than the bound on its own goes once
// nothing is unpulled.
func TestPeerUnpulledBytesBound(t *testing.T) {
	const limit = 1 << 20
	setTransferConfig(t, TransferConfig{Limits: Limits{UnpulledBytes: 4 * limit, PeerUnpulledBytes: limit}})
	_, ss := pipePair(t)
	peer := ss.PeerID()
	ctx := testContext(t)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	waiting := func() bool { return ReadStats().Waiting == 1 }

	var stream, unary, other, big, late Flow
	d1 := offerFilled(t, 768<<10)
	require.NoError(t, stream.Send(ctx, ss, 0, []Token{d1.Token}))
	d2 := offerFilled(t, 512<<10)
	err := unary.Send(cancelled, ss, 0, []Token{d2.Token})
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "would go over Limits.PeerUnpulledBytes")
	require.Equal(t, int64(768<<10), Unpulled(peer), "a message held back counts for nothing")
	d3 := offerFilled(t, 128<<10)
	require.NoError(t, unary.Send(ctx, ss, 0, []Token{d3.Token}), "within the bound")

	// Another call's message waits for a pull of any call's payload.
	sent := make(chan error, 1)
	go func() { sent <- other.Send(ctx, ss, 0, []Token{d2.Token}) }()
	require.Eventually(t, waiting, 10*time.Second, time.Millisecond)
	pullFilled(ctx, t, d1)
	require.NoError(t, <-sent, "the pull of the stream's payload made room")
	require.Equal(t, int64(640<<10), Unpulled(peer))

	// Larger than the bound on its own.
	d4 := offerFilled(t, 2*limit)
	go func() { sent <- big.Send(ctx, ss, 0, []Token{d4.Token}) }()
	require.Eventually(t, waiting, 10*time.Second, time.Millisecond)
	pullFilled(ctx, t, d2)
	pullFilled(ctx, t, d3)
	require.NoError(t, <-sent, "it goes once nothing is unpulled")
	require.Equal(t, int64(2*limit), Unpulled(peer))

	// A payload that leaves the outbox while its message waits.
	d5 := offerFilled(t, 4096)
	go func() { sent <- late.Send(ctx, ss, 0, []Token{d5.Token}) }()
	require.Eventually(t, waiting, 10*time.Second, time.Millisecond)
	Withdraw(d5.Token) // as its lease ending would
	require.ErrorContains(t, <-sent, "left the outbox")
	require.Zero(t, ReadStats().Waiting)
	require.Equal(t, int64(2*limit), Unpulled(peer))
	require.Zero(t, late.bytes.Load())
}

// TestPeerUnpulledFirstComeFirstServed: messages waiting for room within
// Limits.PeerUnpulledBytes go in the order they came: a small one does not
// pass a large one that waits before it, and once the first goes, the next
// goes too if it fits beside it.
func TestPeerUnpulledFirstComeFirstServed(t *testing.T) {
	const limit = 1 << 20
	setTransferConfig(t, TransferConfig{Limits: Limits{PeerUnpulledBytes: limit}})
	_, ss := pipePair(t)
	peer := ss.PeerID()
	ctx := testContext(t)
	waiting := func(n int) func() bool { return func() bool { return ReadStats().Waiting == n } }

	var a, b, large, small Flow
	d1, d2 := offerFilled(t, 512<<10), offerFilled(t, 512<<10)
	require.NoError(t, a.Send(ctx, ss, 0, []Token{d1.Token}))
	require.NoError(t, b.Send(ctx, ss, 0, []Token{d2.Token}))
	largeSent, smallSent := make(chan error, 1), make(chan error, 1)
	go func() { largeSent <- large.Send(ctx, ss, 0, []Token{offerFilled(t, 768<<10).Token}) }()
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	go func() { smallSent <- small.Send(ctx, ss, 0, []Token{offerFilled(t, 128<<10).Token}) }()
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond)

	pullFilled(ctx, t, d1)
	require.Eventually(t, func() bool { return Unpulled(peer) == 512<<10 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 2, ReadStats().Waiting, "room for the small one only: it waits behind the large one")
	require.Empty(t, largeSent)
	require.Empty(t, smallSent)

	pullFilled(ctx, t, d2)
	require.NoError(t, <-largeSent)
	require.NoError(t, <-smallSent, "it fits beside the large one")
	require.Equal(t, int64(896<<10), Unpulled(peer))
	require.Zero(t, ReadStats().Waiting)
}

// waitingFor returns a condition: n messages wait for room (Stats.Waiting).
func waitingFor(n int) func() bool { return func() bool { return ReadStats().Waiting == n } }

// sendingOver returns a function that sends a message of d's payload over
// s, as a call of its own, on a goroutine, within ctx; its channel gets the
// outcome.
func sendingOver(ctx context.Context) func(s *transport.Session, d Descriptor) chan error {
	return func(s *transport.Session, d Descriptor) chan error {
		sent := make(chan error, 1)
		go func() { sent <- new(Flow).Send(ctx, s, 0, []Token{d.Token}) }()
		return sent
	}
}

// TestTotalUnpulledBytesBound: what all peers left unpulled together is
// bounded, for a process may open sessions under as many identities as it
// likes: past Limits.TotalUnpulledBytes a message waits for pulls of any
// peer's payloads, within its context and its session. Such messages go in
// the order they came, across peers and within one, and a message larger
// than the bound on its own goes once nothing is unpulled.
func TestTotalUnpulledBytesBound(t *testing.T) {
	const limit = 1 << 20
	setTransferConfig(t, TransferConfig{Limits: Limits{PeerUnpulledBytes: 4 * limit, TotalUnpulledBytes: limit}})
	_, a := pipePair(t)
	_, b := pipePair(t)
	_, c := pipePair(t)
	require.NotEqual(t, a.PeerID(), b.PeerID())
	ctx := testContext(t)
	waiting, send := waitingFor, sendingOver(ctx)

	d1 := offerFilled(t, 768<<10)
	require.NoError(t, new(Flow).Send(ctx, a, 0, []Token{d1.Token}))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	d2 := offerFilled(t, 512<<10)
	err := new(Flow).Send(cancelled, b, 0, []Token{d2.Token})
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "would go over Limits.TotalUnpulledBytes")
	require.Zero(t, Unpulled(b.PeerID()), "a message held back counts for nothing")
	require.Zero(t, ReadStats().Waiting)

	// Another peer's message waits, and so do the messages after it, of
	// its peer and of a third one, though they would fit on their own.
	bFirst := send(b, d2)
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	d3, d4 := offerFilled(t, 128<<10), offerFilled(t, 128<<10)
	bSecond := send(b, d3)
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond)
	cFirst := send(c, d4)
	require.Eventually(t, waiting(3), 10*time.Second, time.Millisecond)
	require.Equal(t, int64(768<<10), ReadStats().Unpulled)
	require.Empty(t, bFirst)
	require.Empty(t, bSecond)
	require.Empty(t, cFirst)

	// A pull of the first peer's payload makes room for all three.
	pullFilled(ctx, t, d1)
	require.NoError(t, <-bFirst)
	require.NoError(t, <-bSecond)
	require.NoError(t, <-cFirst)
	require.Equal(t, int64(640<<10), Unpulled(b.PeerID()))
	require.Equal(t, int64(128<<10), Unpulled(c.PeerID()))
	require.Equal(t, int64(768<<10), ReadStats().Unpulled)
	require.Zero(t, ReadStats().Waiting)

	// Larger than the bound on its own: it goes once nothing is unpulled.
	d5 := offerFilled(t, 2*limit)
	big := send(a, d5)
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	for _, d := range []Descriptor{d2, d3, d4} {
		pullFilled(ctx, t, d)
	}
	require.NoError(t, <-big)
	require.Equal(t, int64(2*limit), ReadStats().Unpulled)

	// The wait ends with the waiting message's session; the next goes on
	// waiting.
	d6, d7 := offerFilled(t, 4096), offerFilled(t, 4096)
	gone := send(b, d6)
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	next := send(c, d7)
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond)
	require.NoError(t, b.Close())
	require.ErrorContains(t, <-gone, "the session closed")
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	pullFilled(ctx, t, d5)
	require.NoError(t, <-next)
	require.Equal(t, int64(4096), ReadStats().Unpulled)
	pullFilled(ctx, t, d7)
	require.Zero(t, ReadStats().Unpulled)
	require.Zero(t, ReadStats().Waiting)
}

// A message first among all peers' waiters that stops fitting its own
// peer's bound (payloads bound toward that peer without waiting, SentToward)
// waits for its peer alone: other peers' messages go once the total has room.
func TestTotalUnpulledWaiterOverPeerBound(t *testing.T) {
	const k = 1 << 10
	setTransferConfig(t, TransferConfig{Limits: Limits{PeerUnpulledBytes: 600 * k, TotalUnpulledBytes: 1024 * k}})
	_, a := pipePair(t)
	_, x := pipePair(t)
	_, y := pipePair(t)
	ctx := testContext(t)
	waiting, send := waitingFor, sendingOver(ctx)
	d1 := offerFilled(t, 768*k)
	require.NoError(t, new(Flow).Send(ctx, a, 0, []Token{d1.Token}))
	dx, dy, dz := offerFilled(t, 512*k), offerFilled(t, 128*k), offerFilled(t, 200*k)
	xSent := send(x, dx)
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	ySent := send(y, dy)
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond)
	SentToward(x, []Token{dz.Token}) // x's message no longer fits beside it
	pullFilled(ctx, t, d1)
	require.NoError(t, <-ySent, "the total has room: y's message does not wait behind x's")
	require.Equal(t, 1, ReadStats().Waiting)
	pullFilled(ctx, t, dz)
	require.NoError(t, <-xSent)
	require.Equal(t, int64(640*k), ReadStats().Unpulled)

	// The same where the room the total gets fits y's message and not x's:
	// nothing wakes x, which must have left the queue when it stopped
	// fitting its peer's bound.
	pullFilled(ctx, t, dx)
	pullFilled(ctx, t, dy)
	d2a, d2b := offerFilled(t, 500*k), offerFilled(t, 268*k)
	SentToward(a, []Token{d2a.Token, d2b.Token})
	dx, dy, dz = offerFilled(t, 512*k), offerFilled(t, 128*k), offerFilled(t, 200*k)
	xSent = send(x, dx)
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond)
	ySent = send(y, dy)
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond)
	SentToward(x, []Token{dz.Token})
	pullFilled(ctx, t, d2b) // the total holds 700 KiB: room for y's 128, not x's 512
	require.NoError(t, <-ySent, "y's message does not wait behind one that waits for its own peer")
	pullFilled(ctx, t, dz)
	pullFilled(ctx, t, d2a)
	require.NoError(t, <-xSent)
}

// A bound lifted with the largest value stays lifted in the totals that
// default to twice it.
func TestLimitsDefaultsSaturate(t *testing.T) {
	l := Limits{PullBytes: math.MaxInt64, PeerUnpulledBytes: math.MaxInt64}.withDefaults(time.Second)
	require.Equal(t, int64(math.MaxInt64-1), l.TotalPullBytes)
	require.Equal(t, int64(math.MaxInt64-1), l.TotalUnpulledBytes)
	l = Limits{}.withDefaults(time.Second)
	require.Equal(t, int64(2*DefaultPullBytes), l.TotalPullBytes)
	require.Equal(t, int64(2*DefaultPeerUnpulledBytes), l.TotalUnpulledBytes)
	require.Equal(t, DefaultPeerLingeringSessions, l.PeerLingeringSessions)
	require.Equal(t, DefaultHostLingeringSessions, l.HostLingeringSessions)
}

// TestCallEndedWithdrawsUnpulled: a client that ends a call tells the
// server, whose outbox withdraws what it sent for that call and nobody
// pulled, rather than keep it for the lease; a message of the call not sent
// yet then fails. The server's other calls to that client keep theirs.
func TestCallEndedWithdrawsUnpulled(t *testing.T) {
	cs, ss := pipePair(t)
	peer := ss.PeerID()
	offer := func() Descriptor {
		d := Offer(Source{Bytes: bytes.Repeat([]byte{7}, 64<<10)}, OfferOptions{})
		t.Cleanup(func() { Withdraw(d.Token) })
		return d
	}
	ctx := testContext(t)
	var ended, other Flow
	d1, d2, d3 := offer(), offer(), offer()
	require.NoError(t, ended.Send(ctx, ss, 42, []Token{d1.Token, d2.Token}))
	require.NoError(t, other.Send(ctx, ss, 43, []Token{d3.Token}))
	require.Equal(t, int64(192<<10), Unpulled(peer))

	(&Call{ID: 42}).Ended(cs, true)
	require.Eventually(t, func() bool { return !Offered(d1.Token) && !Offered(d2.Token) }, 10*time.Second, time.Millisecond,
		"the ended call's payloads leave the outbox")
	require.True(t, Offered(d3.Token), "another call's stay")
	require.Equal(t, int64(64<<10), Unpulled(peer))

	d4 := offer()
	require.ErrorContains(t, ended.Send(ctx, ss, 42, []Token{d4.Token}), "ended call 42")
	require.False(t, Offered(d4.Token), "a message of the ended call is withdrawn")
	require.Equal(t, int64(64<<10), Unpulled(peer))
	_, _, err := FetchNew(ctx, d1, devicebuf.NewHostAllocator().Alloc)
	var te *TransferError
	require.ErrorAs(t, err, &te)
	require.Equal(t, TransferNotFound, te.Kind)
}

// servedFrom returns the serving end of a session whose client connected
// from host, both ends with engines of cfg and identities of their own.
func servedFrom(t *testing.T, host string, cfg TransferConfig) *transport.Session {
	t.Helper()
	c1, c2 := tcpConnFrom(t, host)
	_, s := transporttest.PairOver(t, c1, c2,
		[]transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(cfg))},
		[]transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(cfg))})
	return s
}

// Park bounds what a session's requests park by Limits.PullBytes and what
// the sessions of one remote host park by Limits.TotalPullBytes, whatever
// identities they took; a request parks once either room frees, and another
// host's parks at once.
func TestParkBoundedPerHost(t *testing.T) {
	const n = 1 << 20
	cfg := TransferConfig{Timeout: time.Minute, Limits: Limits{PullBytes: 2 * n, TotalPullBytes: 3 * n}}
	from := func(host string) *transport.Session { return servedFrom(t, host, cfg) }
	park := func(ctx context.Context, s *transport.Session) (func(), error) { return Park(ctx, s, n) }
	a1, a2, b := from("127.0.0.2"), from("127.0.0.2"), from("127.0.0.3")

	unpark1, err := park(testContext(t), a1)
	require.NoError(t, err)
	unpark2, err := park(testContext(t), a1)
	require.NoError(t, err)
	short, cancel := context.WithTimeout(testContext(t), 50*time.Millisecond)
	_, err = park(short, a1)
	cancel()
	require.ErrorContains(t, err, "Limits.PullBytes", "a third on the session, over its PullBytes")
	unpark3, err := park(testContext(t), a2) // the host's third
	require.NoError(t, err)

	parked := make(chan func(), 1)
	go func() {
		unpark, err := park(testContext(t), a2) // the host's fourth, over TotalPullBytes
		assert.NoError(t, err)
		parked <- unpark
	}()
	require.Eventually(t, func() bool { return ReadStats().ParkWaiting == 1 }, 10*time.Second, time.Millisecond)
	unparkB, err := park(testContext(t), b) // another host's
	require.NoError(t, err)
	select {
	case <-parked:
		t.Fatal("the host's fourth parked over TotalPullBytes")
	default:
	}
	unpark1()
	unpark4 := <-parked
	require.Equal(t, int64(4*n), ReadStats().Parked)
	for _, unpark := range []func(){unpark2, unpark3, unpark4, unparkB, unpark1} { // unpark1 twice: once counts
		unpark()
	}
	require.Zero(t, ReadStats().Parked)
	parkedHosts.Lock()
	defer parkedHosts.Unlock()
	require.Empty(t, parkedHosts.bytes)
	require.Empty(t, parkedHosts.room)
}

// Requests that wait to park on a session park in the order they came: a
// smaller one that would fit does not pass a larger one ahead of it, and
// one that gives up lets the next take its turn.
func TestParkInTurn(t *testing.T) {
	const n = 1 << 20
	cfg := TransferConfig{Timeout: time.Minute, Limits: Limits{PullBytes: 3 * n, TotalPullBytes: 10 * n}}
	s := servedFrom(t, "127.0.0.2", cfg)
	type parked struct {
		unpark func()
		err    error
	}
	parkAsync := func(ctx context.Context, size uint64) <-chan parked {
		done := make(chan parked, 1)
		go func() {
			unpark, err := Park(ctx, s, size)
			done <- parked{unpark, err}
		}()
		return done
	}
	waiting := func(k int) {
		t.Helper()
		require.Eventually(t, func() bool { return ReadStats().ParkWaiting == k }, 10*time.Second, time.Millisecond, "%d waiting", k)
	}

	unparkA, err := Park(testContext(t), s, 2*n)
	require.NoError(t, err)
	b := parkAsync(testContext(t), 2*n) // 4n: over
	waiting(1)
	c := parkAsync(testContext(t), n) // 3n would fit, behind b
	waiting(2)
	require.Equal(t, int64(2*n), ReadStats().Parked, "the smaller request passed the larger")
	unparkA()
	got := <-b
	require.NoError(t, got.err)
	unparkB := got.unpark
	got = <-c
	require.NoError(t, got.err)
	unparkC := got.unpark
	require.Equal(t, int64(3*n), ReadStats().Parked)

	// The first in line gives up: the next takes its turn.
	giveUp, cancel := context.WithCancel(testContext(t))
	d := parkAsync(giveUp, 2*n)
	waiting(1)
	e := parkAsync(testContext(t), n)
	waiting(2)
	cancel()
	require.Error(t, (<-d).err)
	waiting(1) // e, still over
	unparkB()
	got = <-e
	require.NoError(t, got.err)
	for _, unpark := range []func(){unparkC, got.unpark} {
		unpark()
	}
	require.Zero(t, ReadStats().Parked)
	require.Zero(t, ReadStats().ParkWaiting)
}

// The requests of a host's sessions that wait for the host's room park in
// the order they came: a later request of another session of the host,
// though it would fit, does not pass an earlier, larger one.
func TestParkHostInTurn(t *testing.T) {
	const n = 1 << 20
	cfg := TransferConfig{Timeout: time.Minute, Limits: Limits{PullBytes: 3 * n, TotalPullBytes: 3 * n}}
	from := func(host string) *transport.Session { return servedFrom(t, host, cfg) }
	parkAsync := func(s *transport.Session, size uint64) <-chan func() {
		done := make(chan func(), 1)
		go func() {
			unpark, err := Park(testContext(t), s, size)
			assert.NoError(t, err)
			done <- unpark
		}()
		return done
	}
	state := func(parked int64, waiting int) func() bool {
		return func() bool { st := ReadStats(); return st.Parked == parked && st.ParkWaiting == waiting }
	}
	a1, a2 := from("127.0.0.2"), from("127.0.0.2")
	unparkFirst, err := Park(testContext(t), a2, n)
	require.NoError(t, err)
	large := parkAsync(a1, 3*n) // waits for the host's room
	require.Eventually(t, state(n, 1), 10*time.Second, time.Millisecond)
	later := parkAsync(a2, n) // would fit, but comes after
	require.Eventually(t, state(n, 2), 10*time.Second, time.Millisecond, "the later request waits its turn: %+v", ReadStats())
	unparkFirst()
	unparkLarge := <-large
	require.Eventually(t, state(3*n, 1), 10*time.Second, time.Millisecond)
	unparkLarge()
	(<-later)()
	require.Eventually(t, state(0, 0), 10*time.Second, time.Millisecond)
	parkedHosts.Lock()
	defer parkedHosts.Unlock()
	require.Empty(t, parkedHosts.bytes)
	require.Empty(t, parkedHosts.queue)
	require.Empty(t, parkedHosts.room)
}
