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
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ccs := make([]*grpc.ClientConn, 0, n)
	for range n {
		cc, err := grpc.NewClient("passthrough:///"+addr, dopts...)
		require.NoError(t, err)
		_, err = testpb.NewTestServiceClient(cc).UnaryCall(context.Background(), &testpb.SimpleRequest{})
		require.NoError(t, err)
		ccs = append(ccs, cc)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	for _, cc := range ccs {
		require.NoError(t, cc.Close())
	}
	if after.HeapInuse < before.HeapInuse {
		return 0
	}
	return (after.HeapInuse - before.HeapInuse) / uint64(n)
}

// An idle connection over a TCP session (the default between untrusted
// peers) holds no large buffers: a server's connections to many clients
// cost it little more than plain gRPC's. gRPC keeps its read buffer for a
// connection's life; at 256 KiB a connection held 562 KiB, its two ends
// together, against plain gRPC's 38.
func TestIdleConnectionHeap(t *testing.T) {
	const n = 50
	plain := idleHeap(t, plainCase, n)
	session := idleHeap(t, transportCases[2], n)
	t.Logf("heap per idle connection, both ends: plain gRPC %d KiB, gdrpc over a TCP session %d KiB", plain>>10, session>>10)
	require.Less(t, session, uint64(300<<10), "an idle gdrpc connection holds %d KiB", session>>10)
}

// The same over UCX shared memory, whose session holds four endpoints on
// each end, each with its inbound ring: 1,060 KiB with gRPC's read buffer
// and the rings as they were, 395-434 KiB now.
func TestIdleConnectionHeapUCX(t *testing.T) {
	testenv.Need(t, "ucx", rdma.Available())
	session := idleHeap(t, transportCases[0], 50)
	t.Logf("heap per idle connection, both ends: gdrpc over UCX shared memory %d KiB", session>>10)
	require.Less(t, session, uint64(700<<10), "an idle gdrpc connection over UCX holds %d KiB", session>>10)
}
