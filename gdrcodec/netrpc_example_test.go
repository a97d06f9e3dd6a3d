package gdrcodec_test

import (
	"context"
	"fmt"
	"log"
	"net/rpc"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// Digests is a net/rpc service: its arguments and replies are protobuf
// messages, whose payloads move out-of-band as with gRPC.
type Digests struct{}

// Sum replies with the checksum of the payload that arrived. The server codec
// releases the request's buffers once the reply is written.
func (Digests) Sum(t *tensorpb.Tensor, s *tensorpb.Summary) error {
	sum, n, err := tensor.Checksum(t, 0)
	s.Name, s.Bytes, s.Crc32C = t.GetName(), n, sum
	return err
}

// net/rpc over gdrpc: the server serves each conn the gdrpc listener accepts
// with NewServerCodec, the client wraps a conn from a dialer with
// NewClientCodec. No Register is needed: net/rpc does not use gRPC's codec
// registry.
func Example_netRPC() {
	srv := rpc.NewServer()
	if err := srv.Register(Digests{}); err != nil {
		log.Fatal(err)
	}
	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	defer lis.Close()
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return // closed
			}
			go srv.ServeCodec(gdrcodec.NewServerCodec(c))
		}
	}()

	conn, err := dialer.New().DialContext(context.Background(), lis.Addr().String())
	if err != nil {
		log.Fatal(err)
	}
	client := rpc.NewClientWithCodec(gdrcodec.NewClientCodec(conn))
	defer client.Close() // closes the conn and its session

	p := make([]byte, 1<<20)
	tensor.Fill(p, 4)
	b := devicebuf.HostFromBytes(p) // or GPU memory from devicebuf.NewCUDAAllocator
	req := &tensorpb.Tensor{Name: "rpc", Data: gdrcodec.New(b)}
	b.Release()
	defer gdrcodec.ReleaseAll(req)

	var sum tensorpb.Summary
	if err := client.Call("Digests.Sum", req, &sum); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %d bytes, crc32c %08x, as sent: %v\n", sum.GetName(), sum.GetBytes(), sum.GetCrc32C(), sum.GetCrc32C() == tensor.ChecksumBytes(p))
	// Output:
	// rpc: 1048576 bytes, crc32c 3bfb1a87, as sent: true
}
