package gdrcodec_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// countingAllocator is host memory that counts what it handed out.
type countingAllocator struct {
	devicebuf.Allocator
	n atomic.Int64
}

func (a *countingAllocator) Alloc(n int) (*devicebuf.Buffer, error) {
	a.n.Add(1)
	return a.Allocator.Alloc(n)
}

// Codec options given to a ClientConn's DialOptions are that ClientConn's
// alone: its responses land in its receive allocator, another ClientConn's in
// Register's, and the bytes are the server's either way.
func TestReceiveAllocatorPerClientConn(t *testing.T) {
	addr := serveTensors(t, &tensor.Server{})
	mine := &countingAllocator{Allocator: devicebuf.NewHostAllocator()}
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP))
	dial := func(opts ...gdrcodec.Option) tensorpb.TensorServiceClient {
		cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials(), opts...)...)
		require.NoError(t, err)
		t.Cleanup(func() { cc.Close() })
		return tensorpb.NewTensorServiceClient(cc)
	}
	scoped, plain := dial(gdrcodec.WithReceiveAllocator(mine)), dial()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 1 << 20
	want := tensor.ChecksumBytes(pattern(n, 5))
	for _, c := range []tensorpb.TensorServiceClient{scoped, plain, scoped} {
		got, err := c.Make(ctx, &tensorpb.Sized{Size: n, Seed: 5})
		require.NoError(t, err)
		b, ok := gdrcodec.Buffer(got.GetData())
		require.True(t, ok)
		host, err := b.HostBytes()
		require.NoError(t, err)
		require.Equal(t, want, tensor.ChecksumBytes(host))
		gdrcodec.ReleaseAll(got)
	}
	require.Equal(t, int64(2), mine.n.Load(), "the scoped ClientConn's two responses, and none of the other's")
}
