package gdrcodec_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// An attempt is what failOnce saw of one attempt of a Digest.
type attempt struct {
	retry   bool
	session *transport.Session
	sum     uint32 // of the payload the attempt took; 0 if refused before
}

// How failOnce fails the attempt it is armed for, with Unavailable.
const (
	failCloses  = iota // after it took the payload, closing its session
	failAfter          // after it took the payload
	failRefuses        // before gRPC reads the request (a tap handle)
)

// failOnce records every Digest but the warm-ups, checking each payload it
// is given. While armed, it disarms and fails the attempt as how says: the
// client's retry policy replays the request. Other attempts are served.
type failOnce struct {
	tensor.Server
	how      int
	armed    atomic.Bool
	attempts chan attempt
}

func (f *failOnce) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
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
	if f.how == failRefuses || sess == nil || !f.armed.CompareAndSwap(true, false) {
		return f.Server.Digest(ctx, t)
	}
	gdrcodec.ReleaseAll(t)
	if f.how == failCloses {
		// Close waits for the session's streams, this handler's among
		// them: it runs on its own, and the attempt fails once the
		// session is gone.
		go func() { _ = sess.Close() }()
		<-sess.Done()
	}
	return nil, status.Error(codes.Unavailable, "the first attempt fails on purpose")
}

func (f *failOnce) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	if f.how == failRefuses && info.FullMethodName == "/gdrpc.examples.tensor.TensorService/Digest" && f.armed.CompareAndSwap(true, false) {
		f.attempts <- attempt{session: transport.SessionFromContext(ctx)}
		return nil, status.Error(codes.Unavailable, "refused on purpose")
	}
	return ctx, nil
}

// tapRig serves srv in mode between trusted peers, its calls passed through
// in first, with space bytes of receive space both ways (none if 0).
func tapRig(t *testing.T, mode transport.Mode, srv tensorpb.TensorServiceServer, in tap.ServerInHandle, space int) *rig {
	t.Helper()
	r := newRigWith(t, mode, srv, []grpc.ServerOption{grpc.InTapHandle(in)}, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: space})
	return r
}

// retriedDigest calls Digest with n bytes of seed's pattern, f armed, and
// checks the server's checksum; it returns the two attempts f saw.
func retriedDigest(t *testing.T, c tensorpb.TensorServiceClient, f *failOnce, n int, seed uint32) (first, again attempt) {
	t.Helper()
	req := tensorOf(n, seed)
	f.armed.Store(true)
	sum, err := c.Digest(context.Background(), req, grpc.WaitForReady(true))
	gdrcodec.ReleaseAll(req)
	require.NoError(t, err)
	want := tensor.ChecksumBytes(pattern(n, seed))
	require.Equal(t, uint64(n), sum.Bytes)
	require.Equal(t, want, sum.Crc32C)
	first, again = <-f.attempts, <-f.attempts
	require.False(t, first.retry)
	require.True(t, again.retry)
	if f.how != failRefuses {
		require.Equal(t, want, first.sum, "the first attempt's bytes")
	}
	require.Equal(t, want, again.sum, "the retry's bytes")
	require.NotNil(t, first.session)
	require.NotSame(t, first.session, again.session, "the retry came over another connection")
	return first, again
}

// warmUp calls Digest with a payload f does not record: the pull prompts
// the server's receive space on that connection.
func warmUp(t *testing.T, c tensorpb.TensorServiceClient, n int) {
	t.Helper()
	warm := tensorOf(n, 1)
	warm.Name = "warm-up"
	defer gdrcodec.ReleaseAll(warm)
	_, err := c.Digest(context.Background(), warm, grpc.WaitForReady(true))
	require.NoError(t, err)
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
		paths []map[string]int // the retried call's, the next call's
	}{
		{"transport=tcp", transport.ModeTCP, 0, []map[string]int{{"stream": 2}, {"stream": 1}}},
		{"transport=ucx", transport.ModeUCX, 0, []map[string]int{{"rdma": 2}, {"rdma": 1}}},
		{"transport=ucx/receive-space", transport.ModeUCX, 4 * n, []map[string]int{{"rdma@space": 1, "rdma": 1}, {"rdma@space": 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &failOnce{how: failCloses, attempts: make(chan attempt, 4)}
			r := tapRig(t, tc.mode, f, f.tap, tc.space)
			c := anotherClientIn(t, r, tc.mode, grpc.WithDefaultServiceConfig(retryConfig))
			warmUp(t, c, n)
			if tc.space > 0 {
				waitPeerSpace(t)
			}
			r.paths.reset()

			first, _ := retriedDigest(t, c, f, n, 2)
			require.ErrorIs(t, first.session.Err(), transport.ErrSessionClosed, "the first attempt's session")
			require.Equal(t, tc.paths[0], r.paths.reset(), "one pull by each attempt")

			if tc.space > 0 {
				waitPeerSpaces(t, 1) // the new session's, prompted by the retry's pull
			}
			digestChecked(t, c, n, 3)
			require.Equal(t, tc.paths[1], r.paths.reset(), "the call after the retry")
			require.False(t, (<-f.attempts).retry)
			requireSettled(t, "after the retried call")
		})
	}
}

// gRPC retries a call on another live connection to the same server (round
// robin over two of its listeners), whose first attempt wrote its payload
// into the receive space the server advertised over the first connection:
// the replay names that space's range and comes over the other session.
// Failed after the server took the payload, the replay finds the range given
// back and is pulled by token; refused before gRPC read the request, the
// range is still unclaimed and the replay takes it there. Either way the
// bytes are right, both connections stay up, both spaces serve later calls,
// and no range stays taken.
func TestRetryOnAnotherLiveConnection(t *testing.T) {
	const n = 1 << 20
	for _, tc := range []struct {
		name  string
		how   int
		paths map[string]int // of the retried call
	}{
		{"fail=after-decode", failAfter, map[string]int{"rdma@space": 1, "rdma": 1}},
		{"fail=refused", failRefuses, map[string]int{"rdma@space": 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &failOnce{how: tc.how, attempts: make(chan attempt, 4)}
			r := tapRig(t, transport.ModeUCX, f, f.tap, 4*n)
			c := roundRobinClient(t, r, grpc.WithDefaultServiceConfig(roundRobinRetry))
			warmUpBoth(t, c)
			r.paths.reset()

			first, again := retriedDigest(t, c, f, n, 2)
			require.NoError(t, first.session.Err(), "the first attempt's session")
			require.NoError(t, again.session.Err(), "the retry's session")
			require.Equal(t, tc.paths, r.paths.reset(), "the retried call's pulls")
			waitNothingTaken(t)
			for i := range 4 { // two rounds of the robin: each space serves
				digestChecked(t, c, n, uint32(3+i))
				require.False(t, (<-f.attempts).retry)
			}
			require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset(), "the calls after the retry")
			requireSettled(t, "after the retried call")
		})
	}
}

// roundRobinRetry spreads calls over the resolved addresses, and retries as
// retryConfig does.
var roundRobinRetry = `{"loadBalancingConfig": [{"round_robin": {}}], ` + retryConfig[1:]

// warmUpBoth warms c's calls up until the server advertised its space over
// both of roundRobinClient's connections (round robin takes a connection
// into turn once it is ready).
func warmUpBoth(t *testing.T, c tensorpb.TensorServiceClient) {
	t.Helper()
	for i := 0; oob.ReadStats().PeerSpaces < 2; i++ {
		require.Less(t, i, 100, "the server advertised over %d connections", oob.ReadStats().PeerSpaces)
		warmUp(t, c, 1<<20)
	}
}

// roundRobinClient serves r's server on a second gdrpc listener too (UCX,
// trusted peers) and returns a client that resolves both listeners, with
// opts (a service config that picks round_robin among them).
func roundRobinClient(t *testing.T, r *rig, opts ...grpc.DialOption) tensorpb.TensorServiceClient {
	t.Helper()
	gopts := []gdrpc.Option{gdrpc.WithTransport(transport.ModeUCX), processEngine, gdrpc.WithTrustPeers()}
	lis2, err := listener.Listen("127.0.0.1:0", gopts...)
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- r.server.Serve(lis2) }()
	t.Cleanup(func() {
		r.server.Stop()
		require.NoError(t, <-served)
	})
	res := manual.NewBuilderWithScheme("gdrtest")
	res.InitialState(resolver.State{Addresses: []resolver.Address{{Addr: r.lis.Addr().String()}, {Addr: lis2.Addr().String()}}})
	cc, err := grpc.NewClient("gdrtest:///server", append(dialer.New(gopts...).DialOptions(insecure.NewCredentials()),
		append([]grpc.DialOption{grpc.WithResolvers(res)}, opts...)...)...)
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return tensorpb.NewTensorServiceClient(cc)
}
