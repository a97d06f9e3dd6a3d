package oob

import (
	"bytes"
	"context"
	"io"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

// tcpConnPair returns both ends of a loopback TCP connection: conns that
// half-close (CloseWrite) and read on.
func tcpConnPair(tb testing.TB) (a, b net.Conn) {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	a, err = net.Dial("tcp", l.Addr().String())
	require.NoError(tb, err)
	b = waitFor(tb, accepted, "the accepted conn")
	require.NotNil(tb, b)
	tb.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// After writing a bulk stream whole, the owner half-closes it and waits for
// the receiver to close its side: an honest receiver, which reads to the
// owner's close and closes, lets the push end at once; one that keeps the
// stream open past the push's deadline ends the session, so the streams a
// session keeps stay within Limits.Pushes.
func TestAwaitBulkClose(t *testing.T) {
	for _, tc := range []struct {
		name   string
		closes bool
	}{
		{"receiver closes", true},
		{"receiver keeps it open", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, owner := pipePair(t)
			oc, rc := tcpConnPair(t)
			read := make(chan error, 1)
			go func() {
				_, err := io.Copy(io.Discard, rc) // to the owner's close
				if tc.closes {
					rc.Close()
				}
				read <- err
			}()
			_, err := oc.Write([]byte("payload"))
			require.NoError(t, err)
			timeout := 300 * time.Millisecond
			if tc.closes {
				timeout = testTimeout
			}
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			err = awaitBulkClose(ctx, owner, oc)
			require.NoError(t, waitFor(t, read, "the receiver's read to the owner's close"))
			if tc.closes {
				require.NoError(t, err)
				requireLive(t, owner)
				return
			}
			require.ErrorIs(t, err, errBulkLeftOpen)
			requireEnds(t, owner, errBulkLeftOpen.Error())
		})
	}
}

// Over a session's multiplexed bulk streams: a receiver that reads a push's
// stream to the owner's half-close but never closes its side ends the
// session when the push's time is up, instead of leaving the owner's
// multiplexer a stream per RTR for a minute; an honest receiver's pushes
// end with the stream.
func TestBulkStreamLeftOpenEndsSession(t *testing.T) {
	var attacker atomic.Pointer[transport.Session]
	read := make(chan struct{}, 1)
	serveBulkOn(t, attacker.Load, func(bs *transport.Session, c net.Conn) {
		_, _ = io.Copy(io.Discard, c) // to the owner's half-close; never closed
		read <- struct{}{}
		<-bs.Done()
	})
	tcp := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(false)}

	// An honest receiver: the push's stream closes, the session lives.
	_, cs, _, _, _ := lanePair(t, tcp, tcp)
	want := bytes.Repeat([]byte("payload "), 32<<10)
	d := Offer(Source{Bytes: want}, OfferOptions{})
	d.Owner = cs.Peer().ID
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	b, _, err := FetchNew(ctx, d, devicebuf.NewHostAllocator().Alloc)
	require.NoError(t, err)
	got, _ := b.HostBytes()
	require.Equal(t, want, got)
	b.Release()
	requireLive(t, cs)

	// The attacker's pair alone has a short transfer timeout: the honest
	// fetch above keeps the default, whatever the machine's load.
	short := func() []transport.Option {
		return append(slices.Clip(tcp), transport.WithEngine(New(TransferConfig{Timeout: 2 * time.Second})))
	}
	_, cs, owner, _, _ := lanePair(t, short(), short())
	attacker.Store(cs)
	d = Offer(Source{Bytes: want}, OfferOptions{Held: true})
	defer Withdraw(d.Token)
	m := &rtr{Req: 1, Token: d.Token, Length: d.Length, Offers: PathStream}
	require.NoError(t, sendControl(ctx, cs, ctlRTR, m.marshal()))
	waitFor(t, read, "the attacker's read of the push")
	requireEnds(t, owner, errBulkLeftOpen.Error())
}
