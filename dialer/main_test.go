package dialer_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc"
	testpb "google.golang.org/grpc/interop/grpc_testing"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/sessionleak"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

const childEnv = "GDRPC_TEST_CHILD"

func TestMain(m *testing.M) {
	gdrcodec.Register() // servers here and in the children serve gdr calls
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	os.Exit(leaktest.Run(m, func() error { return sessionleak.Check() }))
}

// childOptions reads the transport of a child from GDRPC_TEST_UCX ("" for
// TCP, else UCX_TLS).
func childOptions() ([]transport.Option, error) {
	tls := os.Getenv("GDRPC_TEST_UCX")
	if tls == "" {
		return []transport.Option{transport.WithMode(transport.ModeTCP)}, nil
	}
	rc, err := rdma.NewContext(rdma.WithTransports(tls))
	if err != nil {
		return nil, err
	}
	return []transport.Option{transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(rc)}, nil
}

// runChild plays a role in a child process:
//   - "grpc-server": serves the test service on GDRPC_TEST_LISTEN, prints
//     "ADDR <addr>", exits when stdin closes;
//   - "plain-grpc-server": the same with plain gRPC over TCP;
//   - "grpc-client": calls the test service at GDRPC_TEST_ADDR with 1 MiB,
//     checks the echo and prints "OK transport=<t> samehost=<bool>", having
//     closed its ClientConn and then its Dialer where
//     GDRPC_TEST_DIALER_CLOSE is set.
func runChild(role string) int {
	opts, err := childOptions()
	if err != nil {
		fmt.Println("ERR", err)
		return 1
	}
	switch role {
	case "grpc-server", "plain-grpc-server":
		var l net.Listener
		var sopts []grpc.ServerOption
		if role == "grpc-server" {
			l, err = listener.Listen(os.Getenv("GDRPC_TEST_LISTEN"), gdrpc.WithSessionOptions(opts...))
			sopts = listener.ServerOptions(nil)
		} else {
			l, err = net.Listen("tcp", os.Getenv("GDRPC_TEST_LISTEN"))
		}
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		srv := grpc.NewServer(sopts...)
		testpb.RegisterTestServiceServer(srv, testService{})
		go func() { _ = srv.Serve(l) }()
		fmt.Println("ADDR", l.Addr().String())
		_, _ = io.Copy(io.Discard, os.Stdin)
		srv.Stop()
		return 0
	case "grpc-client":
		d := dialer.New(gdrpc.WithSessionOptions(opts...))
		var sess *transport.Session
		dial := func(ctx context.Context, addr string) (netConn, error) {
			c, err := d.DialContext(ctx, addr)
			if err == nil {
				sess = transport.SessionOf(c)
			}
			return c, err
		}
		cc, err := grpc.NewClient("passthrough:///"+os.Getenv("GDRPC_TEST_ADDR"), append(d.DialOptions(nil), grpc.WithContextDialer(dial))...)
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		body := pattern(1 << 20)
		resp, err := testpb.NewTestServiceClient(cc).UnaryCall(ctx, &testpb.SimpleRequest{Payload: &testpb.Payload{Body: body}})
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		if string(resp.GetPayload().GetBody()) != string(body) {
			fmt.Println("ERR payload differs")
			return 1
		}
		if os.Getenv("GDRPC_TEST_DIALER_CLOSE") != "" {
			// A clean exit: the ClientConn, then the Dialer.
			_ = cc.Close()
			_ = d.Close()
		}
		fmt.Printf("OK transport=%s samehost=%v\n", sess.Transport(), sess.Peer().SameHost)
		return 0
	}
	fmt.Fprintln(os.Stderr, "unknown child role", role)
	return 2
}
