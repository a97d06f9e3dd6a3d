package transport

import (
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCloseJoinsLinger: Close returns only once the handler's Linger, which
// an orderly close (the gRPC stream's Close) runs on a goroutine of its own,
// returned, and calls the handler's Join after it: the handler's methods
// run on goroutines that Close joins.
func TestCloseJoinsLinger(t *testing.T) {
	_, cs, _, cc, _ := lanePair(t, nil, nil)
	var lingered, joinedEarly atomic.Bool
	var lingers atomic.Int32
	started := make(chan struct{})
	setHook(t, &testHooks.linger, func(s *Session) {
		if s != cs {
			return
		}
		if lingers.Add(1) == 1 {
			close(started)
		}
		<-s.Done()
		<-s.Released()
		// Time enough for a Close that does not wait for Linger to reach
		// Join: both goroutines wake as the connection is released.
		for range 1000 {
			runtime.Gosched()
		}
		lingered.Store(true)
	})
	setHook(t, &testHooks.join, func(s *Session) {
		if s == cs && !lingered.Load() {
			joinedEarly.Store(true)
		}
	})
	require.NoError(t, cc.Close()) // the gRPC stream: an orderly close begins
	cs.closeGracefully()           // a second one starts nothing
	<-started
	require.NoError(t, cs.Close())
	require.True(t, lingered.Load(), "Close returned before the handler's Linger did")
	require.False(t, joinedEarly.Load(), "Join ran before Linger returned")
	require.Equal(t, int32(1), lingers.Load(), "Linger ran once")
}
