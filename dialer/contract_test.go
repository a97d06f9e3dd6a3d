package dialer_test

// What a gRPC user expects of a Dialer at its edges: Shutdown after Close,
// nil options, the zero Dialer.

import (
	"context"
	"testing"

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

// Once Close returned, the Dialer's sessions are closed: a Shutdown after it
// has nothing to cut short and returns nil, whatever its context (with both
// ready, a select once returned ctx's error about half the time).
func TestShutdownAfterClose(t *testing.T) {
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP))
	require.NoError(t, d.Close())
	done, cancel := context.WithCancel(context.Background())
	cancel()
	failed := 0
	for range 64 {
		if d.Shutdown(done) != nil {
			failed++
		}
	}
	require.Zero(t, failed, "of 64 Shutdowns after Close, this many returned the context's error though nothing was left to cut")
}

// A nil gdrpc.Option (say, an optional one left unset in a slice) does not
// panic New.
func TestNilOptions(t *testing.T) {
	require.NotPanics(t, func() {
		d := dialer.New(nil, gdrpc.WithTransport(transport.ModeTCP))
		_ = d.Close()
	})
}

// The zero Dialer is New() with no options: its calls move payloads out of
// band (it dialed sessions with no out-of-band engine, and every call failed
// with FailedPrecondition).
func TestZeroDialer(t *testing.T) {
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithTransport(transport.ModeTCP))
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	defer func() {
		srv.Stop()
		<-served
	}()

	var d dialer.Dialer
	defer d.Close()
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(nil)...)
	require.NoError(t, err)
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	got, err := tensorpb.NewTensorServiceClient(cc).Make(ctx, &tensorpb.Sized{Size: 1 << 20, Seed: 3})
	require.NoError(t, err, "a call over the zero Dialer")
	gdrcodec.ReleaseAll(got)
}
