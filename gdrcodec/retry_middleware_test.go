package gdrcodec_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// attemptTimeout is an application's retry middleware with a per-attempt
// timeout (as go-grpc-middleware's retry.WithPerRetryTimeout), chained
// after gdrpc's interceptor: an attempt whose own context ended while the
// call's did not is tried again, with the same reply. Here the first
// attempt's context is cut (cut) as its response's headers arrive, before
// its response message is read: a timeout that fires right then.
type attemptTimeout struct {
	on       atomic.Bool
	mu       sync.Mutex
	cut      context.CancelFunc // the first attempt's, while it runs
	returned chan struct{}      // closed once the first attempt returned
	cuts     atomic.Int32
}

func (a *attemptTimeout) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if !a.on.Load() {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	first, cancel := context.WithCancel(metadata.AppendToOutgoingContext(ctx, "attempt", "0"))
	returned := make(chan struct{})
	a.mu.Lock()
	a.cut, a.returned = cancel, returned
	a.mu.Unlock()
	err := invoker(first, method, req, reply, cc, opts...)
	close(returned)
	cancel()
	if err == nil || ctx.Err() != nil || first.Err() == nil {
		return err
	}
	return invoker(ctx, method, req, reply, cc, opts...) // the retry
}

func (*attemptTimeout) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (*attemptTimeout) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (*attemptTimeout) HandleConn(context.Context, stats.ConnStats) {}

// HandleRPC cuts the first attempt as its response's headers arrive (gRPC's
// reader then reads its message only once the attempt returned).
func (a *attemptTimeout) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.InHeader); !ok {
		return
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	if v := md.Get("attempt"); len(v) == 0 || v[0] != "0" {
		return
	}
	a.mu.Lock()
	cut, returned := a.cut, a.returned
	a.mu.Unlock()
	a.cuts.Add(1)
	cut()
	<-returned
}

// An application's retry middleware inside gdrpc's interceptor (the README
// lets a unary one run there: TestRequestSpaceMarshaledTwice) retries an
// attempt that timed out as its response arrived: the server had written
// the response's payload into the client's receive space over the first
// connection, and the attempt never decoded it. The retry succeeds on the
// other connection. The client must tell the first connection's server
// that the call ended (CALL-ENDED) so it takes back its write; otherwise
// the range stays taken until the session ends, and enough such calls fill
// the space.
func TestRetryMiddlewareAfterAnsweredAttempt(t *testing.T) {
	const mib = 1 << 20
	mw := &attemptTimeout{}
	r := newRig(t, transport.ModeUCX, nil, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: 4 * mib})
	c := roundRobinClient(t, r, grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`),
		grpc.WithChainUnaryInterceptor(mw.intercept), grpc.WithStatsHandler(mw))
	echo := func(seed uint32) {
		t.Helper()
		req := tensorOf(mib, seed)
		defer gdrcodec.ReleaseAll(req)
		got, err := c.Echo(context.Background(), req)
		require.NoError(t, err)
		b, err := tensor.Bytes(got.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(mib, seed), b)
		gdrcodec.ReleaseAll(got)
	}
	// Until both ends advertised their spaces over both connections.
	for i := 0; oob.ReadStats().PeerSpaces < 4; i++ {
		require.Less(t, i, 100, "%+v", oob.ReadStats())
		echo(1)
	}
	requireSettled(t, "after the warm-ups")
	r.paths.reset()

	mw.on.Store(true)
	echo(2)
	mw.on.Store(false)
	require.Equal(t, int32(1), mw.cuts.Load(), "the first attempt was cut as its headers came")
	requireSettled(t, "after a call whose first attempt was cut")
}
