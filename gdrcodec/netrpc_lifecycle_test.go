package gdrcodec_test

import (
	"context"
	"net/rpc"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

// BlockingTensors' Make waits for release before answering with a payload.
type BlockingTensors struct {
	entered  chan struct{}
	release  chan struct{}
	answered chan struct{}
	once     sync.Once
}

func (b *BlockingTensors) Make(r *tensorpb.Sized, t *tensorpb.Tensor) error {
	b.once.Do(func() { close(b.entered) })
	<-b.release
	defer close(b.answered)
	m, err := tensor.Make(nil, r)
	if err == nil {
		*t = tensorpb.Tensor{Name: m.Name, Data: m.Data, Blob: m.Blob}
	}
	return err
}

// lifecycleNetRPC serves rcvr and Tensors over net/rpc (TCP) and returns a
// client the test closes itself.
func lifecycleNetRPC(t *testing.T, rcvr any) *rpc.Client {
	t.Helper()
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	opts := []gdrpc.Option{gdrpc.WithTransport(transport.ModeTCP), processEngine}
	srv := rpc.NewServer()
	require.NoError(t, srv.Register(Tensors{}))
	if rcvr != nil {
		require.NoError(t, srv.Register(rcvr))
	}
	lis, err := listener.Listen("127.0.0.1:0", opts...)
	require.NoError(t, err)
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go srv.ServeCodec(gdrcodec.NewServerCodec(c))
		}
	}()
	conn, err := dialer.New(opts...).DialContext(context.Background(), lis.Addr().String())
	require.NoError(t, err)
	c := rpc.NewClientWithCodec(gdrcodec.NewClientCodec(conn))
	t.Cleanup(func() {
		_ = c.Close()
		_ = lis.Shutdown(context.Background())
		require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	})
	return c
}

// A net/rpc client closed while its call's handler runs: the call ends
// with ErrShutdown, and the reply the handler then sends leaves nothing.
func TestNetRPCClientCloseMidCall(t *testing.T) {
	b := &BlockingTensors{entered: make(chan struct{}), release: make(chan struct{}), answered: make(chan struct{})}
	c := lifecycleNetRPC(t, b)
	var got tensorpb.Tensor
	call := c.Go("BlockingTensors.Make", &tensorpb.Sized{Size: 1 << 20, Seed: 2}, &got, make(chan *rpc.Call, 1))
	<-b.entered
	require.NoError(t, c.Close())
	done := <-call.Done
	require.Error(t, done.Error)
	close(b.release)
	<-b.answered
	requireSettled(t, "after a net/rpc client closed mid-call")
}

// A net/rpc client closed while it pulls a reply's payload.
func TestNetRPCClientCloseMidPull(t *testing.T) {
	c := lifecycleNetRPC(t, nil)
	var got tensorpb.Tensor
	call := c.Go("Tensors.Make", &tensorpb.Sized{Size: bigPayload, Seed: 2}, &got, make(chan *rpc.Call, 1))
	waitPulls(t)
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	select {
	case done := <-call.Done:
		if done.Error == nil { // the pull finished first
			checkSized(t, &got, bigPayload, 2)
		}
	case <-ctx.Done():
		t.Fatal("the call did not end after Close")
	}
	select {
	case <-closed:
	case <-ctx.Done():
		t.Fatal("Close did not return")
	}
	requireSettled(t, "after a net/rpc client closed mid-pull")
}
