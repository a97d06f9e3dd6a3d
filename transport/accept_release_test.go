package transport

import (
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
