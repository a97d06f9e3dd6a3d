package oob

import (
	"bytes"
	"context"
	"io"
	"net"
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
	controlMu.Lock()
	orig := bulkHandler
	bulkHandler = func(bs *transport.Session, c net.Conn) {
		if bs != receiver {
			orig(bs, c)
			return
		}
		arrived <- struct{}{}
		<-release
		_ = c.SetReadDeadline(time.Now().Add(testTimeout))
		b, _ := io.ReadAll(c) // to the owner's close
		_ = c.Close()
		got <- b[min(len(b), bulkHeaderLen):]
	}
	controlMu.Unlock()
	t.Cleanup(func() { controlMu.Lock(); bulkHandler = orig; controlMu.Unlock() })
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
