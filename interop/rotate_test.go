package interop_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// TestConnectionRotation: the server ends every connection after a short
// age (GOAWAY, then a grace period), so the client keeps dialing new gdrpc
// sessions while calls with out-of-band payloads in both directions run; every
// call succeeds byte-exact, and the old sessions go away.
func TestConnectionRotation(t *testing.T) {
	for _, tc := range transportCases[:3] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			noSessions(t)
			opts := tc.options(t)
			paths := countPaths(t)
			// The server runs in another process: in this one, a pull with no
			// live session to the owner would be served from the local outbox.
			srv := startChild(t, "server", nil, envUCX+"="+tc.ucx, envMaxAge+"=200ms")
			addr := srv.waitLine("ADDR ")
			rec := &dialRecorder{d: dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...)).DialContext}
			cc := dialClient(t, addr, opts, nil, grpc.WithContextDialer(rec.DialContext))
			client := tensorpb.NewTensorServiceClient(cc)
			const n = 256 << 10
			calls := 0
			for start := time.Now(); time.Since(start) < 1500*time.Millisecond || len(rec.all()) < 3; calls++ {
				require.Less(t, time.Since(start), testTimeout, "the server did not rotate connections")
				seed := uint32(calls)
				got, err := client.Make(callCtx(t), &tensorpb.Sized{Size: n, Seed: seed}, grpc.WaitForReady(true))
				require.NoError(t, err, "call %d", calls)
				requirePayload(t, got, n, seed)
				gdrcodec.ReleaseAll(got)

				p := pattern(n, seed+1)
				src := devicebuf.HostFromBytes(p)
				req := &tensorpb.Tensor{Data: gdrcodec.New(src)}
				src.Release()
				sum, err := client.Digest(callCtx(t), req, grpc.WaitForReady(true))
				gdrcodec.ReleaseAll(req)
				require.NoError(t, err, "call %d", calls)
				require.Equal(t, tensor.ChecksumBytes(p), sum.Crc32C)
			}
			sessions := rec.all()
			t.Logf("%d round trips over %d sessions", calls, len(sessions))
			require.Equal(t, calls, paths.reset()[map[string]string{"ucx": "rdma", "tcp": "stream"}[tc.want()]], "one pull per Make")
			require.Empty(t, paths.failures())
			for _, s := range sessions[:len(sessions)-1] {
				select {
				case <-s.Done():
				case <-time.After(testTimeout):
					t.Fatalf("session %d outlived its connection's rotation", s.ID())
				}
			}
			require.NoError(t, cc.Close())
			requireSettled(t)
			require.Zero(t, transport.ReadStats().Sessions)
		})
	}
}
