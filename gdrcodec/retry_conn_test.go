package gdrcodec_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// An attempt is what dropFirst saw of one attempt of a Digest.
type attempt struct {
	retry   bool
	session *transport.Session
	sum     uint32
}

// dropFirst checks the payload of every Digest but the warm-up's and records
// the attempt. While armed, it disarms, closes the session the attempt came
// over and fails it with Unavailable: the client's retry policy replays the
// request on a new connection. Other attempts are served.
type dropFirst struct {
	tensor.Server
	armed    atomic.Bool
	attempts chan attempt
}

func (f *dropFirst) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	if t.Name == "warm-up" {
		return f.Server.Digest(ctx, t)
	}
	md, _ := metadata.FromIncomingContext(ctx)
	retry := len(md.Get("grpc-previous-rpc-attempts")) > 0
	sess := transport.SessionFromContext(ctx)
	sum, _, err := tensor.Checksum(t, 0)
	if err != nil {
		gdrcodec.ReleaseAll(t)
		return nil, status.Errorf(codes.Internal, "checksum: %v", err)
	}
	f.attempts <- attempt{retry: retry, session: sess, sum: sum}
	if sess == nil || !f.armed.CompareAndSwap(true, false) {
		return f.Server.Digest(ctx, t)
	}
	gdrcodec.ReleaseAll(t)
	// Close waits for the session's streams, this handler's among them:
	// it runs on its own, and the attempt fails once the session is gone.
	go func() { _ = sess.Close() }()
	<-sess.Done()
	return nil, status.Error(codes.Unavailable, "the first attempt's connection is closed on purpose")
}

// gRPC replays a request whose first attempt's connection closed after the
// server took its payload, over a new connection: the replay names the same
// payload, which the client's outbox still holds for the call, and the
// server takes it over the new session, byte-exact. A payload that landed in
// the receive space the server advertised over the old session is pulled by
// token instead, for that space went with its session; the new session's
// space serves the calls after. Nothing is left over.
func TestRetryOnAnotherConnection(t *testing.T) {
	const n = 1 << 20
	for _, tc := range []struct {
		name  string
		mode  transport.Mode
		space int
		paths []map[string]int // the first attempt's, the retry's, the next call's
	}{
		{"transport=tcp", transport.ModeTCP, 0, []map[string]int{{"stream": 1}, {"stream": 1}, {"stream": 1}}},
		{"transport=ucx", transport.ModeUCX, 0, []map[string]int{{"rdma": 1}, {"rdma": 1}, {"rdma": 1}}},
		{"transport=ucx/receive-space", transport.ModeUCX, 4 * n, []map[string]int{{"rdma@space": 1}, {"rdma": 1}, {"rdma@space": 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := &dropFirst{attempts: make(chan attempt, 4)}
			var r *rig
			if tc.space > 0 {
				r = spaceRigServing(t, srv, tc.space)
			} else {
				r = newRig(t, tc.mode, srv, gdrpc.WithTrustPeers())
			}
			c := anotherClientIn(t, r, tc.mode, grpc.WithDefaultServiceConfig(retryConfig))
			// The warm-up's pull prompts the server's space, which the
			// first attempt then writes into.
			warm := tensorOf(n, 1)
			warm.Name = "warm-up"
			_, err := c.Digest(context.Background(), warm, grpc.WaitForReady(true))
			require.NoError(t, err)
			gdrcodec.ReleaseAll(warm)
			if tc.space > 0 {
				waitPeerSpace(t)
			}
			r.paths.reset()

			req := tensorOf(n, 2)
			srv.armed.Store(true)
			sum, err := c.Digest(context.Background(), req, grpc.WaitForReady(true))
			gdrcodec.ReleaseAll(req)
			require.NoError(t, err)
			want := tensor.ChecksumBytes(pattern(n, 2))
			require.Equal(t, uint64(n), sum.Bytes)
			require.Equal(t, want, sum.Crc32C)
			first, again := <-srv.attempts, <-srv.attempts
			require.False(t, first.retry)
			require.True(t, again.retry)
			require.Equal(t, want, first.sum, "the first attempt's bytes")
			require.Equal(t, want, again.sum, "the retry's bytes")
			require.NotNil(t, first.session)
			require.NotSame(t, first.session, again.session, "the retry came over another connection")
			require.ErrorIs(t, first.session.Err(), transport.ErrSessionClosed, "the first attempt's session")
			got := r.paths.reset()
			require.Equal(t, sumPaths(tc.paths[0], tc.paths[1]), got, "one pull by each attempt")

			if tc.space > 0 {
				waitPeerSpaces(t, 1) // the new session's, prompted by the retry's pull
			}
			req = tensorOf(n, 3)
			sum, err = c.Digest(context.Background(), req)
			gdrcodec.ReleaseAll(req)
			require.NoError(t, err)
			require.Equal(t, tensor.ChecksumBytes(pattern(n, 3)), sum.Crc32C)
			require.Equal(t, tc.paths[2], r.paths.reset(), "the call after the retry")
			again = <-srv.attempts
			require.False(t, again.retry)
			requireSettled(t, "after the retried call")
		})
	}
}

// sumPaths adds path counts.
func sumPaths(ms ...map[string]int) map[string]int {
	sum := map[string]int{}
	for _, m := range ms {
		for k, v := range m {
			sum[k] += v
		}
	}
	return sum
}
