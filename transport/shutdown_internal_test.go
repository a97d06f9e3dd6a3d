package transport

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A Shutdown called while the first one waits for an Accept under way
// (acceptEnded.Wait releases acceptedMu) takes nothing from it: the first
// closes the accepted sessions and returns once they are closed.
func TestConcurrentShutdownKeepsSessions(t *testing.T) {
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP))
	require.NoError(t, err)
	defer l.Close()
	type res struct {
		c   net.Conn
		err error
	}
	acc := make(chan res, 1)
	go func() {
		c, err := l.Accept()
		acc <- res{c, err}
	}()
	cc, err := DialConn(context.Background(), l.Addr().String(), WithMode(ModeTCP))
	require.NoError(t, err)
	defer cc.Close()
	r := <-acc
	require.NoError(t, r.err)
	s := SessionOf(r.c)
	require.NotNil(t, s)

	// An Accept under way, as Accept is between its accepting++ and its
	// deferred decrement (its select still to run).
	l.acceptedMu.Lock()
	l.accepting++
	l.acceptedMu.Unlock()

	first := make(chan error, 1)
	go func() { first <- l.Shutdown(context.Background()) }()
	require.Eventually(t, func() bool {
		l.acceptedMu.Lock()
		defer l.acceptedMu.Unlock()
		return l.acceptEnded != nil
	}, 5*time.Second, time.Millisecond, "the first Shutdown waits for the Accept")

	// A second Shutdown, whose context is done: it returns at once, the
	// first still waiting.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, l.Shutdown(ctx), context.Canceled)

	// The Accept ends.
	l.acceptedMu.Lock()
	l.accepting--
	l.acceptEnded.Broadcast()
	l.acceptedMu.Unlock()

	require.NoError(t, <-first)
	select {
	case <-s.Released():
	default:
		t.Fatal("the first Shutdown returned with the session Accept returned still up: the second took the accepted conns from it")
	}
}
