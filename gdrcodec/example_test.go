package gdrcodec_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// Device buffers through a gRPC call: attach a buffer to a request, receive
// the one the response brings, and release it. The example tensor service's
// Echo sends the request's payload back; both directions move out-of-band.
func Example() {
	gdrcodec.Register() // once, at start-up: the server finds the gdr codec here
	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dialer.New().DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()

	// A 1 MiB buffer in host memory. With a GPU, allocate it with
	// devicebuf.NewCUDAAllocator(0) and fill it with your kernels instead; its
	// contents must be complete (the kernels' streams synchronized) when the
	// call starts.
	b, err := devicebuf.NewHostAllocator().Alloc(1 << 20)
	if err != nil {
		log.Fatal(err)
	}
	hb, _ := b.HostBytes()
	tensor.Fill(hb, 2)
	req := &tensorpb.Tensor{Name: "t", Data: gdrcodec.New(b)} // the message takes its own reference
	b.Release()
	// The request holds its buffer until released: the call reads it while
	// the server pulls it.
	defer gdrcodec.ReleaseAll(req)

	resp, err := tensorpb.NewTensorServiceClient(cc).Echo(context.Background(), req)
	if err != nil {
		log.Fatal(err)
	}
	// The response's payload is complete when the call returns and stays
	// allocated until released: nothing else frees it.
	defer gdrcodec.ReleaseAll(resp)
	got, _ := gdrcodec.Buffer(resp.GetData())
	p, _ := tensor.Bytes(resp.GetData()) // a host view, or a copy of GPU memory
	fmt.Printf("%s: %d bytes in %s memory, crc32c %08x\n", resp.GetName(), got.Len(), got.Kind(), tensor.ChecksumBytes(p))
	fmt.Println("same bytes:", tensor.ChecksumBytes(p) == tensor.ChecksumBytes(hb))
	// Output:
	// t: 1048576 bytes in host memory, crc32c 0097d503
	// same bytes: true
}

// keeper is a tensor service whose Echo keeps the payload it received for
// later use and answers with its length only.
type keeper struct {
	tensor.Server
	kept chan *devicebuf.Buffer
}

func (k *keeper) Echo(_ context.Context, t *tensorpb.Tensor) (*tensorpb.Tensor, error) {
	// Without Detach the request's buffer is released when the call ends.
	k.kept <- gdrcodec.Detach(t.GetData())
	return &tensorpb.Tensor{Name: t.GetName(), Shape: []int64{int64(t.GetData().GetLength())}}, nil
}

// A handler that keeps a received payload past its call takes it with Detach
// and releases it when done.
func ExampleDetach() {
	gdrcodec.Register()
	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	k := &keeper{kept: make(chan *devicebuf.Buffer, 1)}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, k)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dialer.New().DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()

	p := make([]byte, 256<<10)
	tensor.Fill(p, 3)
	b := devicebuf.HostFromBytes(p)
	req := &tensorpb.Tensor{Name: "kept", Data: gdrcodec.New(b)}
	b.Release()
	defer gdrcodec.ReleaseAll(req)
	resp, err := tensorpb.NewTensorServiceClient(cc).Echo(context.Background(), req)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.GetName(), resp.GetShape())

	// The call is over; the server's buffer is still allocated and readable.
	kept := <-k.kept
	hb, _ := kept.HostBytes()
	fmt.Println("kept:", kept.Len(), "bytes, same:", tensor.ChecksumBytes(hb) == tensor.ChecksumBytes(p))
	kept.Release() // back to its pool
	// Output:
	// kept [262144]
	// kept: 262144 bytes, same: true
}
