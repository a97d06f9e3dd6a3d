package gdrcodec_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// pullsSeen reports the process's finished pulls, dropping those it has no
// room for.
type pullsSeen chan oob.TransferInfo

func (c pullsSeen) Transfer(i oob.TransferInfo) {
	if i.Pull {
		select {
		case c <- i:
		default:
		}
	}
}

func (pullsSeen) Fallback(oob.Path, oob.Path, string) {}

// wait waits for n more successful pulls.
func (c pullsSeen) wait(t *testing.T, n int) {
	t.Helper()
	for i := range n {
		select {
		case info := <-c:
			require.NoError(t, info.Err, "pull %d of %d", i+1, n)
		case <-time.After(30 * time.Second):
			t.Fatalf("no pull %d of %d in 30 s", i+1, n)
		}
	}
}

// parkServer serves TensorService with ServerOptions under limits (the
// transfer timeout a minute), and returns its address and the process's
// pulls as they finish.
func parkServer(t *testing.T, limits oob.Limits) (string, pullsSeen) {
	t.Helper()
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	})
	seen := make(pullsSeen, 64)
	oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Metrics: seen, Limits: limits})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
	return addr, seen
}

// gdrClient dials addr with gdrpc's dialer and DialOptions: a session of
// its own.
func gdrClient(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return cc
}

// partsRequest is a tensor with one out-of-band payload of size bytes per
// seed.
func partsRequest(size int, seeds ...uint32) *tensorpb.Tensor {
	t := &tensorpb.Tensor{Name: "parts"}
	for _, s := range seeds {
		src := devicebuf.HostFromBytes(pattern(size, s))
		t.Parts = append(t.Parts, gdrcodec.New(src))
		src.Release()
	}
	return t
}

// oneCall makes a whole call of method (a unary Digest, or Down) with req.
func oneCall(ctx context.Context, cc *grpc.ClientConn, method string, req *tensorpb.Tensor) error {
	cs, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, method)
	if err != nil {
		return err
	}
	if err := cs.SendMsg(req); err != nil {
		return err
	}
	if err := cs.CloseSend(); err != nil {
		return err
	}
	if method == tensorpb.TensorService_Digest_FullMethodName {
		return cs.RecvMsg(new(tensorpb.Summary))
	}
	got := new(tensorpb.Tensor)
	err = cs.RecvMsg(got)
	gdrcodec.ReleaseAll(got)
	return err
}

// downDesc is a server-streaming method whose request carries a payload,
// which it sends back: TensorService has none.
var downDesc = grpc.ServiceDesc{
	ServiceName: "test.Down",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{StreamName: "Down", ServerStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
		var in tensorpb.Tensor
		if err := ss.RecvMsg(&in); err != nil {
			return err
		}
		defer gdrcodec.ReleaseAll(&in)
		return ss.SendMsg(&in)
	}}},
}

// A server pulls a unary or server-streaming call's request payloads
// before the client has ended its side of the stream, and gRPC starts the
// handler only at that end: a client that never ends it leaves the pulled
// payloads with no handler. Until the handler has them they stay parked on
// the session within Limits.PullBytes (oob.Park), so such calls hold no
// more than that; once they end, the next call finds room.
func TestUnendedRequestsPark(t *testing.T) {
	const n = 1 << 20
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
		gs.RegisterService(&downDesc, nil)
	})
	cc := gdrClient(t, addr)
	request := func(seed uint32) *tensorpb.Tensor {
		src := devicebuf.HostFromBytes(pattern(n, seed))
		defer src.Release()
		return &tensorpb.Tensor{Name: "held", Data: gdrcodec.New(src)}
	}
	for _, method := range []string{tensorpb.TensorService_Echo_FullMethodName, "/test.Down/Down"} {
		t.Run(method, func(t *testing.T) {
			seen := make(pullsSeen, 64)
			oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Metrics: seen, Limits: oob.Limits{PullBytes: 3*n + n/2}})
			t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
			bidi := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}

			// Three calls that send their request and never end their side.
			held, endHeld := context.WithCancel(context.Background())
			defer endHeld()
			for i := range 3 {
				cs, err := cc.NewStream(held, bidi, method)
				require.NoError(t, err)
				req := request(uint32(i))
				require.NoError(t, cs.SendMsg(req))
				gdrcodec.ReleaseAll(req)
				seen.wait(t, 1)
			}

			// call makes one whole call of the method.
			call := func(ctx context.Context, seed uint32) (*tensorpb.Tensor, error) {
				cs, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, method)
				if err != nil {
					return nil, err
				}
				req := request(seed)
				defer gdrcodec.ReleaseAll(req)
				if err := cs.SendMsg(req); err != nil {
					return nil, err
				}
				if err := cs.CloseSend(); err != nil {
					return nil, err
				}
				got := new(tensorpb.Tensor)
				return got, cs.RecvMsg(got)
			}
			// The three fill the session's bound: a fourth request waits
			// for room to park until its call's deadline.
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			got, err := call(ctx, 3)
			cancel()
			gdrcodec.ReleaseAll(got)
			require.Contains(t, []codes.Code{codes.DeadlineExceeded, codes.ResourceExhausted}, status.Code(err),
				"a fourth request beside three held ones: %v", err)

			// Their end gives the room back.
			endHeld()
			got, err = call(context.Background(), 4)
			require.NoError(t, err)
			defer gdrcodec.ReleaseAll(got)
			b, err := tensor.Bytes(got.Data)
			require.NoError(t, err)
			requireBytes(t, pattern(n, 4), b)
		})
	}
}

// A request's own parked payloads do not hold back its pulls: a request
// whose payloads each fit Limits.PullBytes, or Limits.Pulls, but not all
// together, is pulled as an unparked one is (each pull waits only for the
// room the message's earlier ones give back as they end).
func TestParkedRequestOwnPullsGoOn(t *testing.T) {
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
		gs.RegisterService(&downDesc, nil)
	})
	cc := gdrClient(t, addr)
	for _, tc := range []struct {
		name   string
		limits oob.Limits
		size   int
		parts  int
	}{
		{"two 1 MiB payloads under PullBytes 1.5 MiB", oob.Limits{PullBytes: 3 << 19}, 1 << 20, 2},
		{"three 256 KiB payloads under Pulls 2", oob.Limits{Pulls: 2}, 256 << 10, 3},
	} {
		for _, method := range []string{tensorpb.TensorService_Digest_FullMethodName, "/test.Down/Down"} {
			t.Run(tc.name+method, func(t *testing.T) {
				oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Limits: tc.limits})
				t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
				req := partsRequest(tc.size, []uint32{1, 2, 3}[:tc.parts]...)
				defer gdrcodec.ReleaseAll(req)
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				require.NoError(t, oneCall(ctx, cc, method, req))
			})
		}
	}
}

// Requests whose clients never end their side fill their own sessions'
// Limits.PullBytes only: with two sessions full, a call over a third of the
// same host, whose parked bytes stay within Limits.TotalPullBytes, is
// pulled at once (oob.TestParkBoundedPerHost has the host's bound).
func TestParkedRequestsStallNoOtherSession(t *testing.T) {
	const n = 1 << 20
	addr, seen := parkServer(t, oob.Limits{PullBytes: 2 * n, TotalPullBytes: 5 * n})
	held, endHeld := context.WithCancel(context.Background())
	defer endHeld()
	bidi := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	for range 2 {
		cc := gdrClient(t, addr)
		for i := range 2 {
			cs, err := cc.NewStream(held, bidi, tensorpb.TensorService_Digest_FullMethodName)
			require.NoError(t, err)
			req := partsRequest(n, uint32(i))
			require.NoError(t, cs.SendMsg(req))
			gdrcodec.ReleaseAll(req)
			seen.wait(t, 1)
		}
	}
	req := partsRequest(n, 9)
	defer gdrcodec.ReleaseAll(req)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, oneCall(ctx, gdrClient(t, addr), tensorpb.TensorService_Digest_FullMethodName, req))
}

// A server whose own interceptors run before gdrpc's and queue calls (a
// concurrency limit): the unary calls waiting in it park their requests,
// and the stream whose handler runs meanwhile, whose messages are not
// parked, still pulls its next message.
func TestParkedRequestsQueuedBeforeInterceptor(t *testing.T) {
	const n = 1 << 20
	slot := make(chan struct{}, 1)
	streaming := make(chan struct{})
	limitUnary := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		select {
		case slot <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		defer func() { <-slot }()
		return h(ctx, req)
	}
	limitStream := func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		slot <- struct{}{}
		close(streaming)
		defer func() { <-slot }()
		return h(srv, ss)
	}
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	}, grpc.UnaryInterceptor(limitUnary), grpc.StreamInterceptor(limitStream))
	seen := make(pullsSeen, 64)
	oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Metrics: seen, Limits: oob.Limits{PullBytes: 2*n + n/2}})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
	client := tensorpb.NewTensorServiceClient(gdrClient(t, addr))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	up, err := client.Upload(ctx)
	require.NoError(t, err)
	first := partsRequest(n, 1)
	require.NoError(t, up.Send(first))
	gdrcodec.ReleaseAll(first)
	<-streaming // the stream's handler holds the slot
	digests := make(chan error, 2)
	for i := range 2 {
		go func() {
			req := partsRequest(n, uint32(10+i))
			defer gdrcodec.ReleaseAll(req)
			_, err := client.Digest(ctx, req)
			digests <- err
		}()
	}
	seen.wait(t, 3) // the stream's first message, and both requests, queued

	second := partsRequest(n, 2)
	require.NoError(t, up.Send(second))
	gdrcodec.ReleaseAll(second)
	sum, err := up.CloseAndRecv()
	require.NoError(t, err, "the running stream's second message")
	require.Equal(t, uint64(2*n), sum.Bytes)
	for range 2 {
		require.NoError(t, <-digests)
	}
}

// Honest calls at once on one connection, each with more payloads than one
// message's pulls run in parallel and more bytes than Limits.PullBytes in
// all, each payload well within it: a request parks all its payloads before
// it pulls any, so no two wait for each other, and every call goes.
func TestConcurrentRequestsOverPullBytes(t *testing.T) {
	const size, parts, calls = 256 << 10, 48, 4
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	})
	oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Limits: oob.Limits{PullBytes: 16 * size}})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
	cc := gdrClient(t, addr)
	seeds := make([]uint32, parts)
	for i := range seeds {
		seeds[i] = uint32(i + 1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make(chan error, calls)
	for range calls {
		go func() {
			req := partsRequest(size, seeds...)
			defer gdrcodec.ReleaseAll(req)
			errs <- oneCall(ctx, cc, tensorpb.TensorService_Digest_FullMethodName, req)
		}()
	}
	for range calls {
		require.NoError(t, <-errs)
	}
}

// Requests that arrive together park one at a time: of eight 4 MiB
// requests whose client never ends its side, under PullBytes 6 MiB, one is
// parked and pulled and seven wait, until the calls end.
func TestUnendedRequestsParkWithinPullBytes(t *testing.T) {
	const n, calls = 4 << 20, 8
	addr, seen := parkServer(t, oob.Limits{PullBytes: n + n/2})
	cc := gdrClient(t, addr)
	held, endHeld := context.WithCancel(context.Background())
	defer endHeld()
	bidi := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	for i := range calls {
		cs, err := cc.NewStream(held, bidi, tensorpb.TensorService_Digest_FullMethodName)
		require.NoError(t, err)
		go func() {
			req := partsRequest(n, uint32(i+1))
			defer gdrcodec.ReleaseAll(req)
			_ = cs.SendMsg(req) // fails once the test ends the calls
		}()
	}
	require.Eventually(t, func() bool {
		st := oob.ReadStats()
		return st.Parked == n && st.ParkWaiting == calls-1
	}, 20*time.Second, time.Millisecond, "one request parked, the others waiting: %+v", oob.ReadStats())
	seen.wait(t, 1)
	require.Empty(t, seen, "pulls of requests with no room to park")
	endHeld()
	require.Eventually(t, func() bool {
		st := oob.ReadStats()
		return st.Parked == 0 && st.ParkWaiting == 0
	}, 20*time.Second, time.Millisecond, "the ended calls leave nothing parked: %+v", oob.ReadStats())
}

// A request waiting for room to park waits within its call, not the
// transfer timeout: honest calls queued behind a server's own concurrency
// limit (an interceptor before gdrpc's, where their requests stay parked)
// all go, however long the queue takes.
func TestParkedRequestWaitsBeyondTransferTimeout(t *testing.T) {
	const n = 1 << 20
	const timeout = 300 * time.Millisecond
	entered, release := make(chan struct{}, 2), make(chan struct{})
	slot := make(chan struct{}, 1)
	limitUnary := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		select {
		case slot <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		defer func() { <-slot }()
		entered <- struct{}{}
		<-release
		return h(ctx, req)
	}
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	}, grpc.UnaryInterceptor(limitUnary))
	oob.SetTransferConfig(oob.TransferConfig{Timeout: timeout, Limits: oob.Limits{PullBytes: n + n/2}})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
	client := tensorpb.NewTensorServiceClient(gdrClient(t, addr))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make(chan error, 2)
	call := func(seed uint32) {
		req := partsRequest(n, seed)
		defer gdrcodec.ReleaseAll(req)
		_, err := client.Digest(ctx, req)
		errs <- err
	}
	go call(1)
	<-entered // the first holds the slot, its request parked
	go call(2)
	require.Eventually(t, func() bool { return oob.ReadStats().ParkWaiting == 1 }, 20*time.Second, time.Millisecond,
		"the second request waits for room to park")
	time.Sleep(2 * timeout) // the queue outlasts the transfer timeout
	close(release)
	for range 2 {
		require.NoError(t, <-errs)
	}
}

// A descriptor that names receive space this process does not know is
// pulled by its token like any other, and is parked like any other: a
// client cannot pass the bound by naming a made-up space.
func TestUnknownSpaceRequestsPark(t *testing.T) {
	const n = 1 << 20
	addr, seen := parkServer(t, oob.Limits{PullBytes: n + n/2})
	cc := gdrClient(t, addr)
	held, endHeld := context.WithCancel(context.Background())
	defer endHeld()
	bidi := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	for i := range 2 {
		src := devicebuf.HostFromBytes(pattern(n, uint32(i)))
		req := &tensorpb.Tensor{Data: gdrcodec.New(src)}
		src.Release()
		body, err := gdrcodec.MarshalForTest(req) // offers the payload
		gdrcodec.ReleaseAll(req)
		require.NoError(t, err)
		var forged tensorpb.Tensor
		require.NoError(t, proto.Unmarshal(body, &forged))
		forged.Data.Space, forged.Data.SpacePath = 0xfeed, uint32(oob.PathRDMA)
		t.Cleanup(func() { oob.Withdraw(oob.Token(forged.Data.Token)) })
		cs, err := cc.NewStream(held, bidi, tensorpb.TensorService_Digest_FullMethodName, grpc.ForceCodecV2(rawCodec{}))
		require.NoError(t, err)
		require.NoError(t, cs.SendMsg(&forged))
	}
	require.Eventually(t, func() bool {
		st := oob.ReadStats()
		return st.Parked == n && st.ParkWaiting == 1
	}, 20*time.Second, time.Millisecond, "one request parked, the other waiting: %+v", oob.ReadStats())
	seen.wait(t, 1)
}
