package gdrcodec_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// rawProtoCodec is a server codec that marshals exactly what the handler
// returns, descriptors included, as a plain server that forges them does.
type rawProtoCodec struct{}

func (rawProtoCodec) Marshal(v any) ([]byte, error)   { return proto.Marshal(v.(proto.Message)) }
func (rawProtoCodec) Unmarshal(b []byte, v any) error { return proto.Unmarshal(b, v.(proto.Message)) }
func (rawProtoCodec) Name() string                    { return "gdr" }

type forgingServer struct {
	tensorpb.UnimplementedTensorServiceServer
	resp *tensorpb.Tensor
}

func (s *forgingServer) Make(context.Context, *tensorpb.Sized) (*tensorpb.Tensor, error) {
	return s.resp, nil
}

// A client with the codec's DialOptions whose connection is no gdrpc session
// (plain TCP: the server proved no identity) pulls nothing a response names
// by reference, as a server refuses such requests and the net/rpc codecs
// such messages: here a payload of this very process's outbox, which a pull
// would have copied with no session to charge it to. The call fails with
// InvalidArgument, the payload stays offered, nothing is allocated.
func TestPlainServerPayloadNotPulled(t *testing.T) {
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	const n = 256 << 10
	forged, token := forgedTensor(t, n)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(grpc.ForceServerCodec(rawProtoCodec{}))
	tensorpb.RegisterTensorServiceServer(gs, &forgingServer{resp: forged})
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-served })

	alloc := &countingAllocator{Allocator: devicebuf.NewHostAllocator()}
	cc, err := grpc.NewClient(lis.Addr().String(),
		append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())},
			gdrcodec.DialOptions(gdrcodec.WithReceiveAllocator(alloc))...)...)
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	got, err := tensorpb.NewTensorServiceClient(cc).Make(ctx, &tensorpb.Sized{Size: 1})
	if err == nil {
		b, _ := gdrcodec.Buffer(got.GetData())
		t.Logf("the client took the response: payload attached %v", b != nil)
	}
	require.Equal(t, codes.InvalidArgument, status.Code(err), "a response from a server that proved no identity named an out-of-band payload: %v", err)
	require.ErrorContains(t, err, `only the "gdr" codec over a gdrpc connection carries`)
	require.True(t, oob.Offered(token), "the client pulled a payload on a plain server's word")
	require.Zero(t, alloc.n.Load(), "the client allocated for a payload a plain server named")
}
