package gdrcodec_test

import (
	"context"
	"crypto/rand"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/transport"
)

// protobufOnly is protobuf's own codec under the proto name: a server of
// another process, which knows nothing of gdrpc.
type protobufOnly struct{}

func (protobufOnly) Name() string { return "proto" }
func (protobufOnly) Marshal(v any) (mem.BufferSlice, error) {
	b, err := proto.Marshal(v.(proto.Message))
	return mem.BufferSlice{mem.SliceBuffer(b)}, err
}
func (protobufOnly) Unmarshal(data mem.BufferSlice, v any) error {
	return proto.Unmarshal(data.Materialize(), v.(proto.Message))
}

// namingServer answers Echo with a tensor whose DeviceBuffer names an
// out-of-band payload, which no plain peer can hand over.
type namingServer struct {
	tensorpb.UnimplementedTensorServiceServer
}

func (namingServer) Echo(context.Context, *tensorpb.Tensor) (*tensorpb.Tensor, error) {
	owner, token := make([]byte, 16), make([]byte, 16)
	_, _ = rand.Read(owner)
	_, _ = rand.Read(token)
	return &tensorpb.Tensor{Name: "naming", Data: &gdrv1.DeviceBuffer{Owner: owner, Token: token, Length: 1 << 20, Kind: gdrv1.Kind_KIND_HOST}}, nil
}

// A plain gRPC client of a process that serves gdr calls (and so decodes
// with the proto codec Register replaced) gets an error for a response
// that names an out-of-band payload, also while a peer of this process's
// server holds a unary call of that response's type open before its
// request (headers alone): such a response is no request of this server's,
// and nothing is filed for it.
func TestPlainClientRefusedWhileServerCallStalls(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	other := grpc.NewServer(grpc.ForceServerCodecV2(protobufOnly{}))
	tensorpb.RegisterTensorServiceServer(other, namingServer{})
	served := make(chan error, 1)
	go func() { served <- other.Serve(lis) }()
	defer func() {
		other.Stop()
		require.NoError(t, <-served)
	}()
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	plain := tensorpb.NewTensorServiceClient(cc)

	_, err = plain.Echo(ctx, &tensorpb.Tensor{})
	require.Error(t, err, "no call stalled")

	// A peer of the rig's server opens an Echo call and sends nothing more.
	stallCtx, stall := context.WithCancel(ctx)
	defer stall()
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	_, err = r.cc.NewStream(stallCtx, desc, tensorpb.TensorService_Echo_FullMethodName, grpc.ForceCodecV2(wireCodec{}))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return gdrcodec.DecodingForTest("gdrpc.examples.tensor.Tensor") }, 10*time.Second, time.Millisecond)

	before := gdrcodec.FiledDecodesForTest()
	resp, err := plain.Echo(ctx, &tensorpb.Tensor{})
	require.Error(t, err, "a call stalled: the response came as %v", resp)
	require.Contains(t, status.Convert(err).Message(), "out-of-band payload")
	require.Equal(t, before, gdrcodec.FiledDecodesForTest(), "a decode filed for nobody")
}
