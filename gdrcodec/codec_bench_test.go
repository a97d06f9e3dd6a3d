package gdrcodec_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	encproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/stats"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// grpcProto is gRPC's own proto codec, taken before TestMain's Register puts
// gdrpc's inlining one in its place.
var grpcProto = encoding.GetCodecV2(encproto.Name)

// BenchmarkCodecInline: what the gdr codec costs on a message whose small
// payload travels inline, as every small call pays it once on each side: a
// client marshals a tensor whose 1 KiB payload is attached, the server
// decodes it (the payload attached again) and releases it. Against it, the
// same message with the payload in the descriptor's inline bytes, marshaled
// and decoded by protobuf alone.
func BenchmarkCodecInline(b *testing.B) {
	payload := pattern(1024, 1)
	b.Run("codec=proto", func(b *testing.B) {
		msg := &tensorpb.Tensor{Name: "bench", Shape: []int64{32, 32}, Data: &gdrv1.DeviceBuffer{Length: 1024, Inline: payload}}
		b.SetBytes(1024)
		b.ReportAllocs()
		for b.Loop() {
			wire, err := proto.Marshal(msg)
			if err != nil {
				b.Fatal(err)
			}
			var got tensorpb.Tensor
			if err := proto.Unmarshal(wire, &got); err != nil {
				b.Fatal(err)
			}
			if len(got.GetData().GetInline()) != 1024 {
				b.Fatalf("%d bytes arrived", len(got.GetData().GetInline()))
			}
		}
	})
	b.Run("codec=gdr", func(b *testing.B) {
		src := devicebuf.HostFromBytes(payload)
		defer src.Release()
		msg := &tensorpb.Tensor{Name: "bench", Shape: []int64{32, 32}, Data: gdrcodec.New(src)}
		defer gdrcodec.ReleaseAll(msg)
		b.SetBytes(1024)
		b.ReportAllocs()
		for b.Loop() {
			wire, err := gdrcodec.MarshalForTest(msg)
			if err != nil {
				b.Fatal(err)
			}
			var got tensorpb.Tensor
			if err := gdrcodec.UnmarshalForTest(wire, &got); err != nil {
				b.Fatal(err)
			}
			if buf, ok := gdrcodec.Buffer(got.GetData()); !ok || buf.Len() != 1024 {
				b.Fatalf("payload not attached (%v)", ok)
			}
			gdrcodec.ReleaseAll(&got)
		}
	})
}

// BenchmarkUnaryCall: a whole unary call in one process over a gdrpc session
// of each transport (TCP, and UCX where there is one): Echo of a tensor whose
// 1 KiB payload travels inline, and Make, whose request cannot carry a
// payload, with a 1 KiB inline response. What the codec, the interceptors and
// the stats handlers add to a small call shows in its allocations, against
// plain gRPC over TCP (the proto codec, no gdrpc option) echoing the same
// tensor with its payload in the descriptor's inline bytes, and against that
// plain client and server over a gdrpc TCP session (tcp-session-only).
func BenchmarkUnaryCall(b *testing.B) {
	b.Run("transport=grpc-tcp/method=Echo", func(b *testing.B) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(b, err)
		benchPlainEcho(b, lis, nil)
	})
	// gRPC's own cost of a stats handler on each end, which the codec's
	// options install (they learn a call's connection from its events):
	// with any handler at all, gRPC makes and sends every event of every
	// call (headers, payloads, trailers, begin and end), copying the
	// metadata of each header event.
	b.Run("transport=grpc-tcp-nop-stats-handlers/method=Echo", func(b *testing.B) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(b, err)
		benchPlainEcho(b, lis, []grpc.ServerOption{grpc.StatsHandler(nopStatsHandler{})}, grpc.WithStatsHandler(nopStatsHandler{}))
	})
	// The session alone: gRPC's own codec and options over a gdrpc TCP
	// session (its handshake, then the gRPC lane), none of the codec's
	// interceptors or stats handlers: what the transport costs a call, apart
	// from what the codec's layer adds (the transport=tcp rows).
	b.Run("transport=tcp-session-only/method=Echo", func(b *testing.B) {
		opts := []gdrpc.Option{gdrpc.WithTransport(transport.ModeTCP), processEngine}
		lis, err := listener.Listen("127.0.0.1:0", opts...)
		require.NoError(b, err)
		benchPlainEcho(b, lis, nil, grpc.WithContextDialer(dialer.New(opts...).DialContext))
	})
	for _, mode := range []transport.Mode{transport.ModeTCP, transport.ModeUCX} {
		b.Run("transport="+string(mode), func(b *testing.B) {
			if mode == transport.ModeUCX && rdma.Available() != nil {
				b.Skip("no UCX")
			}
			r := newRig(b, mode, nil)
			ctx := context.Background()
			b.Run("method=Echo", func(b *testing.B) {
				payload := pattern(1024, 1)
				src := devicebuf.HostFromBytes(payload)
				defer src.Release()
				req := &tensorpb.Tensor{Name: "bench", Data: gdrcodec.New(src)}
				defer gdrcodec.ReleaseAll(req)
				b.SetBytes(1024)
				b.ReportAllocs()
				for b.Loop() {
					got, err := r.client.Echo(ctx, req)
					if err != nil {
						b.Fatal(err)
					}
					if buf, ok := gdrcodec.Buffer(got.GetData()); !ok || buf.Len() != 1024 {
						b.Fatalf("payload not attached (%v)", ok)
					}
					gdrcodec.ReleaseAll(got)
				}
			})
			b.Run("method=Make", func(b *testing.B) {
				b.SetBytes(1024)
				b.ReportAllocs()
				for b.Loop() {
					got, err := r.client.Make(ctx, &tensorpb.Sized{Size: 1024, Seed: 1})
					if err != nil {
						b.Fatal(err)
					}
					if buf, ok := gdrcodec.Buffer(got.GetData()); !ok || buf.Len() != 1024 {
						b.Fatalf("payload not attached (%v)", ok)
					}
					gdrcodec.ReleaseAll(got)
				}
			})
		})
	}
}

// benchPlainEcho serves TensorService on lis with gRPC's own proto codec,
// no gdrpc option and serverOpts, and measures a plain client's Echo of a
// tensor whose 1 KiB payload is in the descriptor's inline bytes, the client
// dialing with dialOpts.
func benchPlainEcho(b *testing.B, lis net.Listener, serverOpts []grpc.ServerOption, dialOpts ...grpc.DialOption) {
	gs := grpc.NewServer(append(serverOpts, grpc.ForceServerCodecV2(grpcProto))...)
	tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), append(dialOpts,
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultCallOptions(grpc.ForceCodecV2(grpcProto)))...)
	require.NoError(b, err)
	defer func() {
		cc.Close()
		gs.Stop()
		require.NoError(b, <-served)
	}()
	client := tensorpb.NewTensorServiceClient(cc)
	req := &tensorpb.Tensor{Name: "bench", Data: &gdrv1.DeviceBuffer{Length: 1024, Inline: pattern(1024, 1)}}
	b.SetBytes(1024)
	b.ReportAllocs()
	for b.Loop() {
		got, err := client.Echo(context.Background(), req)
		if err != nil {
			b.Fatal(err)
		}
		if len(got.GetData().GetInline()) != 1024 {
			b.Fatalf("%d bytes arrived", len(got.GetData().GetInline()))
		}
	}
}

// BenchmarkGPUSpaceCall: what a call whose payload lands in GPU receive
// space costs both ends in CPU, on the fake GPU (its device copies are host
// copies, made when something waits for them): the client calls Make, the
// server answers with the same 128 KiB of its GPU memory each time, copies
// it into the client's space by CUDA IPC and marks the copy with the
// client's event, and the client checks the payload landed there and
// releases it. What it leaves out is the device's own time; the Go side of
// a GPU call is all here, gRPC's included.
func BenchmarkGPUSpaceCall(b *testing.B) {
	devicebuftest.Install(b, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(b, err)
	base := devicebuf.Live()
	// Runs after the rig's cleanup (registered later), before the fake
	// GPU's leak check (registered earlier).
	b.Cleanup(func() { requireNothingLeft(b, base) })
	const n = 128 << 10
	src, err := gpu.Alloc(n)
	require.NoError(b, err)
	defer src.Release()
	r := newRig(b, transport.ModeTCP, fixedMaker{b: src}, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Paths: oob.PathCUDAIPC, ReceiveSpace: 16 << 20, Timeout: 20 * time.Second})
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	b.Cleanup(func() { gdrcodec.Register() })
	ctx := context.Background()
	call := func() {
		got, err := r.client.Make(ctx, &tensorpb.Sized{Size: n})
		if err != nil {
			b.Fatal(err)
		}
		if buf, ok := gdrcodec.Buffer(got.GetData()); !ok || buf.Len() != n || buf.Kind() != devicebuf.CUDA {
			b.Fatalf("payload not in GPU memory (%v)", ok)
		}
		gdrcodec.ReleaseAll(got)
	}
	// Calls until one lands in the client's space: the first goes by
	// another path, and the space comes with it.
	deadline := time.Now().Add(10 * time.Second)
	for r.paths.reset()["cuda-ipc@space"] == 0 {
		if time.Now().After(deadline) {
			b.Fatal("no payload landed in the client's space")
		}
		call()
	}
	r.paths.takeQueued()
	b.SetBytes(n)
	b.ReportAllocs()
	for b.Loop() {
		call()
	}
	b.StopTimer()
	if got := r.paths.reset()["cuda-ipc@space"]; got < b.N {
		b.Fatalf("%d of %d payloads landed in the space by CUDA IPC", got, b.N)
	}
	// The share of copies left queued, marked by the client's events, not
	// waited for by the server: under 1 where the 32 events were all out,
	// their ranges not yet given back.
	b.ReportMetric(float64(r.paths.takeQueued())/float64(b.N), "queued/op")
}

// fixedMaker answers Make with the same GPU buffer each time.
type fixedMaker struct {
	tensorpb.UnimplementedTensorServiceServer
	b *devicebuf.Buffer
}

func (m fixedMaker) Make(context.Context, *tensorpb.Sized) (*tensorpb.Tensor, error) {
	return &tensorpb.Tensor{Name: "bench", Data: gdrcodec.New(m.b)}, nil
}

// nopStatsHandler is a gRPC stats handler that does nothing.
type nopStatsHandler struct{}

func (nopStatsHandler) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (nopStatsHandler) HandleRPC(context.Context, stats.RPCStats)                       {}
func (nopStatsHandler) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (nopStatsHandler) HandleConn(context.Context, stats.ConnStats) {}
