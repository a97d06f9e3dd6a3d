package listener_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// digestServer is the example tensor service with a Digest that also says
// what arrived and which session it came over.
type digestServer struct{ tensor.Server }

func (s *digestServer) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	// The request's payload arrived before the handler runs: in memory from
	// the receive allocator (gdrcodec.WithReceiveAllocator; host memory by
	// default, a GPU with devicebuf.NewCUDAAllocator). gRPC releases it when
	// the call ends; a handler that keeps it takes it with gdrcodec.Detach.
	b, _ := gdrcodec.Buffer(t.GetData())
	// The session the call came over: TCP here, since ModeAuto moves a
	// session onto UCX only between peers that trust each other
	// (gdrpc.WithTrustPeers on both sides).
	// A plain gRPC client's call came over no session.
	over := "no session (a plain gRPC client)"
	if sess := gdrpc.SessionFromContext(ctx); sess != nil {
		over = "session over " + sess.Transport()
	}
	fmt.Printf("handler: %d bytes in %s memory, %s\n", b.Len(), b.Kind(), over)
	return s.Server.Digest(ctx, t)
}

// A gRPC server over gdrpc: its listener accepts gdrpc sessions (and plain
// gRPC clients on the same port), and ServerOptions adds the out-of-band
// codec's server side. A gdrpc client sends it a 1 MiB payload, which moves
// out-of-band rather than inside the gRPC message.
func Example() {
	// Once, at start-up, before any gRPC server exists: the server finds the
	// "gdr" codec in gRPC's registry.
	gdrcodec.Register()

	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &digestServer{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop() // closes the listener and the sessions

	// A client (see package dialer).
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dialer.New().DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	p := make([]byte, 1<<20)
	tensor.Fill(p, 1)
	b := devicebuf.HostFromBytes(p)
	req := &tensorpb.Tensor{Data: gdrcodec.New(b)} // the message holds its own reference
	b.Release()
	defer gdrcodec.ReleaseAll(req)

	sum, err := tensorpb.NewTensorServiceClient(cc).Digest(context.Background(), req)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("server saw %d bytes, crc32c %08x, as sent: %v\n", sum.GetBytes(), sum.GetCrc32C(), sum.GetCrc32C() == tensor.ChecksumBytes(p))
	// Output:
	// handler: 1048576 bytes in host memory, session over tcp
	// server saw 1048576 bytes, crc32c 6b949523, as sent: true
}
