package interop_test

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
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

// TestStreamReadAfterRotation: a server stream's last messages wait unread in
// the client's gRPC buffers while the server rotates the connection (the
// stream over, GOAWAY, the gRPC conn closed at both ends). The client reads
// them well after oob.LingerIdle and still pulls their payloads: the client's
// open call asks the server to hold the session (HOLD), and both ends keep
// it until the call ended (RELEASE). Then the session closes soon, not at
// the transfer timeout.
func TestStreamReadAfterRotation(t *testing.T) {
	for _, tc := range transportCases[:2] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			noSessions(t)
			opts := tc.options(t)
			srv := startChild(t, "server", nil, envUCX+"="+tc.ucx, envMaxAge+"=300ms")
			addr := srv.waitLine("ADDR ")
			rec := &dialRecorder{d: dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...)).DialContext}
			cc := dialClient(t, addr, opts, nil, grpc.WithContextDialer(rec.DialContext))
			client := tensorpb.NewTensorServiceClient(cc)
			const n, seed = 256 << 10, 7
			ctx := callCtx(t)
			st, err := client.Download(ctx, &tensorpb.Sized{Size: n, Seed: seed})
			require.NoError(t, err)
			first, err := st.Recv()
			require.NoError(t, err)
			requirePayload(t, first, n, seed)
			gdrcodec.ReleaseAll(first)
			sessions := rec.all()
			require.Len(t, sessions, 1)
			s := sessions[0]

			// The rotation: the channel leaves READY once its connection closed.
			for state := cc.GetState(); state == connectivity.Ready; state = cc.GetState() {
				require.True(t, cc.WaitForStateChange(ctx, state), "the server did not rotate the connection")
			}
			// The application stalls, longer than a session lingers for
			// transfers alone.
			time.Sleep(3 * oob.LingerIdle)
			select {
			case <-s.Done():
				t.Fatalf("the session closed with payloads still owed to the client: %v", s.Err())
			default:
			}
			for i := uint32(1); i < 4; i++ {
				got, err := st.Recv()
				require.NoError(t, err, "message %d", i)
				requirePayload(t, got, n, seed+i)
				gdrcodec.ReleaseAll(got)
			}
			_, err = st.Recv()
			require.ErrorIs(t, err, io.EOF)
			select {
			case <-s.Done():
			case <-time.After(10 * time.Second): // well under the transfer timeout
				t.Fatal("the session outlived its last pull")
			}
			require.NoError(t, cc.Close())
			requireSettled(t)
		})
	}
}
