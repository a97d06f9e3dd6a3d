package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
)

// BenchmarkPull is gdrperf's measurement as a Go benchmark: a unary call whose
// payload the client pulls out-of-band from a server in another process (this
// test binary, re-executed), over each transport, with plain gRPC over TCP
// to the same server process as the baseline.
func BenchmarkPull(b *testing.B) {
	for _, tr := range []string{"tcp", "ucx", "plain"} {
		for _, size := range []int{1 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("transport=%s/size=%s", tr, formatSize(size)), func(b *testing.B) {
				if tr == "ucx" {
					testenv.Need(b, "ucx", rdma.Available())
				}
				mode := tr
				if tr == "plain" {
					mode = "tcp"
				}
				o := &options{transport: mode, mem: "host", recv: "host", op: "pull", perftest: "none", callLimit: time.Minute}
				unregister, err := registerCodec(o, nil)
				require.NoError(b, err)
				defer unregister()
				ctx := context.Background()
				ch, info, err := startChild(ctx, o)
				require.NoError(b, err)
				defer func() { require.NoError(b, ch.stop()) }()

				var call func() error
				if tr == "plain" {
					cc, err := dialPlain(info.GRPC)
					require.NoError(b, err)
					defer cc.Close()
					call = func() error {
						return cc.Invoke(ctx, methodMake, wrapperspb.UInt64(uint64(size)), new(wrapperspb.BytesValue))
					}
				} else {
					cc, err := dialGDRPC(o, info.GDRPC)
					require.NoError(b, err)
					defer cc.Close()
					c := tensorpb.NewTensorServiceClient(cc)
					call = func() error {
						t, err := c.Make(ctx, &tensorpb.Sized{Size: uint64(size)})
						gdrcodec.ReleaseAll(t)
						return err
					}
				}
				require.NoError(b, call()) // connect, make the server's payload
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for b.Loop() {
					if err := call(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
