//go:build cgo && !nordma

package rdma_test

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// TestDriverParksInGoPoller checks that an idle driver waits in Go's poller
// (its goroutine in IO wait, holding no thread or P) rather than in a C call,
// and that messages wake it: every round trip between two workers whose
// drivers never poll goes through a park and a wake-up on both sides.
func TestDriverParksInGoPoller(t *testing.T) {
	requireUCX(t)
	c, err := rdma.NewContext(rdma.WithPollTime(0))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	client, server := pair(t, c)

	msg, back := make([]byte, 64), make([]byte, 64)
	for i := range 300 {
		copy(msg, pattern(len(msg), uint64(i)))
		_, err := client.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(server, back)
		require.NoError(t, err)
		_, err = server.Write(back)
		require.NoError(t, err)
		_, err = io.ReadFull(client, back)
		require.NoError(t, err)
		require.Equal(t, msg, back, "round trip %d", i)
	}

	w := c.Worker()
	require.Eventually(t, w.Parked, 10*time.Second, time.Millisecond, "the driver parks when idle")
	drivers := leaktest.Goroutines("rdma.(*Worker).run(")
	require.NotEmpty(t, drivers)
	parked := 0
	for _, g := range drivers {
		require.NotContains(t, g, "_Cfunc_rdma_worker_wait", "a driver waits in C:\n%s", g)
		if strings.Contains(g, "[IO wait") && strings.Contains(g, "rdma.(*Worker).park(") {
			parked++
		}
	}
	require.NotZero(t, parked, "no driver waits in Go's poller:\n%s", strings.Join(drivers, "\n\n"))
}
