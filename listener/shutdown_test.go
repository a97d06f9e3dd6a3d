package listener_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

// sessionTensor is the tensor service, recording the session of each Make.
type sessionTensor struct {
	tensor.Server
	sessions chan *gdrpc.Session
}

func (s *sessionTensor) Make(ctx context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	select {
	case s.sessions <- gdrpc.SessionFromContext(ctx):
	default:
	}
	return s.Server.Make(ctx, r)
}

// tensorServer serves the tensor service with sopts over TCP sessions; it
// is stopped and its listener shut down when the test ends.
func tensorServer(t *testing.T, sopts ...grpc.ServerOption) (lis *transport.Listener, svc *sessionTensor, srv *grpc.Server, served chan error) {
	t.Helper()
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithTransport(transport.ModeTCP))
	require.NoError(t, err)
	srv = grpc.NewServer(sopts...)
	svc = &sessionTensor{sessions: make(chan *gdrpc.Session, 1)}
	tensorpb.RegisterTensorServiceServer(srv, svc)
	served = make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		_ = lis.Shutdown(context.Background())
	})
	return lis, svc, srv, served
}

// makeCall dials addr with a Dialer of its own and makes one Make call of
// 1 MiB (its payload out of band), checking the bytes; the Dialer and the
// ClientConn close when the test ends.
func makeCall(t *testing.T, addr string) {
	t.Helper()
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP))
	t.Cleanup(func() { _ = d.Close() })
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(nil)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	got, err := tensorpb.NewTensorServiceClient(cc).Make(ctx, &tensorpb.Sized{Size: 1 << 20, Seed: 1})
	require.NoError(t, err)
	defer gdrcodec.ReleaseAll(got)
	want := make([]byte, 1<<20)
	tensor.Fill(want, 1)
	sum, n, err := tensor.Checksum(got, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(len(want)), n)
	require.Equal(t, tensor.ChecksumBytes(want), sum, "the payload's bytes")
}

// Shutdown returns once the sessions the listener accepted are closed,
// whether the gRPC server stopped first (Stop, GracefulStop: their conns
// closed, the sessions lingering for their transfers) or not (Shutdown
// closes the conns).
func TestShutdownClosesSessions(t *testing.T) {
	for _, stop := range []string{"Stop", "GracefulStop", "none"} {
		t.Run(stop, func(t *testing.T) {
			lis, svc, srv, served := tensorServer(t, listener.ServerOptions(nil)...)
			makeCall(t, lis.Addr().String())
			s := <-svc.sessions
			require.NotNil(t, s)
			switch stop {
			case "Stop":
				srv.Stop()
			case "GracefulStop":
				srv.GracefulStop()
			}
			require.NoError(t, lis.Shutdown(context.Background()))
			select {
			case <-s.Released():
			default:
				t.Fatal("the server's session is still up after Shutdown")
			}
			if stop != "none" {
				require.NoError(t, <-served, "Serve's end")
			} else {
				require.ErrorIs(t, <-served, net.ErrClosed, "Serve's end: its listener closed under it")
			}
			require.NoError(t, lis.Shutdown(context.Background()), "a second Shutdown")
		})
	}
}

// A Shutdown whose context ends closes the sessions still lingering at
// once and returns the context's error.
func TestShutdownCut(t *testing.T) {
	lis, svc, srv, _ := tensorServer(t, listener.ServerOptions(nil)...)
	makeCall(t, lis.Addr().String())
	s := <-svc.sessions
	srv.Stop() // the session lingers for LingerIdle after its last transfer
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, lis.Shutdown(ctx), context.Canceled)
	select {
	case <-s.Released():
	default:
		t.Fatal("the server's session is still up after a cut Shutdown")
	}
}

// A server given ServerOptions twice (or listener.ServerOptions and
// gdrcodec.ServerOptions, which it already includes) serves as with them
// once: the second set of interceptors and stats handler leave the calls to
// the first (a response bound to its destination twice was taken for one
// sent on two calls at once, and failed with Internal).
func TestServerOptionsTwice(t *testing.T) {
	for _, tc := range []struct {
		name  string
		sopts []grpc.ServerOption
	}{
		{"ServerOptions twice", append(listener.ServerOptions(nil), listener.ServerOptions(nil)...)},
		{"with gdrcodec.ServerOptions", append(listener.ServerOptions(nil), gdrcodec.ServerOptions()...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lis, _, _, _ := tensorServer(t, tc.sopts...)
			makeCall(t, lis.Addr().String())
		})
	}
}

// A nil gdrpc.Option (an optional one left unset) is skipped.
func TestListenNilOption(t *testing.T) {
	lis, err := listener.Listen("127.0.0.1:0", nil, gdrpc.WithTransport(transport.ModeTCP))
	require.NoError(t, err)
	require.NoError(t, lis.Close())
}
