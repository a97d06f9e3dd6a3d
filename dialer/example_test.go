package dialer_test

import (
	"context"
	"log"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

// A gRPC server and client over gdrpc: UCX when both ends have it, TCP
// otherwise. Plain gRPC clients can still reach the server on the same port.
func Example() {
	l, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	// register services on srv here
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	d := dialer.New(transport.WithKeepAlive(5*time.Second, 5*time.Second))
	cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(), d.DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _ = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
}
