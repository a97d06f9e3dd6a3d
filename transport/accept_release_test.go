package transport

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A listener forgets an accepted session once it is released, without
// waiting for the next Accept; AfterRelease runs its function then.
func TestAcceptedForgottenOnRelease(t *testing.T) {
	l, cs, ss, _, sc := lanePair(t, []Option{WithMode(ModeTCP)}, []Option{WithMode(ModeTCP)})
	accepted := func() int {
		l.acceptedMu.Lock()
		defer l.acceptedMu.Unlock()
		return len(l.accepted)
	}
	require.Equal(t, 1, accepted())
	require.Same(t, ss, SessionOf(sc))
	ran := make(chan struct{})
	ss.AfterRelease(func() { close(ran) })
	stop := ss.AfterRelease(func() { t.Error("a stopped AfterRelease ran") })
	require.True(t, stop())

	require.NoError(t, cs.Close())
	select {
	case <-ran:
	case <-time.After(10 * time.Second):
		t.Fatal("AfterRelease did not run once the session was released")
	}
	require.True(t, released(ss))
	require.Eventually(t, func() bool { return accepted() == 0 }, 10*time.Second, time.Millisecond)

	// Registered after the release, it runs at once.
	late := make(chan struct{})
	ss.AfterRelease(func() { close(late) })
	<-late
}

// Shutdown waits for the sessions the listener accepted that were released
// before it (their client closed) to close, their handlers' Closed
// included, as it waits for those it closes itself.
func TestShutdownWaitsForReleased(t *testing.T) {
	hold := make(chan struct{})
	var closedDone atomic.Bool
	setHook(t, &testHooks.closed, func(s *Session) {
		if !s.client {
			<-hold
			closedDone.Store(true)
		}
	})
	l, cs, ss, _, _ := lanePair(t, []Option{WithMode(ModeTCP)}, []Option{WithMode(ModeTCP)})
	var once sync.Once
	release := func() { once.Do(func() { close(hold) }) }
	defer release()
	require.NoError(t, cs.Close())
	select {
	case <-ss.Released():
	case <-time.After(10 * time.Second):
		t.Fatal("the server's session was not released")
	}
	require.Eventually(t, func() bool {
		l.acceptedMu.Lock()
		defer l.acceptedMu.Unlock()
		return len(l.accepted) == 0
	}, 10*time.Second, time.Millisecond, "the listener forgets the released session")

	shut := make(chan error, 1)
	go func() { shut <- l.Shutdown(context.Background()) }()
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) while the released session's Closed ran", err)
	case <-time.After(100 * time.Millisecond): // a return within it would be the failure
	}
	release()
	select {
	case err := <-shut:
		require.NoError(t, err)
		require.True(t, closedDone.Load())
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown did not return once the session closed")
	}
}
