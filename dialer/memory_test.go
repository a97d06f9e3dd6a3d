package dialer_test

import (
	"context"
	"runtime"
	"testing"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	testpb "google.golang.org/grpc/interop/grpc_testing"
)

// idleHeap returns the heap that n connections to tc's server hold, both
// ends, per connection, once each made a call and went idle.
func idleHeap(t *testing.T, tc transportCase, n int) uint64 {
	t.Helper()
	addr, dopts := start(t, tc, testService{})
	// Twice: buffers pooled by earlier tests stay one collection longer
	// (sync.Pool's victim cache), and would leave between the readings.
	settled := func(ms *runtime.MemStats) {
		runtime.GC()
		runtime.GC()
		runtime.ReadMemStats(ms)
	}
	var before, after runtime.MemStats
	settled(&before)
	for range n {
		cc, err := grpc.NewClient("passthrough:///"+addr, dopts...)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, cc.Close()) })
		_, err = testpb.NewTestServiceClient(cc).UnaryCall(context.Background(), &testpb.SimpleRequest{})
		require.NoError(t, err)
	}
	settled(&after)
	require.GreaterOrEqual(t, after.HeapInuse, before.HeapInuse, "the heap shrank while connections were made: the reading is void")
	return (after.HeapInuse - before.HeapInuse) / uint64(n)
}

// An idle connection over a TCP session (the default between untrusted
// peers) holds no large buffers: a server's connections to many clients
// cost it little more than plain gRPC's. An idle connection held, its two
// ends together, 562 KiB with gRPC's read buffer at 256 KiB, 113-143 KiB at
// 32 KiB, and 67-74 KiB now that gRPC reads its lane only once it is
// readable (ReadOnReady), as it reads a plain TCP connection (plain gRPC:
// 36-55 KiB).
func TestIdleConnectionHeap(t *testing.T) {
	const n = 50
	plain := idleHeap(t, plainCase, n)
	session := idleHeap(t, transportCases[2], n)
	t.Logf("heap per idle connection, both ends: plain gRPC %d KiB, gdrpc over a TCP session %d KiB", plain>>10, session>>10)
	require.Less(t, session, uint64(100<<10), "an idle gdrpc connection holds %d KiB", session>>10)
}

// The same over UCX shared memory, whose session holds four endpoints on
// each end, each with its inbound ring: 1,060 KiB with gRPC's read buffer
// and the rings as they were, 690 KiB with 64 KiB rings, 385-434 KiB now.
func TestIdleConnectionHeapUCX(t *testing.T) {
	testenv.Need(t, "ucx", rdma.Available())
	session := idleHeap(t, transportCases[0], 50)
	t.Logf("heap per idle connection, both ends: gdrpc over UCX shared memory %d KiB", session>>10)
	require.Less(t, session, uint64(520<<10), "an idle gdrpc connection over UCX holds %d KiB", session>>10)
}
