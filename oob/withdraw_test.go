package oob

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// Withdraw returns only once no push reads the entry's Bytes: a push under
// way, blocked on a receiver that reads its bulk stream slowly, is cut short
// and answered with a failed FIN, and the receiver gets none of what the
// application writes into the slice after Withdraw returned.
func TestWithdrawWaitsForPushOfBytes(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout})
	var receiver *transport.Session
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	got := make(chan []byte, 1)
	serveBulkOn(t, func() *transport.Session { return receiver }, func(_ *transport.Session, c net.Conn) {
		arrived <- struct{}{}
		<-release
		_ = c.SetReadDeadline(time.Now().Add(testTimeout))
		b, _ := io.ReadAll(c) // to the owner's close
		_ = c.Close()
		got <- b[min(len(b), bulkHeaderLen):]
	})
	fins := make(chan *fin, 1)
	interceptControl(t, ctlFIN, func(s *transport.Session, p []byte) bool {
		if s != receiver {
			return false
		}
		f, err := parseFIN(p)
		require.NoError(t, err)
		fins <- f
		return true
	})
	// A window far below the payload: the owner's writes wait for the
	// receiver to read.
	var owner *transport.Session
	receiver, owner = pipePair(t, transport.WithWindow(256<<10))
	offered := ReadStats().Offered

	const n = 1 << 20
	public := bytes.Repeat([]byte("public-"), n/7+1)[:n]
	payload := bytes.Clone(public)
	d := Offer(Source{Bytes: payload}, OfferOptions{Held: true})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	m := &rtr{Req: 1, Token: d.Token, Length: d.Length, Offers: PathStream}
	require.NoError(t, sendControl(ctx, receiver, ctlRTR, m.marshal()))
	waitFor(t, arrived, "the bulk stream")

	// The call ends: the payload is withdrawn, and the application reuses
	// its slice.
	Withdraw(d.Token)
	require.False(t, Offered(d.Token))
	secret := []byte("SECRET!")
	for i := 0; i+len(secret) <= n; i += len(secret) {
		copy(payload[i:], secret)
	}

	close(release)
	b := waitFor(t, got, "the bytes the receiver read")
	f := waitFor(t, fins, "the FIN")
	require.Zero(t, bytes.Count(b, secret), "bytes written after Withdraw returned reached the receiver")
	require.Less(t, len(b), n, "the withdrawn push was cut short")
	require.Equal(t, public[:len(b)], b)
	require.Equal(t, finFailed, f.Status, "a push cut short by Withdraw reports success")
	require.Contains(t, f.Msg, errWithdrawn.Error())
	require.Eventually(t, func() bool { return stateOf(owner).act.inflight.Load() == 0 }, testTimeout, time.Millisecond, "the push ended")
	require.Equal(t, offered, ReadStats().Offered)
	requireLive(t, owner)
}

// A Withdraw of an entry that is leaving already (another Withdraw, the
// lease, or a completed pull of an entry not held is ending its pulls) waits
// for the pulls too; the source is freed once, when the last one checks in.
func TestWithdrawWhileLeaving(t *testing.T) {
	d := Offer(Source{Bytes: make([]byte, 10)}, OfferOptions{Held: true})
	e, u, _, err := box.checkout(d.Token, 10, nil)
	require.NoError(t, err)
	reading := make(chan struct{})
	stopRead := make(chan struct{})
	readDone := make(chan error, 1)
	go func() {
		readDone <- u.read(func() error {
			close(reading)
			<-stopRead
			return nil
		})
	}()
	<-reading
	withdrawn := make(chan struct{}, 2)
	for range 2 {
		go func() {
			Withdraw(d.Token)
			withdrawn <- struct{}{}
		}()
	}
	require.Eventually(t, func() bool {
		box.mu.Lock()
		defer box.mu.Unlock()
		return box.leaving[d.Token] != nil
	}, testTimeout, time.Millisecond, "the entry leaves")
	select {
	case <-withdrawn:
		t.Fatal("Withdraw returned while a pull read the source")
	default:
	}
	close(stopRead)
	require.NoError(t, <-readDone)
	waitFor(t, withdrawn, "the first Withdraw")
	waitFor(t, withdrawn, "the second Withdraw")
	require.ErrorIs(t, u.read(func() error { return nil }), errWithdrawn)
	require.False(t, box.checkin(d.Token, e, u, true), "a pull the entry's leaving ended completed")
	box.mu.Lock()
	defer box.mu.Unlock()
	require.Nil(t, box.leaving[d.Token])
	require.True(t, e.freed)
}

// On the bulk lane too, Withdraw returns without waiting for a receiver
// that stopped reading (a frame is written from the payload for at most
// laneQuick, then finished from a copy), and the receiver gets none of what
// the application writes into the slice after Withdraw returned.
func TestWithdrawDuringLanePush(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout})
	var receiver atomic.Pointer[transport.Session]
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	// The receiver's lane reader starts with its session, before the test
	// knows the session: it is the one client made meanwhile.
	type frameBody struct {
		f    laneFrame
		body []byte
	}
	got := make(chan []frameBody, 1)
	controlMu.Lock()
	orig := laneHandler
	laneHandler = func(ls *transport.Session, c net.Conn) error {
		if !ls.IsClient() {
			return orig(ls, c)
		}
		hdr := make([]byte, laneFrameLen)
		if _, err := io.ReadFull(c, hdr); err != nil {
			return err
		}
		arrived <- struct{}{}
		<-release // stalled with the first frame's header read
		var frames []frameBody
		for {
			f, err := parseLaneFrame(hdr)
			if err != nil {
				return err
			}
			body := make([]byte, f.n)
			if _, err := io.ReadFull(c, body); err != nil {
				return err
			}
			frames = append(frames, frameBody{f, body})
			if f.kind == laneAbort || f.off+f.n == f.total {
				got <- frames
				<-ls.Done()
				return nil
			}
			if _, err := io.ReadFull(c, hdr); err != nil {
				return err
			}
		}
	}
	controlMu.Unlock()
	t.Cleanup(func() { controlMu.Lock(); laneHandler = orig; controlMu.Unlock() })
	fins := make(chan *fin, 1)
	interceptControl(t, ctlFIN, func(s *transport.Session, p []byte) bool {
		if s != receiver.Load() {
			return false
		}
		f, err := parseFIN(p)
		require.NoError(t, err)
		fins <- f
		return true
	})
	tcp := []transport.Option{transport.WithMode(transport.ModeTCP)}
	_, cs, owner, _, _ := lanePair(t, tcp, tcp)
	receiver.Store(cs)
	require.NotNil(t, stateOf(owner).link.Lane())

	const n = 64 << 20 // far more than the lane's socket buffers hold
	public := bytes.Repeat([]byte("public-"), n/7+1)[:n]
	payload := bytes.Clone(public)
	d := Offer(Source{Bytes: payload}, OfferOptions{Held: true})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	copied := make(chan struct{}, 1)
	laneCopied = func() {
		select {
		case copied <- struct{}{}:
		default:
		}
	}
	t.Cleanup(func() { laneCopied = func() {} })
	m := &rtr{Req: 1, Token: d.Token, Length: d.Length, Offers: PathStream}
	require.NoError(t, sendControl(ctx, cs, ctlRTR, m.marshal()))
	waitFor(t, arrived, "the first frame")
	waitFor(t, copied, "a frame the receiver did not take in time, finished from a copy")

	withdrawn := make(chan struct{})
	go func() { Withdraw(d.Token); close(withdrawn) }()
	waitFor(t, withdrawn, "Withdraw, with the receiver stalled")
	secret := []byte("SECRET!")
	for i := 0; i+len(secret) <= n; i += len(secret) {
		copy(payload[i:], secret)
	}
	close(release)
	frames := waitFor(t, got, "the frames the receiver read")
	var sent uint64
	for _, fb := range frames {
		require.Zero(t, bytes.Count(fb.body, secret), "bytes written after Withdraw returned reached the receiver")
		require.Equal(t, public[fb.f.off:fb.f.off+fb.f.n], fb.body)
		sent += fb.f.n
	}
	require.Less(t, sent, uint64(n), "the withdrawn push was cut short")
	require.Equal(t, uint8(laneAbort), frames[len(frames)-1].f.kind)
	f := waitFor(t, fins, "the FIN")
	require.Equal(t, finFailed, f.Status)
	require.Contains(t, f.Msg, errWithdrawn.Error())
	requireLive(t, owner)
}
