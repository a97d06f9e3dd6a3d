package transport

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// idleChecks returns an option that reports each look of the session's idle
// watcher on the channel (dropping what nobody reads), after running do, if
// set, on the watcher's goroutine.
func idleChecks(ch chan bool, do func(s *Session, busy bool)) Option {
	return func(c *config) {
		c.idleCheck = func(s *Session, busy bool) {
			if do != nil {
				do(s, busy)
			}
			select {
			case ch <- busy:
			default:
			}
		}
	}
}

func waitDone(t *testing.T, s *Session) {
	t.Helper()
	select {
	case <-s.Done():
	case <-time.After(handTimeout):
		t.Fatal("session still open")
	}
}

// TestIdleTimeoutClosesUnusedSession: a session that finished its handshake
// but carries nothing is closed after its idle timeout, with ErrIdle; its
// peer sees it go.
func TestIdleTimeoutClosesUnusedSession(t *testing.T) {
	const idle = 40 * time.Millisecond
	start := time.Now()
	c, s := pipePairWith(t, []Option{WithIdleTimeout(idle)}, []Option{WithIdleTimeout(-1)})
	waitDone(t, c)
	require.GreaterOrEqual(t, time.Since(start), idle)
	require.ErrorIs(t, c.Err(), ErrIdle)
	require.ErrorContains(t, c.Err(), "gdrpc: session idle for 40ms")
	waitDone(t, s)
	require.ErrorIs(t, s.Err(), ErrPeerGone)
	require.Empty(t, SessionsTo(c.Peer().ID))
	require.Empty(t, SessionsTo(s.Peer().ID))
}

// TestIdleTimeoutListener: a client that completes the handshake with a
// Listener and never opens its gRPC stream loses the session after the
// listener's idle timeout, and the listener forgets it.
func TestIdleTimeoutListener(t *testing.T) {
	// Long enough that the dial has opened its lanes before it runs out, on
	// a loaded machine too.
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithIdleTimeout(time.Second))
	require.NoError(t, err)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	c, err := Dial(ctx, l.Addr().String(), WithMode(ModeTCP), WithIdleTimeout(-1))
	require.NoError(t, err)
	defer c.Close()
	waitDone(t, c)
	require.ErrorIs(t, c.Err(), ErrPeerGone)
	require.Empty(t, SessionsTo(c.Peer().ID))
}

// TestIdleTimeoutSparesUsedSessions: control messages keep a session open,
// and so does its gRPC stream once taken, for as long as they last. The
// watcher's looks are the clock: the session under test must stay open
// across several idle timeouts' worth of them.
func TestIdleTimeoutSparesUsedSessions(t *testing.T) {
	const idle = 20 * time.Millisecond
	const looks = 3 * 4 // three idle timeouts: the watcher looks four times per timeout
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()

	t.Run("control messages", func(t *testing.T) {
		checks := make(chan bool, 1)
		// Before each look the session sends a message, as a peer busy
		// with transfers would.
		send := func(s *Session, _ bool) { _ = s.link.SendControl(ctx, testCtlNone, []byte("busy")) }
		c, _ := pipePairWith(t, []Option{WithIdleTimeout(idle), idleChecks(checks, send)}, []Option{WithIdleTimeout(-1)})
		for range looks {
			select {
			case <-checks:
			case <-c.Done():
				t.Fatalf("session closed: %v", c.Err())
			case <-ctx.Done():
				t.Fatal("the idle watcher stopped looking")
			}
		}
		require.NoError(t, c.Err())
	})

	t.Run("gRPC stream", func(t *testing.T) {
		checks := make(chan bool, 1)
		// Until the stream is taken, messages keep the session open; then
		// nothing but the stream does.
		sendUntilBusy := func(s *Session, busy bool) {
			if !busy {
				_ = s.link.SendControl(ctx, testCtlNone, []byte("busy"))
			}
		}
		c, s := pipePairWith(t, []Option{WithIdleTimeout(idle), idleChecks(checks, sendUntilBusy)}, []Option{WithIdleTimeout(-1)})
		_, err := c.Conn(ctx)
		require.NoError(t, err)
		_, err = s.Conn(ctx)
		require.NoError(t, err)
		busyLooks := 0
		for busyLooks < looks {
			select {
			case busy := <-checks:
				if busy {
					busyLooks++
				}
			case <-c.Done():
				t.Fatalf("session closed: %v", c.Err())
			case <-ctx.Done():
				t.Fatal("the idle watcher stopped looking")
			}
		}
		require.NoError(t, c.Err())
	})
}

func TestIdleTimeoutOption(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
		want time.Duration
	}{
		{name: "default", want: DefaultIdleTimeout},
		{name: "zero", opts: []Option{WithIdleTimeout(0)}, want: 2 * time.Minute},
		{name: "set", opts: []Option{WithIdleTimeout(time.Second)}, want: time.Second},
		{name: "disabled", opts: []Option{WithIdleTimeout(-1)}, want: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := newConfig(tc.opts)
			require.NoError(t, err)
			require.Equal(t, tc.want, cfg.idleTimeout)
		})
	}
}
