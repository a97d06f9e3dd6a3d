package gdrcodec_test

import (
	"context"
	"io"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
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
