package listener_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

// TestServe: a gRPC server with ServerOptions serves gdrpc and plain clients
// on one listener, and Serve returns once the listener is closed.
func TestServe(t *testing.T) {
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	l, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(opts...))
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	defer srv.Stop()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, dopts := range [][]grpc.DialOption{
		dialer.New(gdrpc.WithSessionOptions(opts...)).DialOptions(nil),
		{grpc.WithTransportCredentials(insecure.NewCredentials())},
	} {
		cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(), dopts...)
		require.NoError(t, err)
		resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.Status)
		require.NoError(t, cc.Close())
	}

	require.NoError(t, l.Close())
	select {
	case err := <-served:
		require.ErrorIs(t, err, net.ErrClosed)
	case <-ctx.Done():
		t.Fatal("Serve did not return after Close")
	}
	_, err = l.Accept()
	require.ErrorIs(t, err, net.ErrClosed)
}

func TestListenBadMode(t *testing.T) {
	_, err := listener.Listen("127.0.0.1:0", gdrpc.WithTransport("rdma-please"))
	require.ErrorContains(t, err, "unknown transport mode")
}

// goroutineHealth answers Check and records the goroutine each call ran on.
type goroutineHealth struct {
	healthpb.UnimplementedHealthServer
	mu  sync.Mutex
	ids map[string]int
}

func (h *goroutineHealth) Check(context.Context, *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	h.mu.Lock()
	h.ids[testenv.GoroutineID()]++
	h.mu.Unlock()
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

// TestStreamWorkers: ServerOptions runs a server's calls on stream workers,
// goroutines that live across calls, not on one new goroutine per call.
func TestStreamWorkers(t *testing.T) {
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	l, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(opts...))
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	h := &goroutineHealth{ids: map[string]int{}}
	healthpb.RegisterHealthServer(srv, h)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	defer func() {
		srv.Stop()
		require.NoError(t, <-served) // Stop makes Serve return nil
	}()

	cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(), dialer.New(gdrpc.WithSessionOptions(opts...)).DialOptions(nil)...)
	require.NoError(t, err)
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const calls = 64
	for range calls {
		_, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	// One call at a time: a worker is almost always free for the next, so the
	// calls ran on about as many goroutines as there are workers (plus one
	// for each call that came before any worker was back), not one each.
	require.Less(t, len(h.ids), calls/2, "goroutines that served %d calls: %v", calls, h.ids)
}

// TestHostSessions: gdrpc.WithHostSessions reaches the listener, and a
// client past it fails its call with the server's reason.
func TestHostSessions(t *testing.T) {
	opts := []gdrpc.Option{gdrpc.WithSessionOptions(transport.WithMode(transport.ModeTCP))}
	l, err := listener.Listen("127.0.0.1:0", append(opts, gdrpc.WithHostSessions(1))...)
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	defer srv.Stop()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(l) }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	check := func() error {
		cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(), dialer.New(opts...).DialOptions(nil)...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = cc.Close() })
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	require.NoError(t, check())
	err = check()
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "at most 1 sessions from one host")
}
