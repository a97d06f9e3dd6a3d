package dialer_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// countingMetrics counts the payloads that arrived on this side.
type countingMetrics struct {
	gdrpc.NopMetrics
	mu    sync.Mutex
	pulls int
	bytes int64
	up    int
}

func (m *countingMetrics) Transfer(i gdrpc.TransferInfo) {
	if i.Pull && i.Err == nil {
		m.mu.Lock()
		m.pulls++
		m.bytes += i.Bytes
		m.mu.Unlock()
	}
}

func (m *countingMetrics) SessionUp(string, bool) {
	m.mu.Lock()
	m.up++
	m.mu.Unlock()
}

func (m *countingMetrics) counts() (pulls int, bytes int64, up int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pulls, m.bytes, m.up
}

// Options are scoped to their Dialer: two clients in one process, each with
// its own metrics, see only their own sessions. (Which session a pull takes
// is the engine's choice among the live sessions to the payload's owner, so
// in one process transfers are not tied to a dialer.)
func TestOptionsPerDialer(t *testing.T) {
	gdrcodec.Register()
	lis, err := listener.Listen("127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var one, two countingMetrics
	for m, conns := range map[*countingMetrics]int{&one: 1, &two: 2} {
		d := dialer.New(gdrpc.WithMetrics(m))
		for range conns {
			cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(nil)...)
			require.NoError(t, err)
			defer cc.Close()
			got, err := tensorpb.NewTensorServiceClient(cc).Make(ctx, &tensorpb.Sized{Size: 1 << 20, Seed: 1})
			require.NoError(t, err)
			gdrcodec.ReleaseAll(got)
		}
	}
	_, _, up := one.counts()
	require.Equal(t, 1, up)
	_, _, up = two.counts()
	require.Equal(t, 2, up)
}

// sidedMetrics counts transfers by side.
type sidedMetrics struct {
	gdrpc.NopMetrics
	pulls, pushes atomic.Int64
}

func (m *sidedMetrics) Transfer(i gdrpc.TransferInfo) {
	if i.Err != nil {
		return
	}
	if i.Pull {
		m.pulls.Add(1)
	} else {
		m.pushes.Add(1)
	}
}

// A server pulls a stream's request payload through the session the call
// came over, so the listener's configuration applies to it, and the client's
// dialer serves it: even in one process, where both ends' sessions (and
// earlier tests' still lingering) lead to the payload's owner. (A unary
// request is decoded before the server knows its call: its pull takes any
// session to the owner.)
func TestTransfersFollowTheCallsSession(t *testing.T) {
	gdrcodec.Register()
	var server, client sidedMetrics
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithMetrics(&server))
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	d := dialer.New(gdrpc.WithMetrics(&client))
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(nil)...)
	require.NoError(t, err)
	defer cc.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 1 << 20
	src := devicebuf.HostFromBytes(make([]byte, n))
	req := &tensorpb.Tensor{Name: "up", Data: gdrcodec.New(src)}
	src.Release()
	up, err := tensorpb.NewTensorServiceClient(cc).Upload(ctx)
	require.NoError(t, err)
	require.NoError(t, up.Send(req))
	sum, err := up.CloseAndRecv()
	gdrcodec.ReleaseAll(req)
	require.NoError(t, err)
	require.Equal(t, uint64(n), sum.Bytes)
	require.Equal(t, int64(1), server.pulls.Load(), "the server pulled through the call's session")
	require.Zero(t, server.pushes.Load())
	require.Equal(t, int64(1), client.pushes.Load(), "the client's session served the pull")
	require.Zero(t, client.pulls.Load())
}
