package oob

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// A client whose calls end faster than the server takes their CALL-ENDEDs
// (here: the server's control handlers held, its window small) keeps them
// in one queue per session, sent by one goroutine, not a goroutine each
// waiting on the control stream; once the server takes them again, every
// one arrives.
func TestCallEndsQueued(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // however the test ends
	var got atomic.Int64
	interceptControl(t, ctlCallEnded, func(*transport.Session, []byte) bool {
		<-release
		got.Add(1)
		return true
	})
	client, _ := pipePair(t, transport.WithWindow(256<<10))
	before := runtime.NumGoroutine()
	const calls = 20000 // more than the window holds
	for range calls {
		NewCall().Ended(client, true)
	}
	g := runtime.NumGoroutine() - before
	t.Logf("%d goroutines more with %d CALL-ENDEDs on their way", g, calls)
	// The server's held handlers, each with the hook's goroutine, and the
	// client's one sender.
	require.LessOrEqual(t, g, 2*transport.MaxControlHandlers+8, "goroutines for CALL-ENDEDs on their way")
	once.Do(func() { close(release) })
	require.Eventually(t, func() bool { return got.Load() == calls }, testTimeout, time.Millisecond, "%d of %d CALL-ENDEDs arrived", got.Load(), calls)
}
