package gdrcodec_test

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
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
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// tcpClient serves TensorService on a gdrpc listener whose received
// payloads land in a counting allocator, and returns a plain gRPC client of
// it (standard TCP dial, no handshake) with the allocator.
func tcpClient(t *testing.T) (tensorpb.TensorServiceClient, *countingAllocator) {
	t.Helper()
	cc, alloc := tcpConn(t)
	return tensorpb.NewTensorServiceClient(cc), alloc
}

// tcpConn is tcpClient's connection.
func tcpConn(t *testing.T) (*grpc.ClientConn, *countingAllocator) {
	t.Helper()
	// A pull of this process's payload may take any session to it: none of
	// an earlier test's may be left.
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	alloc := &countingAllocator{Allocator: devicebuf.NewHostAllocator()}
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(alloc))
	t.Cleanup(func() { gdrcodec.Register() })
	return plainConn(t, func(gs *grpc.Server) { tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{}) }), alloc
}

// plainConn serves what register registers on a gdrpc listener and returns
// a plain gRPC client connection to it (standard TCP dial, no handshake).
func plainConn(t *testing.T, register func(*grpc.Server)) *grpc.ClientConn {
	t.Helper()
	lis, err := listener.Listen("127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(listener.ServerOptions(insecure.NewCredentials())...)
	register(gs)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		}))
	require.NoError(t, err)
	t.Cleanup(func() {
		cc.Close()
		gs.Stop()
		require.NoError(t, <-served)
	})
	return cc
}

// forgedTensor returns a tensor whose payload names one in this process's
// outbox, which leaves the outbox once pulled, and the payload's token.
func forgedTensor(t *testing.T, n int) (*tensorpb.Tensor, oob.Token) {
	t.Helper()
	d := oob.Offer(oob.Source{Bytes: pattern(n, 9)}, oob.OfferOptions{})
	t.Cleanup(func() { oob.Withdraw(d.Token) })
	owner := transport.LocalID()
	return &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{
		Length: uint64(n), Kind: gdrv1.Kind_KIND_HOST, Owner: owner[:], Token: d.Token[:], Device: -1,
	}}, d.Token
}

// upload sends t on an Upload stream and returns the stream's status.
func upload(c tensorpb.TensorServiceClient, t *tensorpb.Tensor, opts ...grpc.CallOption) error {
	st, err := c.Upload(context.Background(), opts...)
	if err != nil {
		return err
	}
	if err := st.Send(t); err != nil {
		_, err = st.CloseAndRecv() // Send reports io.EOF; the status comes here
		return err
	}
	_, err = st.CloseAndRecv()
	return err
}

// A plain client (no handshake, the proto codec) may send payloads inline
// alone: a DeviceBuffer naming one by owner and token is refused with
// InvalidArgument, and nothing is pulled or allocated for it.
func TestPlainClientNamesNoPayload(t *testing.T) {
	client, alloc := tcpClient(t)

	const n = 1 << 20
	want := pattern(n, 3)
	b := devicebuf.HostFromBytes(want)
	inline := &tensorpb.Tensor{Data: gdrcodec.New(b)}
	b.Release()
	sum, err := client.Digest(context.Background(), inline)
	gdrcodec.ReleaseAll(inline)
	require.NoError(t, err, "an inline payload from a plain client")
	require.Equal(t, uint64(n), sum.Bytes)
	require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)

	for _, tt := range []struct {
		name string
		call func(tensorpb.TensorServiceClient, *tensorpb.Tensor) error
	}{
		{"unary", func(c tensorpb.TensorServiceClient, t *tensorpb.Tensor) error {
			_, err := c.Digest(context.Background(), t)
			return err
		}},
		{"stream", func(c tensorpb.TensorServiceClient, t *tensorpb.Tensor) error { return upload(c, t) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			forged, token := forgedTensor(t, n)
			err := tt.call(client, forged)
			require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
			require.ErrorContains(t, err, "inline")
			require.True(t, oob.Offered(token), "the server pulled the payload a plain client named")
			require.Zero(t, alloc.n.Load(), "the server allocated for a payload a plain client named")
		})
	}
}

// A plain client that names the gdr subtype gets the gdr codec, which
// decodes a unary request before the interceptors refuse the call: the
// payloads its request names are not pulled, and nothing is allocated.
func TestPlainClientGDRSubtypePullsNothing(t *testing.T) {
	client, alloc := tcpClient(t)
	forged, token := forgedTensor(t, 1<<20)
	_, err := client.Digest(context.Background(), forged, grpc.CallContentSubtype(gdrcodec.Name))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.True(t, oob.Offered(token), "the server pulled the payload a plain client named")
	require.Zero(t, alloc.n.Load(), "the server allocated for a payload a plain client named")
	require.Equal(t, codes.FailedPrecondition, status.Code(upload(client, forged, grpc.CallContentSubtype(gdrcodec.Name))))
	require.True(t, oob.Offered(token), "the server pulled the payload a plain client named")
}

// gRPC decodes a unary request once more into the same message, to see
// that no second one came: that decode attaches and pulls nothing, whether
// the second message carries a payload inline (the proto codec) or names
// one (the gdr subtype from a plain client), and the call fails.
func TestSecondUnaryMessage(t *testing.T) {
	cc, alloc := tcpConn(t)
	live := devicebuf.Live().HostBuffers
	forged, token := forgedTensor(t, 1<<20)
	inline := &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: 1 << 16, Kind: gdrv1.Kind_KIND_HOST, Device: -1, Inline: pattern(1<<16, 1)}}
	for _, tc := range []struct {
		name   string
		second *tensorpb.Tensor
		opts   []grpc.CallOption
	}{
		{"inline", inline, nil},
		{"named, gdr subtype", forged, []grpc.CallOption{grpc.CallContentSubtype(gdrcodec.Name)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			st, err := cc.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, tensorpb.TensorService_Digest_FullMethodName, tc.opts...)
			require.NoError(t, err)
			require.NoError(t, st.SendMsg(inline))
			require.NoError(t, st.SendMsg(tc.second))
			require.NoError(t, st.CloseSend())
			err = st.RecvMsg(new(tensorpb.Summary))
			require.Equal(t, codes.Internal, status.Code(err), "%v", err) // gRPC's code for a codec's error
			require.ErrorContains(t, err, "a second request message on a call that takes one")
		})
	}
	require.True(t, oob.Offered(token), "the server pulled the payload a plain client's second message named")
	require.Zero(t, alloc.n.Load(), "the server allocated for a plain client's second message")
	// At most where it was: earlier tests' pool regions may be freed
	// meanwhile (idle trimming), and nothing else is allocated.
	require.Eventually(t, func() bool { return devicebuf.Live().HostBuffers <= live }, 10*time.Second, time.Millisecond, "a second message's inline payload is held")
}

// The same on a server-streaming method whose request carries a payload:
// gRPC checks there too, with a decode into the request, that the client
// sent one message only.
func TestSecondServerStreamRequest(t *testing.T) {
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	cc := plainConn(t, func(gs *grpc.Server) {
		gs.RegisterService(&grpc.ServiceDesc{
			ServiceName: "gdrpc.test.Down",
			HandlerType: (*any)(nil),
			Streams: []grpc.StreamDesc{{StreamName: "Down", ServerStreams: true, Handler: func(_ any, st grpc.ServerStream) error {
				return st.RecvMsg(new(tensorpb.Tensor))
			}}},
		}, struct{}{})
	})
	live := devicebuf.Live().HostBuffers
	inline := &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: 1 << 16, Kind: gdrv1.Kind_KIND_HOST, Device: -1, Inline: pattern(1<<16, 1)}}
	for _, messages := range []int{1, 2, 2} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		st, err := cc.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, "/gdrpc.test.Down/Down")
		require.NoError(t, err)
		for range messages {
			require.NoError(t, st.SendMsg(inline))
		}
		require.NoError(t, st.CloseSend())
		err = st.RecvMsg(new(tensorpb.Tensor))
		cancel()
		if messages == 1 {
			require.ErrorIs(t, err, io.EOF, "one request is served")
		} else {
			require.Equal(t, codes.Internal, status.Code(err), "%v", err)
			require.ErrorContains(t, err, "a second request message on a call that takes one")
		}
	}
	// At most where it was: earlier tests' pool regions may be freed
	// meanwhile (idle trimming), and nothing else is allocated.
	require.Eventually(t, func() bool { return devicebuf.Live().HostBuffers <= live }, 10*time.Second, time.Millisecond, "a second message's inline payload is held")
}

// rawCall sends msg as the one request message of method over HTTP/2
// without TLS, with the content type ct, as a gRPC client that is no
// grpc-go might, and returns the response's grpc-status.
func rawCall(t *testing.T, addr, method, ct string, msg proto.Message) string {
	t.Helper()
	b, err := proto.Marshal(msg)
	require.NoError(t, err)
	body := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(b)))
	body = append(body, b...)
	tr := &http2.Transport{AllowHTTP: true, DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+method, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("content-type", ct)
	req.Header.Set("te", "trailers")
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	require.NoError(t, resp.Body.Close())
	return cmp.Or(resp.Trailer.Get("grpc-status"), resp.Header.Get("grpc-status"))
}

// gRPC picks a codec by the content type's subtype after "+" or ";": a
// plain client that names the gdr codec either way, on a unary or a
// streaming method, gets FailedPrecondition, and nothing is pulled or
// allocated for the payload it names.
func TestPlainClientGDRContentTypes(t *testing.T) {
	cc, alloc := tcpConn(t)
	for _, ct := range []string{"application/grpc+gdr", "application/grpc;gdr"} {
		for _, method := range []string{tensorpb.TensorService_Digest_FullMethodName, tensorpb.TensorService_Upload_FullMethodName} {
			forged, token := forgedTensor(t, 1<<20)
			code := rawCall(t, cc.Target(), method, ct, forged)
			require.Equal(t, strconv.Itoa(int(codes.FailedPrecondition)), code, "%s %s", ct, method)
			require.True(t, oob.Offered(token), "%s %s: the server pulled the payload a plain client named", ct, method)
			require.Zero(t, alloc.n.Load(), "%s %s: the server allocated for it", ct, method)
		}
	}
}

// A server that registered the gdr codec but left ServerOptions out cannot
// tell which connection a unary request or a stream's message came over: a
// message that names a payload by token fails, from a plain client and from
// a gdrpc client alike, with an error that names ServerOptions, and nothing
// is pulled or allocated for it.
func TestServerWithoutServerOptions(t *testing.T) {
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	alloc := &countingAllocator{Allocator: devicebuf.NewHostAllocator()}
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(alloc))
	t.Cleanup(func() { gdrcodec.Register() })
	lis, err := listener.Listen("127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(grpc.Creds(transport.NewCredentials(insecure.NewCredentials())))
	tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	t.Cleanup(func() {
		gs.Stop()
		require.NoError(t, <-served)
	})

	for _, method := range []string{tensorpb.TensorService_Digest_FullMethodName, tensorpb.TensorService_Upload_FullMethodName} {
		forged, token := forgedTensor(t, 1<<20)
		code := rawCall(t, lis.Addr().String(), method, "application/grpc+gdr", forged)
		require.Equal(t, strconv.Itoa(int(codes.Internal)), code, method)
		require.True(t, oob.Offered(token), "%s: the server pulled the payload a plain client named", method)
	}

	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dialer.New(gdrpc.WithTransport(transport.ModeTCP)).DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	defer cc.Close()
	client := tensorpb.NewTensorServiceClient(cc)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 3)))}
	defer gdrcodec.ReleaseAll(req)
	_, err = client.Digest(ctx, req)
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "gdrcodec.ServerOptions")
	st, err := client.Upload(ctx)
	require.NoError(t, err)
	require.NoError(t, st.Send(req))
	_, err = st.CloseAndRecv()
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "gdrcodec.ServerOptions")
	require.Zero(t, alloc.n.Load(), "the server allocated for a payload it could not place")
}
