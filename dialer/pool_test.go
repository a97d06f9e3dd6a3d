package dialer_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/transport"
)

// gateService echoes like testService, but each unary call first reports
// the session it came over and waits for the test to let it go: a call of
// its own (the channel it reports) or all of them (release closed).
type gateService struct {
	testService
	arrived chan arrival
	release chan struct{}
}

type arrival struct {
	session *transport.Session
	release chan struct{}
}

func newGate() *gateService {
	return &gateService{arrived: make(chan arrival), release: make(chan struct{})}
}

func (g *gateService) UnaryCall(ctx context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	p, _ := peer.FromContext(ctx)
	a := arrival{gdrpc.SessionFromPeer(p), make(chan struct{})}
	select {
	case g.arrived <- a:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case <-a.release:
	case <-g.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &testpb.SimpleResponse{Payload: req.GetPayload()}, nil
}

// servePool starts svc over tc and returns a pool of n connections to it.
func servePool(t *testing.T, tc transportCase, svc testpb.TestServiceServer, n int) *dialer.Pool {
	t.Helper()
	addr, dopts := start(t, tc, svc)
	pool, err := dialer.NewPool("passthrough:///"+addr, n, dopts...)
	require.NoError(t, err)
	require.Len(t, pool.Conns(), n)
	t.Cleanup(func() { _ = pool.Close() })
	return pool
}

// Calls in flight at once go over different connections, each a session of
// its own; a call goes where the fewest are in flight, whichever connection's
// turn it is; the counts go back to zero when the calls end, and every call's
// bytes come back.
func TestPoolSpreadsCalls(t *testing.T) {
	for _, tc := range []transportCase{transportCases[0], transportCases[2]} {
		t.Run(tc.name, func(t *testing.T) {
			gs := newGate()
			pool := servePool(t, tc, gs, 3)
			c := testpb.NewTestServiceClient(pool)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()

			type reply struct {
				i    int
				body []byte
				err  error
			}
			replies := make(chan reply, 5)
			call := func(i int) arrival {
				go func() {
					resp, err := c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: &testpb.Payload{Body: pattern(1<<20 + i)}})
					replies <- reply{i, resp.GetPayload().GetBody(), err}
				}()
				// The call is in its handler before the test goes on, so the
				// pool counted it where it went.
				a := <-gs.arrived
				require.NotNil(t, a.session, "call %d: no gdrpc session", i)
				require.Equal(t, tc.want(), a.session.Transport())
				return a
			}
			check := func(r reply) {
				require.NoError(t, r.err)
				require.True(t, bytes.Equal(pattern(1<<20+r.i), r.body), "call %d: payload differs", r.i)
			}
			var first []arrival
			sessions := map[*transport.Session]bool{}
			for i := range 3 {
				a := call(i)
				require.False(t, sessions[a.session], "call %d went over a busy connection's session", i)
				sessions[a.session] = true
				first = append(first, a)
			}
			require.Equal(t, []int64{1, 1, 1}, pool.Busy())
			// The second call ends: the next goes over its connection, the
			// one idle, not the one whose turn it is (the first call's).
			close(first[1].release)
			r := <-replies
			require.Equal(t, 1, r.i)
			check(r)
			require.True(t, first[1].session == call(3).session, "the call went over a busy connection")
			require.Equal(t, []int64{1, 1, 1}, pool.Busy())
			// All busy alike: any connection, counted.
			call(4)
			require.ElementsMatch(t, []int64{1, 1, 2}, pool.Busy())
			close(gs.release)
			for range 4 {
				check(<-replies)
			}
			require.Equal(t, []int64{0, 0, 0}, pool.Busy())
		})
	}
}

// A stream counts on its connection until it ends: read to its end, failed,
// or its context cancelled; a stream that could not start counts nowhere.
func TestPoolStreams(t *testing.T) {
	gs := newGate()
	close(gs.release)
	pool := servePool(t, transportCases[2], gs, 2)
	c := testpb.NewTestServiceClient(pool)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	busy := func() int64 {
		var n int64
		for _, b := range pool.Busy() {
			n += b
		}
		return n
	}

	// Read to its end.
	st, err := c.FullDuplexCall(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), busy())
	body := pattern(100 << 10)
	require.NoError(t, st.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: body}}))
	m, err := st.Recv()
	require.NoError(t, err)
	require.True(t, bytes.Equal(body, m.GetPayload().GetBody()))
	// A unary call meanwhile takes the other connection.
	done := make(chan error, 1)
	go func() {
		_, err := c.UnaryCall(ctx, &testpb.SimpleRequest{})
		done <- err
	}()
	<-gs.arrived
	require.Equal(t, []int64{1, 1}, pool.Busy())
	require.NoError(t, <-done)
	require.NoError(t, st.CloseSend())
	_, err = st.Recv()
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, int64(0), busy())

	// Cancelled, never read again: the context's watch gives the count back.
	sctx, scancel := context.WithCancel(ctx)
	st, err = c.FullDuplexCall(sctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), busy())
	scancel()
	require.Eventually(t, func() bool { return busy() == 0 }, testTimeout, time.Millisecond)
	_, err = st.Recv()
	require.Equal(t, codes.Canceled, status.Code(err))
	require.Equal(t, int64(0), busy())

	// A context done before the stream opens.
	dead, dcancel := context.WithCancel(ctx)
	dcancel()
	_, err = c.FullDuplexCall(dead)
	require.Equal(t, codes.Canceled, status.Code(err))
	require.Eventually(t, func() bool { return busy() == 0 }, testTimeout, time.Millisecond)
}

// A pool wants at least one connection; after Close its calls fail.
func TestPoolClose(t *testing.T) {
	_, err := dialer.NewPool("passthrough:///127.0.0.1:1", 0)
	require.ErrorContains(t, err, "want at least 1")
	_, err = dialer.NewPool("passthrough:///127.0.0.1:1", 2) // no credentials: grpc.NewClient refuses
	require.Error(t, err)

	pool := servePool(t, transportCases[2], testService{}, 2)
	c := testpb.NewTestServiceClient(pool)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for range 4 {
		_, err := c.EmptyCall(ctx, &testpb.Empty{})
		require.NoError(t, err)
	}
	require.NoError(t, pool.Conns()[0].Close()) // closed through Conns first
	require.NoError(t, pool.Close())
	require.NoError(t, pool.Close(), "a second Close")
	_, err = c.EmptyCall(ctx, &testpb.Empty{})
	require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	require.Equal(t, []int64{0, 0}, pool.Busy())

	var zero dialer.Pool
	err = zero.Invoke(ctx, "/grpc.testing.TestService/EmptyCall", &testpb.Empty{}, &testpb.Empty{})
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	_, err = zero.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, "/grpc.testing.TestService/StreamingOutputCall")
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.NoError(t, zero.Close())
}

// Calls one after another on an idle pool go over its connections in turn.
func TestPoolTurns(t *testing.T) {
	pool := servePool(t, transportCases[2], testService{}, 3)
	c := testpb.NewTestServiceClient(pool)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	var order []*transport.Session
	for range 6 {
		var p peer.Peer
		_, err := c.EmptyCall(ctx, &testpb.Empty{}, grpc.Peer(&p))
		require.NoError(t, err)
		order = append(order, gdrpc.SessionFromPeer(&p))
	}
	require.True(t, order[0] != order[1] && order[1] != order[2] && order[0] != order[2], "three calls, three connections")
	require.True(t, order[0] == order[3] && order[1] == order[4] && order[2] == order[5], "then the same turn again")
}

// Every way gRPC ends a stream gives its count back: a client stream's
// CloseAndRecv, a server stream read to its end, a SendMsg gRPC refused.
func TestPoolStreamEnds(t *testing.T) {
	pool := servePool(t, transportCases[2], testService{}, 2)
	c := testpb.NewTestServiceClient(pool)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	in, err := c.StreamingInputCall(ctx)
	require.NoError(t, err)
	require.Equal(t, []int64{1, 0}, sorted(pool.Busy()))
	for range 3 {
		require.NoError(t, in.Send(&testpb.StreamingInputCallRequest{Payload: &testpb.Payload{Body: pattern(10 << 10)}}))
	}
	resp, err := in.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, int32(30<<10), resp.GetAggregatedPayloadSize())
	require.Equal(t, []int64{0, 0}, pool.Busy(), "after CloseAndRecv")

	out, err := c.StreamingOutputCall(ctx, &testpb.StreamingOutputCallRequest{
		ResponseParameters: []*testpb.ResponseParameters{{Size: 1 << 20}, {Size: 5}}})
	require.NoError(t, err)
	require.Equal(t, []int64{1, 0}, sorted(pool.Busy()))
	for _, n := range []int{1 << 20, 5} {
		m, err := out.Recv()
		require.NoError(t, err)
		require.Len(t, m.GetPayload().GetBody(), n)
	}
	_, err = out.Recv()
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, []int64{0, 0}, pool.Busy(), "after a server stream's end")

	requireRefusedSendEnds(ctx, t, c, pool)
}

// A stream counts until it ends even when an interceptor drops the pool's
// grpc.OnFinish: a client stream's CloseAndRecv, a refused SendMsg.
func TestPoolStreamEndsWithoutOnFinish(t *testing.T) {
	addr, dopts := start(t, transportCases[2], testService{})
	drop := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		opts = slices.DeleteFunc(slices.Clone(opts), func(o grpc.CallOption) bool {
			_, finish := o.(grpc.OnFinishCallOption)
			return finish
		})
		return streamer(ctx, desc, cc, method, opts...)
	})
	pool, err := dialer.NewPool("passthrough:///"+addr, 2, append([]grpc.DialOption{drop}, dopts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pool.Close() })
	c := testpb.NewTestServiceClient(pool)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	in, err := c.StreamingInputCall(ctx)
	require.NoError(t, err)
	require.NoError(t, in.Send(&testpb.StreamingInputCallRequest{Payload: &testpb.Payload{Body: pattern(10)}}))
	resp, err := in.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, int32(10), resp.GetAggregatedPayloadSize())
	require.Equal(t, []int64{0, 0}, pool.Busy(), "after CloseAndRecv")

	requireRefusedSendEnds(ctx, t, c, pool)
}

// A connection closed or failing to connect takes no calls while another
// can: both fail calls at once, so they would look the least busy.
func TestPoolPassesOverBrokenConns(t *testing.T) {
	t.Run("closed", func(t *testing.T) {
		pool := servePool(t, transportCases[2], testService{}, 3)
		c := testpb.NewTestServiceClient(pool)
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		require.NoError(t, pool.Conns()[1].Close())
		calls := map[*transport.Session]int{}
		for i := range 10 {
			var p peer.Peer
			_, err := c.EmptyCall(ctx, &testpb.Empty{}, grpc.Peer(&p))
			require.NoError(t, err, "call %d", i)
			calls[gdrpc.SessionFromPeer(&p)]++
		}
		require.Len(t, calls, 2)
		for s, n := range calls {
			require.Equal(t, 5, n, "calls over session %v: the two left take turns", s)
		}
		require.NoError(t, pool.Conns()[0].Close())
		require.NoError(t, pool.Conns()[2].Close())
		_, err := c.EmptyCall(ctx, &testpb.Empty{})
		require.Equal(t, codes.Canceled, status.Code(err), "all closed: %v", err)
		require.Equal(t, []int64{0, 0, 0}, pool.Busy())
	})
	t.Run("transient failure", func(t *testing.T) {
		addr, dopts := start(t, transportCases[2], testService{})
		d := dialer.New(gdrpc.WithSessionOptions(transportCases[2].options(t)...))
		var refuse atomic.Bool
		dopts = append(dopts,
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
				if refuse.Load() {
					return nil, errors.New("refused by the test")
				}
				return d.DialContext(ctx, a)
			}),
			// The failed connection stays in TRANSIENT_FAILURE for the test.
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: time.Minute, Multiplier: 1, MaxDelay: time.Minute}, MinConnectTimeout: time.Second}))
		pool, err := dialer.NewPool("passthrough:///"+addr, 2, dopts...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = pool.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		refuse.Store(true)
		bad := pool.Conns()[0]
		bad.Connect()
		for st := bad.GetState(); st != connectivity.TransientFailure; st = bad.GetState() {
			require.True(t, bad.WaitForStateChange(ctx, st), "the connection did not fail")
		}
		refuse.Store(false)
		c := testpb.NewTestServiceClient(pool)
		for i := range 6 {
			_, err := c.EmptyCall(ctx, &testpb.Empty{})
			require.NoError(t, err, "call %d", i)
		}
		require.Equal(t, connectivity.TransientFailure, bad.GetState())
		require.Equal(t, []int64{0, 0}, pool.Busy())
	})
}

// requireRefusedSendEnds opens a client stream whose first message gRPC
// refuses (over its send limit): the refusal ends the stream, and the pool's
// counts of pool's two connections are back at zero.
func requireRefusedSendEnds(ctx context.Context, t *testing.T, c testpb.TestServiceClient, pool *dialer.Pool) {
	t.Helper()
	in, err := c.StreamingInputCall(ctx, grpc.MaxCallSendMsgSize(16))
	require.NoError(t, err)
	err = in.Send(&testpb.StreamingInputCallRequest{Payload: &testpb.Payload{Body: pattern(1024)}})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Equal(t, []int64{0, 0}, pool.Busy(), "after a refused SendMsg")
}

// sorted returns the counts from the largest down.
func sorted(b []int64) []int64 {
	slices.Sort(b)
	slices.Reverse(b)
	return b
}
