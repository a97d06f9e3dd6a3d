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
// payloads with no handler. Until the handler has them they count against
// the session's pull bounds (Limits.PullBytes), so such calls hold no more
// than those allow; once they end, the next call finds room.
func TestUnendedRequestsHoldPullBounds(t *testing.T) {
	const n = 1 << 20
	addr := serveWith(t, func(gs *grpc.Server) {
		tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
		gs.RegisterService(&downDesc, nil)
	})
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })

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
				select {
				case info := <-seen:
					require.NoError(t, info.Err, "the server's pull of held request %d", i)
				case <-time.After(30 * time.Second):
					t.Fatalf("the server did not pull held request %d", i)
				}
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
			// The three hold the session's bound: a fourth request's pull
			// waits for room until its call's deadline.
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
