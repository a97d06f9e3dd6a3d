package dialer_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// A gRPC client over gdrpc: the Dialer makes a gdrpc session per connection
// and DialOptions selects the out-of-band codec for every call of the
// ClientConn (the client needs no gdrcodec.Register). It asks the example
// tensor service for a 1 MiB payload, which arrives out-of-band, and gives
// the memory back when done.
func Example() {
	// A server (see package listener).
	gdrcodec.Register()
	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	// dialer.New takes package gdrpc's options (WithKeepAlive, WithTransport,
	// WithMetrics, ...). Sessions run over TCP unless the peers trust each
	// other (gdrpc.WithTrustPeers): then over UCX, where both ends have it.
	d := dialer.New()
	defer d.Close() // after cc.Close: returns once the session closed
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()

	var p peer.Peer
	t, err := tensorpb.NewTensorServiceClient(cc).Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: 1}, grpc.Peer(&p))
	if err != nil {
		log.Fatal(err)
	}
	// Nothing frees a received payload but ReleaseAll (or the Release of a
	// buffer taken with gdrcodec.Detach).
	defer gdrcodec.ReleaseAll(t)

	// The payload landed in memory from the receive allocator
	// (gdrcodec.WithReceiveAllocator; host memory by default).
	b, _ := gdrcodec.Buffer(t.GetData())
	got, _ := tensor.Bytes(t.GetData()) // host bytes: a GPU buffer would be copied
	want := make([]byte, 1<<20)
	tensor.Fill(want, 1)
	fmt.Printf("%d bytes in %s memory, crc32c %08x, as made: %v\n", b.Len(), b.Kind(),
		tensor.ChecksumBytes(got), tensor.ChecksumBytes(got) == tensor.ChecksumBytes(want))
	fmt.Println("session over", gdrpc.SessionFromPeer(&p).Transport())
	// Output:
	// 1048576 bytes in host memory, crc32c 6b949523, as made: true
	// session over tcp
}

// A pool of connections to one server: each call goes over the connection
// with the fewest in flight, each connection a session of its own, where one
// ClientConn would carry every call over one connection. Four calls made one
// after another on an idle pool take its four connections in turn.
func ExampleNewPool() {
	gdrcodec.Register()
	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	d := dialer.New()
	defer d.Close()
	pool, err := dialer.NewPool("passthrough:///"+lis.Addr().String(), 4, d.DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	client := tensorpb.NewTensorServiceClient(pool)

	sessions := map[*gdrpc.Session]bool{}
	intact := 0
	for i := range 4 {
		var p peer.Peer
		t, err := client.Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: uint32(i)}, grpc.Peer(&p))
		if err != nil {
			log.Fatal(err)
		}
		sessions[gdrpc.SessionFromPeer(&p)] = true
		got, _ := tensor.Bytes(t.GetData())
		want := make([]byte, 1<<20)
		tensor.Fill(want, uint32(i))
		if tensor.ChecksumBytes(got) == tensor.ChecksumBytes(want) {
			intact++
		}
		gdrcodec.ReleaseAll(t)
	}
	fmt.Printf("%d payloads as made, over %d sessions\n", intact, len(sessions))
	// Output:
	// 4 payloads as made, over 4 sessions
}
