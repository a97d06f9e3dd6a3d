package gdrcodec_test

import (
	"context"
	"crypto/rand"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// countingServer is a TensorService that counts the calls its handlers saw.
type countingServer struct {
	tensor.Server
	handled atomic.Int32
}

func (s *countingServer) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	s.handled.Add(1)
	return s.Server.Digest(ctx, t)
}

func (s *countingServer) Upload(st tensorpb.TensorService_UploadServer) error {
	s.handled.Add(1)
	return s.Server.Upload(st)
}

// serveTensors serves srv on a gdrpc listener (TCP) with ServerOptions and
// extra, and returns the listener's address.
func serveTensors(t *testing.T, srv tensorpb.TensorServiceServer, extra ...grpc.ServerOption) string {
	t.Helper()
	return serveWith(t, func(gs *grpc.Server) { tensorpb.RegisterTensorServiceServer(gs, srv) }, extra...)
}

// serveWith is serveTensors with the services register registers.
func serveWith(t *testing.T, register func(*grpc.Server), extra ...grpc.ServerOption) string {
	t.Helper()
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithTransport(transport.ModeTCP), processEngine)
	require.NoError(t, err)
	gs := grpc.NewServer(append(listener.ServerOptions(insecure.NewCredentials()), extra...)...)
	register(gs)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	t.Cleanup(func() {
		gs.Stop()
		require.NoError(t, <-served)
		require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	})
	return lis.Addr().String()
}

// plainClient dials addr with the gdrpc dialer and nothing else of gdrpc: no
// interceptors, no gdrpc credentials, gRPC's own codecs.
func plainClient(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithContextDialer(d.DialContext),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return cc
}

func requireNoCodeMarker(t *testing.T, err error) {
	t.Helper()
	require.NotContains(t, status.Convert(err).Message(), "[code=", "the code travels as a status, not as text")
}

// A plain gRPC client, with only the gdrpc dialer, receives the status code of
// an out-of-band transfer the server failed to pull, unary and streaming, and
// the handler never sees the request.
func TestTransferStatusPlainClient(t *testing.T) {
	srv := &countingServer{}
	addr := serveTensors(t, srv)
	client := tensorpb.NewTensorServiceClient(plainClient(t, addr))
	var stranger transport.ID
	_, _ = rand.Read(stranger[:])
	tests := []struct {
		name   string
		owner  transport.ID
		length uint64
		blob   bool
		want   codes.Code
	}{
		{name: "over the receive limit", owner: transport.LocalID(), length: 16 << 30, want: codes.ResourceExhausted},
		{name: "owner not connected", owner: stranger, length: 1 << 20, blob: true, want: codes.Unavailable},
		{name: "token not offered", owner: transport.LocalID(), length: 1 << 20, want: codes.NotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The request names a payload of the client's process (or of a
			// stranger) under a token nobody holds; the client's codec sends
			// the body as it is.
			var req tensorpb.Tensor
			require.NoError(t, proto.Unmarshal(forgeClaim(t, tt.owner, tt.length, tt.blob), &req))
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			raw := grpc.ForceCodecV2(rawCodec{})

			_, err := client.Digest(ctx, &req, raw)
			require.Equal(t, tt.want, status.Code(err), "unary: %v", err)
			requireNoCodeMarker(t, err)

			up, err := client.Upload(ctx, raw)
			require.NoError(t, err)
			require.NoError(t, up.Send(&req))
			_, err = up.CloseAndRecv()
			require.Equal(t, tt.want, status.Code(err), "stream: %v", err)
			requireNoCodeMarker(t, err)
		})
	}
	require.Equal(t, int32(len(tests)), srv.handled.Load(), "only the stream handlers ran, and their Recv failed")
}

// A gdrpc client (with the interceptors) receives the status code of a
// response payload it failed to pull, as a status rather than text.
func TestTransferStatusResponse(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	gdrcodec.Register(gdrcodec.WithMaxReceivePayload(1 << 20))
	t.Cleanup(func() { gdrcodec.Register() })
	_, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 2 << 20, Seed: 1})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	requireNoCodeMarker(t, err)
}

// markerServer fails every Echo with a message that looks like the text
// earlier codes travelled in.
type markerServer struct{ tensor.Server }

func (*markerServer) Echo(context.Context, *tensorpb.Tensor) (*tensorpb.Tensor, error) {
	return nil, status.Error(codes.Internal, "gdrpc [code=OK] this is still a failure")
}

// A handler's error stays the handler's error, whatever its message says.
func TestHandlerErrorText(t *testing.T) {
	r := newRig(t, transport.ModeTCP, &markerServer{})
	_, err := r.client.Echo(context.Background(), &tensorpb.Tensor{Name: "x"})
	require.Error(t, err)
	require.Equal(t, codes.Internal, status.Code(err))
	require.Equal(t, "gdrpc [code=OK] this is still a failure", status.Convert(err).Message())
}

// userHooks is a server's own tap handle and stats handler.
type userHooks struct {
	taps, begins atomic.Int32
}

func (h *userHooks) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	h.taps.Add(1)
	return gdrcodec.TapHandle(ctx, info) // gdrpc's check, before the request is read
}

func (h *userHooks) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (h *userHooks) HandleRPC(_ context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.Begin); ok {
		h.begins.Add(1)
	}
}
func (h *userHooks) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (h *userHooks) HandleConn(context.Context, stats.ConnStats)                       {}

// A server's own tap handle and stats handler work beside gdrpc's options:
// gdr calls move their payloads out-of-band, both hooks see every call, and
// a plain TCP client naming the gdr codec is still refused.
func TestUserHooksCompose(t *testing.T) {
	hooks := &userHooks{}
	addr := serveTensors(t, &tensor.Server{}, grpc.InTapHandle(hooks.tap), grpc.StatsHandler(hooks))
	pc := &pathCounter{paths: map[string]int{}}
	oob.SetTransferConfig(oob.TransferConfig{Metrics: pc})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })

	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	defer cc.Close()
	client := tensorpb.NewTensorServiceClient(cc)
	want := pattern(1<<20, 3)
	src := devicebuf.HostFromBytes(want)
	req := &tensorpb.Tensor{Name: "up", Data: gdrcodec.New(src)}
	src.Release()
	sum, err := client.Digest(context.Background(), req)
	gdrcodec.ReleaseAll(req)
	require.NoError(t, err)
	require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)
	require.Equal(t, map[string]int{"stream": 1}, pc.reset(), "the server pulled the request")

	tcp, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		}))
	require.NoError(t, err)
	defer tcp.Close()
	_, err = tensorpb.NewTensorServiceClient(tcp).Make(context.Background(), &tensorpb.Sized{Size: 1}, grpc.CallContentSubtype(gdrcodec.Name))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.True(t, strings.Contains(status.Convert(err).Message(), "did not negotiate"), "%v", err)

	require.Equal(t, int32(2), hooks.taps.Load())
	require.Equal(t, int32(1), hooks.begins.Load(), "the refused call never began")
}
