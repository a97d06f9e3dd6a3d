package gdrcodec_test

import (
	"context"
	"fmt"
	"hash/crc32"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// hookServer serves TensorService, its Digest and Upload through the hooks
// where set (warm-ups always by the example's).
type hookServer struct {
	tensor.Server
	digest func(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error)
	upload func(st tensorpb.TensorService_UploadServer) error
	tap    func(ctx context.Context, info *tap.Info) (context.Context, error)
}

func (h *hookServer) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	if h.digest == nil || t.Name == "warm-up" {
		return h.Server.Digest(ctx, t)
	}
	return h.digest(ctx, t)
}

func (h *hookServer) Upload(st tensorpb.TensorService_UploadServer) error {
	if h.upload == nil {
		return h.Server.Upload(st)
	}
	return h.upload(st)
}

func (h *hookServer) tapHandle(ctx context.Context, info *tap.Info) (context.Context, error) {
	if h.tap == nil {
		return ctx, nil
	}
	return h.tap(ctx, info)
}

// twoListenerRig serves srv between trusted peers over UCX with space bytes
// of receive space, on two listeners of one server, and returns a client
// that round-robins over both under serviceConfig, once the server
// advertised its space over both connections.
func twoListenerRig(t *testing.T, srv *hookServer, space int, serviceConfig string) (*rig, tensorpb.TensorServiceClient) {
	t.Helper()
	r := tapRig(t, transport.ModeUCX, srv, srv.tapHandle, space)
	c := roundRobinClient(t, r, grpc.WithDefaultServiceConfig(serviceConfig))
	warmUpBoth(t, c)
	waitNothingTaken(t)
	r.paths.reset()
	return r, c
}

// isRetry reports whether the call of ctx is a retry or a hedge.
func isRetry(ctx context.Context) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	return len(md.Get("grpc-previous-rpc-attempts")) > 0
}

// clientEnd returns this process's client end of the connection whose
// server end is srv.
func clientEnd(t *testing.T, srv *transport.Session) *transport.Session {
	t.Helper()
	for _, s := range transport.SessionsTo(transport.LocalID()) {
		if s.IsClient() && s.LocalAddr().String() == srv.RemoteAddr().String() {
			return s
		}
	}
	t.Fatalf("no client end of session %v", srv.RemoteAddr())
	return nil
}

// The first attempt's handler still holds the payload it
// took from the first session's space when that session closes (the server
// closes it) and gRPC retries the call on the other connection: the retry
// cannot take the range (the space closed, or the range is held) and pulls
// by token; the first handler's bytes stay right after the session is gone
// and the retry completed; once it lets go, nothing is left over and later
// calls land.
func TestRetryWhileFirstAttemptHolds(t *testing.T) {
	const mib = 1 << 20
	var armed atomic.Bool
	type first struct {
		sess *transport.Session
		m    *tensorpb.Tensor
	}
	entered := make(chan first, 1)
	release := make(chan struct{})
	firstSum := make(chan uint32, 1)
	srv := &hookServer{}
	srv.digest = func(ctx context.Context, m *tensorpb.Tensor) (*tensorpb.Summary, error) {
		if isRetry(ctx) || !armed.CompareAndSwap(true, false) {
			return srv.Server.Digest(ctx, m)
		}
		sess := transport.SessionFromContext(ctx)
		entered <- first{sess, m}
		go func() { _ = sess.Close() }()
		<-sess.Done()
		<-release // the retry completed meanwhile
		sum, _, err := tensor.Checksum(m, 0)
		gdrcodec.ReleaseAll(m)
		if err != nil {
			firstSum <- 0
		} else {
			firstSum <- sum
		}
		return nil, status.Error(codes.Unavailable, "the first attempt's session closed")
	}
	r, c := twoListenerRig(t, srv, 4*mib, roundRobinRetry)
	armed.Store(true)
	req := tensorOf(mib, 5)
	sum, err := c.Digest(context.Background(), req, grpc.WaitForReady(true))
	gdrcodec.ReleaseAll(req)
	require.NoError(t, err)
	want := tensor.ChecksumBytes(pattern(mib, 5))
	require.Equal(t, want, sum.Crc32C, "the retry's bytes")
	f := <-entered
	require.Error(t, f.sess.Err())
	require.Equal(t, 1, oob.ReadStats().Landed, "the first handler holds its range")
	close(release)
	require.Equal(t, want, <-firstSum, "the first attempt's bytes, after its session closed")
	require.Equal(t, map[string]int{"rdma@space": 1, "rdma": 1}, r.paths.reset())
	requireSettled(t, "after the retry")
	// The connection that closed reconnects; whichever spaces serve, the
	// calls go on, byte-exact.
	for i := range 4 {
		digestChecked(t, c, mib, uint32(30+i))
	}
	requireSettled(t, "after later calls")
}

// The first attempt is refused before it is read, and the retry
// on the other connection takes the range from the first session's space;
// while its handler holds it, the first session closes (its server end or
// its client end). The handler's bytes stay right, the space is freed once
// the handler lets go, and nothing is left over.
func TestRetryHoldsRangeWhileFirstSessionCloses(t *testing.T) {
	const mib = 1 << 20
	for _, side := range []string{"server", "client"} {
		t.Run("closes="+side, func(t *testing.T) {
			var armed atomic.Bool
			refused := make(chan *transport.Session, 1)
			entered := make(chan struct{}, 1)
			release := make(chan struct{})
			srv := &hookServer{}
			srv.tap = func(ctx context.Context, info *tap.Info) (context.Context, error) {
				if info.FullMethodName == "/gdrpc.examples.tensor.TensorService/Digest" && armed.CompareAndSwap(true, false) {
					refused <- transport.SessionFromContext(ctx)
					return nil, status.Error(codes.Unavailable, "refused on purpose")
				}
				return ctx, nil
			}
			srv.digest = func(ctx context.Context, m *tensorpb.Tensor) (*tensorpb.Summary, error) {
				if !isRetry(ctx) {
					return srv.Server.Digest(ctx, m)
				}
				entered <- struct{}{}
				<-release
				return srv.Server.Digest(ctx, m)
			}
			r, c := twoListenerRig(t, srv, 4*mib, roundRobinRetry)
			bytesBefore := oob.ReadStats().SpaceBytes
			armed.Store(true)
			type result struct {
				sum *tensorpb.Summary
				err error
			}
			res := make(chan result, 1)
			go func() {
				req := tensorOf(mib, 7)
				defer gdrcodec.ReleaseAll(req)
				sum, err := c.Digest(context.Background(), req, grpc.WaitForReady(true))
				res <- result{sum, err}
			}()
			s1 := <-refused
			<-entered
			require.Equal(t, 1, oob.ReadStats().Landed, "the retry took the range from the first session's space")
			if side == "server" {
				require.NoError(t, s1.Close())
			} else {
				require.NoError(t, clientEnd(t, s1).Close())
			}
			<-s1.Done()
			require.Eventually(t, func() bool { return oob.ReadStats().PeerSpaces <= 1 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
			close(release)
			got := <-res
			require.NoError(t, got.err)
			require.Equal(t, tensor.ChecksumBytes(pattern(mib, 7)), got.sum.Crc32C, "the retry's bytes, read after the space's session closed")
			require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
			requireSettled(t, "after the retry")
			require.Eventually(t, func() bool { return oob.ReadStats().SpaceBytes < bytesBefore }, 10*time.Second, time.Millisecond,
				"the closed session's space is freed: %+v (before: %d)", oob.ReadStats(), bytesBefore)
			for i := range 4 {
				digestChecked(t, c, mib, uint32(40+i))
			}
			requireSettled(t, "after later calls")
		})
	}
}

// A client stream under a retry policy, its messages written
// into the first session's space, retried on the other connection: the
// server failed the first attempt after reading all of its messages, after
// reading the first only, or refused it before reading any. The replay names
// the first session's ranges: those taken already are pulled by token,
// those never taken are taken there over the other session. The sums are
// right, nothing is left over, and later calls land.
func TestStreamRetriedOnAnotherConnection(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name  string
		read  int // messages the first attempt reads; -1: refused before
		paths map[string]int
	}{
		{"read=all", 3, map[string]int{"rdma@space": 3, "rdma": 3}},
		{"read=first", 1, map[string]int{"rdma@space": 3, "rdma": 1}},
		{"refused", -1, map[string]int{"rdma@space": 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var armed atomic.Bool
			var sessions sync.Map // attempt (0, 1) -> session
			firstSum := make(chan uint32, 1)
			srv := &hookServer{}
			srv.tap = func(ctx context.Context, info *tap.Info) (context.Context, error) {
				if tc.read < 0 && info.FullMethodName == "/gdrpc.examples.tensor.TensorService/Upload" && armed.CompareAndSwap(true, false) {
					sessions.Store(0, transport.SessionFromContext(ctx))
					return nil, status.Error(codes.Unavailable, "refused on purpose")
				}
				return ctx, nil
			}
			srv.upload = func(st tensorpb.TensorService_UploadServer) error {
				ctx := st.Context()
				if tc.read < 0 || isRetry(ctx) || !armed.CompareAndSwap(true, false) {
					if isRetry(ctx) {
						sessions.Store(1, transport.SessionFromContext(ctx))
					}
					return srv.Server.Upload(st)
				}
				sessions.Store(0, transport.SessionFromContext(ctx))
				var sum uint32
				for range tc.read {
					m, err := st.Recv()
					if err != nil {
						return err
					}
					sum, _, err = tensor.Checksum(m, sum)
					gdrcodec.ReleaseAll(m)
					if err != nil {
						return status.Error(codes.Internal, err.Error())
					}
				}
				firstSum <- sum
				return status.Error(codes.Unavailable, "the first attempt fails on purpose")
			}
			r, c := twoListenerRig(t, srv, 8*mib, roundRobinRetry)
			armed.Store(true)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			st, err := c.Upload(ctx, grpc.WaitForReady(true))
			require.NoError(t, err)
			var want uint32
			for i := range uint32(3) {
				want = crc32.Update(want, crc32.MakeTable(crc32.Castagnoli), pattern(mib, 50+i))
				req := tensorOf(mib, 50+i)
				require.NoError(t, st.Send(req))
				gdrcodec.ReleaseAll(req)
			}
			if tc.read >= 0 {
				// The first attempt fails only after what it read: wait
				// for it, so that the retry replays every message.
				var w uint32
				for i := range uint32(tc.read) {
					w = crc32.Update(w, crc32.MakeTable(crc32.Castagnoli), pattern(mib, 50+i))
				}
				require.Equal(t, w, <-firstSum, "the first attempt's bytes")
			}
			sum, err := st.CloseAndRecv()
			require.NoError(t, err)
			require.Equal(t, uint64(3*mib), sum.Bytes)
			require.Equal(t, want, sum.Crc32C, "the retry's bytes")
			s0, _ := sessions.Load(0)
			s1, _ := sessions.Load(1)
			require.NotNil(t, s0)
			require.NotNil(t, s1, "retried")
			require.NotSame(t, s0, s1, "the retry came over the other connection")
			require.Equal(t, tc.paths, r.paths.reset())
			requireSettled(t, "after the retried stream")
			for i := range 4 {
				digestChecked(t, c, mib, uint32(60+i))
			}
			require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset(), "both spaces serve")
			requireSettled(t, "after later calls")
		})
	}
}

// hedgeInterceptor hedges a unary call as gRPC-Go does not: chained after
// gdrpc's interceptor, it sends n attempts at once (each naming its index in
// the "hedge" header), the first into reply and the others into messages of
// their own (while on is set), takes the first that succeeds, cancels the others, and returns
// once all of them did.
func hedgeInterceptor(n int, on *atomic.Bool) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if !on.Load() {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		type result struct {
			out proto.Message
			err error
		}
		res := make(chan result, n)
		cancels := make([]context.CancelFunc, n)
		for i := range n {
			actx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(ctx, "hedge", strconv.Itoa(i)))
			cancels[i] = cancel
			out := reply.(proto.Message)
			if i > 0 {
				out = out.ProtoReflect().New().Interface()
			}
			go func() { res <- result{out, invoker(actx, method, req, out, cc, opts...)} }()
		}
		var won *result
		var err error
		for range n {
			r := <-res
			if r.err == nil && won == nil {
				won = &r
				for _, c := range cancels {
					c()
				}
			} else if err == nil {
				err = r.err
			}
		}
		for _, c := range cancels {
			c()
		}
		if won == nil {
			return err
		}
		if won.out != reply {
			proto.Reset(reply.(proto.Message))
			proto.Merge(reply.(proto.Message), won.out)
		}
		return nil
	}
}

// hedgeIndex returns the "hedge" header of the call of ctx, or -1.
func hedgeIndex(ctx context.Context) int {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get("hedge")
	if len(v) == 0 {
		return -1
	}
	i, _ := strconv.Atoi(v[0])
	return i
}

// An application hedges (gRPC-Go does not): two attempts of
// one call in flight at once, one on each connection, each marshaling the
// request (gdrpc's interceptor sees one call). The first attempt's handler
// holds its request until it is cancelled; the second answers. The answer
// is byte-exact, the loser is cancelled, nothing is left over, and the
// spaces serve the calls after.
func TestHedgedByInterceptor(t *testing.T) {
	const mib = 1 << 20
	var hedging atomic.Bool
	var loserSess, winnerSess atomic.Pointer[transport.Session]
	entered := make(chan struct{}, 1)
	loserErr := make(chan error, 1)
	loserSum := make(chan uint32, 1)
	srv := &hookServer{}
	srv.digest = func(ctx context.Context, m *tensorpb.Tensor) (*tensorpb.Summary, error) {
		if !hedging.Load() {
			return srv.Server.Digest(ctx, m)
		}
		switch hedgeIndex(ctx) {
		case 0:
			loserSess.Store(transport.SessionFromContext(ctx))
			sum, _, err := tensor.Checksum(m, 0)
			if err != nil {
				sum = 0
			}
			loserSum <- sum
			entered <- struct{}{}
			<-ctx.Done()
			loserErr <- ctx.Err()
			return nil, status.FromContextError(ctx.Err()).Err()
		case 1:
			<-entered
			winnerSess.Store(transport.SessionFromContext(ctx))
		}
		return srv.Server.Digest(ctx, m)
	}
	r := newRigWith(t, transport.ModeUCX, srv, nil, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: 4 * mib})
	c := roundRobinClient(t, r, grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`),
		grpc.WithChainUnaryInterceptor(hedgeInterceptor(2, &hedging)))
	warmUpBoth(t, c)
	waitNothingTaken(t)
	r.paths.reset()

	hedging.Store(true)
	for i := range 3 {
		digestChecked(t, c, mib, uint32(70+i))
		want := tensor.ChecksumBytes(pattern(mib, uint32(70+i)))
		require.Equal(t, want, <-loserSum, "the loser's bytes")
		require.ErrorIs(t, <-loserErr, context.Canceled, "the loser is cancelled")
		require.NotSame(t, loserSess.Load(), winnerSess.Load(), "the attempts went over both connections")
		requireSettled(t, fmt.Sprintf("after hedged call %d", i))
	}
	require.Equal(t, map[string]int{"rdma@space": 6}, r.paths.reset(), "each attempt took its own write")
	hedging.Store(false)
	for i := range 4 {
		digestChecked(t, c, mib, uint32(80+i))
	}
	require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset())
	requireSettled(t, "after later calls")
}
