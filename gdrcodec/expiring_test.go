package gdrcodec

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// An entry nobody took goes to expired when a later put sweeps it; a taken
// one does not.
func TestExpiringGivesUpEntries(t *testing.T) {
	var gone []int
	e := newExpiring[int](time.Minute)
	e.expired = func(v int) { gone = append(gone, v) }
	e.put("a", 1)
	e.put("b", 2)
	e.m["a"] = expiringEntry[int]{v: 1, at: time.Now().Add(-time.Hour)}
	v, ok := e.take("b")
	require.True(t, ok)
	require.Equal(t, 2, v)
	e.swept = e.swept.AddDate(-1, 0, 0) // the next put sweeps
	e.put("c", 3)
	require.Equal(t, []int{1}, gone)
	_, ok = e.take("a")
	require.False(t, ok)
	e.put("c", 4) // replaces 3, which nobody takes now
	require.Equal(t, []int{1, 3}, gone)
}
