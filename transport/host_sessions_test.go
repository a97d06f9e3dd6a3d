package transport

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A listener keeps at most WithHostSessions connections from one host:
// sessions from their handshake until released, plain gRPC connections
// until closed. A handshake past the bound is refused with the reason, a
// plain connection past it is closed, and a place comes back when a session
// is released, a plain connection closed, or a handshake fails after it was
// counted.
func TestHostSessionsBound(t *testing.T) {
	const bound = 2
	opts := []Option{WithEngine(testEngine{}), WithMode(ModeTCP), WithIdleTimeout(-1)}
	l, err := Listen("127.0.0.1:0", append(opts, WithHostSessions(bound))...)
	require.NoError(t, err)
	defer l.Close()
	addr := l.Addr().String()
	host := netip.MustParsePrefix("127.0.0.1/32")
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	accepted := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	takeAccepted := func() net.Conn {
		t.Helper()
		select {
		case c := <-accepted:
			return c
		case <-ctx.Done():
			t.Fatal("nothing accepted")
			return nil
		}
	}
	dial := func() (*Session, error) {
		s, err := Dial(ctx, addr, opts...)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = s.Close() })
		if _, err := s.Conn(ctx); err != nil {
			return nil, err
		}
		return s, nil
	}
	held := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool { return l.conns.held(host) == n }, handTimeout, time.Millisecond, "the host holds %d places", n)
	}

	a, err := dial()
	require.NoError(t, err)
	sa := takeAccepted()
	b, err := dial()
	require.NoError(t, err)
	sb := takeAccepted()
	require.Equal(t, bound, l.conns.held(host))

	_, err = dial()
	var re *RejectError
	require.ErrorAs(t, err, &re, "a third session from the host")
	require.Equal(t, uint8(rejectBusy), re.Code)
	require.ErrorContains(t, err, "at most 2 sessions from one host")
	require.Equal(t, bound, l.conns.held(host), "a refused handshake holds no place")

	// A plain gRPC client's connection past the bound is closed unanswered.
	plainRefused := func() {
		t.Helper()
		c, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(handTimeout)))
		n, err := c.Read(make([]byte, 64))
		require.Zero(t, n)
		if !errors.Is(err, syscall.ECONNRESET) {
			require.ErrorIs(t, err, io.EOF)
		}
	}
	plainRefused()

	// A session released gives its place back.
	require.NoError(t, b.Close())
	_ = sb.Close()
	held(bound - 1)
	c, err := dial()
	require.NoError(t, err)
	sc := takeAccepted()
	held(bound)

	// A handshake that fails after it was counted (the client sends its
	// hello, reads the welcome and leaves) gives its place back.
	require.NoError(t, c.Close())
	_ = sc.Close()
	held(bound - 1)
	raw, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	id := NewIdentity()
	_, err = raw.Write(encodeHello(hello{ID: id.ID(), HostID: LocalHostID(), Mode: ModeTCP, Key: id.publicKey(), Nonce: newNonce()}))
	require.NoError(t, err)
	_, wb := readHandFrame(t, raw)
	require.NotEmpty(t, wb, "a welcome, not a reject")
	held(bound)
	require.NoError(t, raw.Close())
	held(bound - 1)

	// Plain connections count alike, until gRPC (here the test) closes them.
	p, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	require.NoError(t, err)
	sp := takeAccepted()
	require.Nil(t, SessionOf(sp))
	held(bound)
	plainRefused()
	_, err = dial()
	require.ErrorAs(t, err, &re, "a plain connection took the last place")
	require.NoError(t, sp.Close())
	_ = sp.Close() // a second close gives nothing back
	held(bound - 1)

	require.NoError(t, a.Close())
	_ = sa.Close()
	held(0)
}
