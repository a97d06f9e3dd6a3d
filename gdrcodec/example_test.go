package gdrcodec_test

import (
	"context"
	"fmt"
	"io"
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

// Device buffers through streams: a client stream sends several payloads and
// a server stream brings several back. Each message a stream sends may be
// released once Send returns (the outbox keeps its own reference until the
// server pulled it), but its buffer must not change until the call ends;
// each message a stream receives is the application's to release.
func Example_streams() {
	gdrcodec.Register()
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
	client := tensorpb.NewTensorServiceClient(cc)
	ctx := context.Background()

	// Upload: three 1 MiB payloads, one per message; the server answers with
	// their length and checksum.
	up, err := client.Upload(ctx)
	if err != nil {
		log.Fatal(err)
	}
	var bufs []*devicebuf.Buffer // written once, left alone until the call ends
	for i := range 3 {
		b, err := devicebuf.NewHostAllocator().Alloc(1 << 20)
		if err != nil {
			log.Fatal(err)
		}
		hb, _ := b.HostBytes()
		tensor.Fill(hb, uint32(i))
		bufs = append(bufs, b)
		msg := &tensorpb.Tensor{Name: "part", Data: gdrcodec.New(b)}
		err = up.Send(msg)
		gdrcodec.ReleaseAll(msg)
		if err != nil {
			log.Fatal(err)
		}
	}
	sum, err := up.CloseAndRecv()
	if err != nil {
		log.Fatal(err)
	}
	for _, b := range bufs {
		b.Release() // the call ended: the buffers are free to reuse
	}
	fmt.Printf("uploaded %d bytes, crc32c %08x\n", sum.GetBytes(), sum.GetCrc32C())

	// Download: four 1 MiB payloads, each complete when Recv returns it.
	down, err := client.Download(ctx, &tensorpb.Sized{Size: 1 << 20, Seed: 7})
	if err != nil {
		log.Fatal(err)
	}
	for {
		t, err := down.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			log.Fatal(err)
		}
		b, _ := gdrcodec.Buffer(t.GetData())
		p, _ := tensor.Bytes(t.GetData())
		fmt.Printf("%s: %d bytes in %s memory, crc32c %08x\n", t.GetName(), b.Len(), b.Kind(), tensor.ChecksumBytes(p))
		gdrcodec.ReleaseAll(t)
	}
	// Output:
	// uploaded 3145728 bytes, crc32c 035dc057
	// sized-1048576-7: 1048576 bytes in host memory, crc32c 1fcb5685
	// sized-1048576-8: 1048576 bytes in host memory, crc32c d2423852
	// sized-1048576-9: 1048576 bytes in host memory, crc32c f61b7e30
	// sized-1048576-10: 1048576 bytes in host memory, crc32c 31ae11f6
}
