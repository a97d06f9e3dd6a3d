package listener_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
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
