package gdrcodec_test

import (
	"context"
	"io"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// callSeen is what a server interceptor saw of one call: the call number
// in its metadata, the codec's record of it and the client's number the
// record holds (a header's or the request body's), and the messages the
// codec's bookkeeping noted in this process (the client's end is here too)
// while the call was in flight.
type callSeen struct {
	number             []string
	noted              bool
	call               uint64
	receiving, sending int
}

func recordCalls(seen chan<- callSeen) []grpc.ServerOption {
	see := func(ctx context.Context) {
		r, s := gdrcodec.TrackedForTest()
		noted, call := gdrcodec.CallNotedForTest(ctx)
		seen <- callSeen{metadata.ValueFromIncomingContext(ctx, oob.CallHeader), noted, call, r, s}
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			see(ctx)
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			see(ss.Context())
			return h(srv, ss)
		}),
	}
}

// TestPlainMethodUntracked: a call of a method whose request and response
// types cannot carry a payload (the health service's) goes without a call
// number and without the codec's bookkeeping on either end (a stream of
// such messages is numbered, for its types are not known as it starts, but
// its messages are not noted); a number
// forwarded from another process's call (a proxy passing its incoming
// metadata on) is still dropped. A unary call whose response can carry one,
// on the same connection, is numbered in its request's body, not in a
// header, and noted as before.
func TestPlainMethodUntracked(t *testing.T) {
	seen := make(chan callSeen, 4)
	r := newRigWith(t, transport.ModeTCP, nil, recordCalls(seen))
	const forwarded = "ffffffffffffffff" // another process's number, one this process's calls never reach
	ctx := metadata.AppendToOutgoingContext(context.Background(), oob.CallHeader, forwarded)
	hc := healthpb.NewHealthClient(r.cc)

	resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
	require.Equal(t, callSeen{}, <-seen, "a plain method's call")

	w, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	first, err := w.Recv()
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, first.GetStatus())
	got := <-seen
	require.Len(t, got.number, 1, "a stream's message types are not known as it starts: it is numbered")
	require.NotEqual(t, forwarded, got.number[0], "a forwarded number went on")
	require.False(t, got.noted, "the server knows the method's types: no record")
	require.Zero(t, got.receiving+got.sending, "a plain stream's messages are noted")

	tensor, err := r.client.Make(ctx, &tensorpb.Sized{Size: 1, Seed: 1})
	require.NoError(t, err)
	gdrcodec.ReleaseAll(tensor)
	got = <-seen
	require.Empty(t, got.number, "a unary call's number went in a header, or a forwarded one went on")
	require.True(t, got.noted)
	require.NotZero(t, got.call, "the request's body named no call")
	require.NotEqual(t, uint64(1<<64-1), got.call, "a forwarded number went on")
	require.Equal(t, 1, got.receiving, "the response being received")
	made := got.call

	echoed, err := r.client.Echo(ctx, &tensorpb.Tensor{Name: "echo"})
	require.NoError(t, err)
	require.Equal(t, "echo", echoed.GetName())
	gdrcodec.ReleaseAll(echoed)
	got = <-seen
	require.Empty(t, got.number, "a unary call's number went in a header, or a forwarded one went on")
	require.NotZero(t, got.call, "the request's body named no call")
	require.NotEqual(t, uint64(1<<64-1), got.call, "a forwarded number went on")
	require.NotEqual(t, made, got.call, "two calls took one number")

	down, err := r.client.Download(ctx, &tensorpb.Sized{Size: 1, Seed: 1})
	require.NoError(t, err)
	for {
		m, err := down.Recv()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		gdrcodec.ReleaseAll(m)
	}
	got = <-seen
	require.Len(t, got.number, 1, "a stream is numbered in a header")
	require.NotEqual(t, forwarded, got.number[0], "a forwarded number went on")
	n, err := strconv.ParseUint(got.number[0], 16, 64)
	require.NoError(t, err)
	require.Equal(t, n, got.call, "the record holds another number than the stream's header")

	receiving, sending := gdrcodec.TrackedForTest()
	require.Zero(t, receiving+sending, "notes left after the calls")
}

// A request of a type that cannot carry a payload (Make's Sized, whose
// response can) with a malformed call number is refused, and nothing is
// filed for it: before, the decode failed into the codec's failures, which
// only a type that may carry takes from, and the handler ran on the
// undecoded request.
func TestMalformedCallNumberRefused(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	raw := grpc.ForceCodecV2(wireCodec{})
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	malformed := append(protowire.AppendTag(nil, 19061, protowire.VarintType), 0x80) // a varint cut short
	before := gdrcodec.FiledDecodesForTest()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	st, err := r.cc.NewStream(ctx, desc, tensorpb.TensorService_Make_FullMethodName, raw)
	require.NoError(t, err)
	require.NoError(t, st.SendMsg(malformed))
	require.NoError(t, st.CloseSend())
	var out []byte
	for err == nil {
		err = st.RecvMsg(&out)
	}
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Equal(t, before, gdrcodec.FiledDecodesForTest(), "a decode filed for nobody")
}

// A second request message on a call of a plain method (the health
// service's Check) is refused before the codec files anything for it, as
// on a method whose messages may carry payloads: while a unary call of a
// method the protobuf registry does not know waits for its request (it may
// decode any type), a request with a call number is filed for the stats
// handler, and gRPC decodes the second message only to refuse the call.
func TestPlainSecondRequestFilesNothing(t *testing.T) {
	opts := []gdrpc.Option{gdrpc.WithTransport(transport.ModeTCP), processEngine}
	lis, err := listener.Listen("127.0.0.1:0", opts...)
	require.NoError(t, err)
	gs := grpc.NewServer(listener.ServerOptions(insecure.NewCredentials())...)
	healthpb.RegisterHealthServer(gs, health.NewServer())
	gs.RegisterService(&grpc.ServiceDesc{ServiceName: "unregistered.Hold", HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Wait", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			in := new(emptypb.Empty)
			if err := dec(in); err != nil {
				return nil, err
			}
			return in, nil
		}}}}, struct{}{})
	go gs.Serve(lis)
	defer gs.Stop()
	d := dialer.New(opts...)
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	defer cc.Close()

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	raw := grpc.ForceCodecV2(wireCodec{})
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	_, err = cc.NewStream(ctx, desc, "/unregistered.Hold/Wait", raw) // headers, no request
	require.NoError(t, err)
	require.Eventually(t, func() bool { return gdrcodec.DecodingForTest("any.Type") }, 10*time.Second, time.Millisecond)

	body := protowire.AppendVarint(protowire.AppendTag(nil, 19061, protowire.VarintType), 77) // a call number
	before := gdrcodec.FiledDecodesForTest()
	st, err := cc.NewStream(ctx, desc, healthpb.Health_Check_FullMethodName, raw)
	require.NoError(t, err)
	require.NoError(t, st.SendMsg(body))
	require.NoError(t, st.SendMsg(body))
	require.NoError(t, st.CloseSend())
	var out []byte
	for err == nil {
		err = st.RecvMsg(&out)
	}
	require.NotEqual(t, codes.OK, status.Code(err), "a call with two requests went through")
	require.Equal(t, before, gdrcodec.FiledDecodesForTest(), "a decode filed for nobody")
}
