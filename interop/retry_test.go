package interop_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
)

// retryConfig retries TensorService calls that fail with UNAVAILABLE.
const retryConfig = `{"methodConfig": [{
  "name": [{"service": "gdrpc.examples.tensor.TensorService"}],
  "retryPolicy": {
    "maxAttempts": 3,
    "initialBackoff": "0.01s",
    "maxBackoff": "0.05s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"]
  }
}]}`

// failFirstAttempt fails the first attempt of every call with Unavailable,
// after the request was decoded (its out-of-band payloads pulled), and records
// the checksum each attempt saw.
type failFirstAttempt struct {
	mu       sync.Mutex
	attempts []string // "first crc=..." / "retry crc=..."
}

func (f *failFirstAttempt) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	first := len(md.Get("grpc-previous-rpc-attempts")) == 0
	crc, n, err := tensor.Checksum(req.(*tensorpb.Tensor), 0)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "checksum: %v", err)
	}
	f.mu.Lock()
	f.attempts = append(f.attempts, fmt.Sprintf("first=%v bytes=%d crc=%08x", first, n, crc))
	f.mu.Unlock()
	if first {
		return nil, status.Error(codes.Unavailable, "the first attempt fails on purpose")
	}
	return handler(ctx, req)
}

func (f *failFirstAttempt) take() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	a := f.attempts
	f.attempts = nil
	return a
}

// TestRetryReplaysOutOfBand: with a retry policy, the first attempt of a call
// whose request carries out-of-band payloads fails after the server pulled
// them; gRPC replays the same marshaled request (the same descriptors) and the
// server pulls the payloads again and checksums correct data.
func TestRetryReplaysOutOfBand(t *testing.T) {
	for _, tc := range transportCases[:3] { // tcp, ucx-shm, ucx-tcp
		t.Run("transport="+tc.name, func(t *testing.T) {
			opts := tc.options(t)
			paths := countPaths(t)
			ff := &failFirstAttempt{}
			srv := startServer(t, opts, nil, bothServices, grpc.ChainUnaryInterceptor(ff.intercept))
			cc := dialClient(t, srv.addr, opts, nil, grpc.WithDefaultServiceConfig(retryConfig))
			client := tensorpb.NewTensorServiceClient(cc)
			wantPath := map[string]string{"ucx": "rdma", "tcp": "stream"}[tc.want()]
			sizes := []int{gdrcodec.StreamEagerThreshold, 1<<20 + 3} // out-of-band over every session
			if !testing.Short() {
				sizes = append(sizes, 16<<20)
			}
			for _, n := range sizes {
				t.Run(fmt.Sprintf("size=%d", n), func(t *testing.T) {
					data, blob := pattern(n, 1), pattern(n+1, 2)
					src := devicebuf.HostFromBytes(data)
					req := &tensorpb.Tensor{Name: "retried", Data: gdrcodec.New(src), Blob: blob}
					src.Release()
					defer gdrcodec.ReleaseAll(req)
					sum, err := client.Digest(callCtx(t), req)
					require.NoError(t, err)
					want := tensor.ChecksumBytes(data)
					want = crc32cUpdate(want, blob)
					require.Equal(t, uint64(2*n+1), sum.Bytes)
					require.Equal(t, want, sum.Crc32C)
					line := fmt.Sprintf("bytes=%d crc=%08x", 2*n+1, want)
					require.Equal(t, []string{"first=true " + line, "first=false " + line}, ff.take(),
						"two attempts, each with the right payloads")
					require.Equal(t, map[string]int{wantPath: 4}, paths.reset(), "two payloads pulled by each attempt")
					require.Empty(t, paths.failures())
				})
			}
		})
	}
}
