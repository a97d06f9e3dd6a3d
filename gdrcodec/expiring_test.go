package gdrcodec

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// An entry nobody took goes to expired when a sweep finds it older than
// maxAge; a taken one does not, nor a younger one; a put that replaces an
// entry gives the old one up.
func TestExpiringGivesUpEntries(t *testing.T) {
	var gone []int
	e := newExpiring[int](time.Minute)
	e.expired = func(v int) { gone = append(gone, v) }
	e.put("a", 1)
	e.put("b", 2)
	e.put("d", 5)
	e.mu.Lock()
	e.m["a"] = expiringEntry[int]{v: 1, at: time.Now().Add(-time.Hour)}
	e.mu.Unlock()
	v, ok := e.take("b")
	require.True(t, ok)
	require.Equal(t, 2, v)
	e.sweep()
	require.Equal(t, []int{1}, gone)
	_, ok = e.take("a")
	require.False(t, ok)
	e.put("c", 3)
	e.put("c", 4) // replaces 3, which nobody takes now
	require.Equal(t, []int{1, 3}, gone)
	require.False(t, e.putNew("c", 6), "a young entry stays")
	v, ok = e.take("d")
	require.True(t, ok)
	require.Equal(t, 5, v)
	e.mu.Lock()
	e.sweeper.Stop()
	e.mu.Unlock()
}

// Entries nobody takes are given up with no later put, and the sweeper
// stops once the map is empty.
func TestExpiringSweepsWhileIdle(t *testing.T) {
	var mu sync.Mutex
	var gone []int
	e := newExpiring[int](20 * time.Millisecond)
	e.expired = func(v int) {
		mu.Lock()
		defer mu.Unlock()
		gone = append(gone, v)
	}
	e.put("a", 1)
	e.put("b", 2)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(gone) == 2
	}, 10*time.Second, time.Millisecond, "given up with no put after them")
	require.ElementsMatch(t, []int{1, 2}, gone)
	e.mu.Lock()
	defer e.mu.Unlock()
	require.Empty(t, e.m)
	require.Nil(t, e.sweeper, "no sweep is armed for an empty map")
	require.Zero(t, e.n.Load())
}
