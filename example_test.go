package gdrpc_test

import (
	"context"
	"fmt"
	"log"
	"sync/atomic"

	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// received counts the payloads that arrived.
type received struct {
	gdrpc.NopMetrics // the events it does not count
	n, bytes         atomic.Int64
}

func (r *received) Transfer(i gdrpc.TransferInfo) {
	if i.Pull && i.Err == nil {
		r.n.Add(1)
		r.bytes.Add(i.Bytes)
	}
}

// Options scope to the Dialer or Listener they are given to: here both ends
// trust each other (one cluster), so the session may run over UCX, and both
// report their transfers to one Metrics (in one process a pull may take
// either end's session to the payload's owner).
func Example() {
	gdrcodec.Register()
	var m received
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithTrustPeers(), gdrpc.WithMetrics(&m))
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	d := dialer.New(gdrpc.WithTrustPeers(), gdrpc.WithMetrics(&m))
	defer d.Close() // after cc.Close: it ends the sessions the dialer made
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	t, err := tensorpb.NewTensorServiceClient(cc).Make(context.Background(), &tensorpb.Sized{Size: 4 << 20, Seed: 1})
	if err != nil {
		log.Fatal(err)
	}
	gdrcodec.ReleaseAll(t)
	fmt.Printf("%d payload of %d MiB arrived out-of-band\n", m.n.Load(), m.bytes.Load()>>20)
	// Output: 1 payload of 4 MiB arrived out-of-band
}
