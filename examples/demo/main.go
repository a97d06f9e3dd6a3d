// Command demo moves a 64 MiB buffer through a gRPC service out-of-band and
// compares it with plain gRPC over TCP, measured in the same run.
//
// It starts itself a second time as the server (two processes, as in real
// use), then calls TensorService.Make twice over:
//
//   - as a gdrpc client: the payload leaves the response as a descriptor and
//     the bytes move out-of-band (UCX put into registered memory, or the
//     session's bulk stream without UCX), into memory this process
//     registered;
//   - as a plain gRPC client over TCP, on the same port: the server sends the
//     same payload inline in the protobuf body, as gRPC always does.
//
// Run it with "make demo" or "go run ./examples/demo". GDRPC_TRANSPORT=tcp
// forces the fallback without UCX.
package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// listeningOn starts the line on which the server announces its address (its
// stdout may carry other lines, UCX's log for one).
const listeningOn = "demo server listening on "

const (
	size  = 64 << 20 // the payload
	seed  = 42       // byte i of the payload is (seed + 7*i) mod 251
	calls = 5        // timed calls per client; the median is printed
)

func main() {
	log.SetFlags(0)
	log.SetPrefix("demo: ")
	gdrcodec.Register() // the gdr codec, and a proto codec that inlines for plain peers
	switch {
	case len(os.Args) == 2 && os.Args[1] == "-serve":
		serve()
		return
	case len(os.Args) > 1:
		log.Fatalf("takes no arguments (got %q): it moves a %d MiB payload %d times, as the README describes", os.Args[1:], size>>20, calls)
	}
	if err := run(os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// ---- the server (the child process) ------------------------------------------

// server is the example TensorService with one payload made in advance: the
// demo measures moving bytes, not making them.
type server struct {
	tensor.Server
	payload *devicebuf.Buffer
}

// Make attaches the payload to the response. With a gdrpc client only a
// descriptor travels in the response; a plain client gets the bytes inline.
func (s *server) Make(_ context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	if r.GetSize() != size || r.GetSeed() != seed {
		return tensor.Make(nil, r) // anything else: the example service's own Make
	}
	return &tensorpb.Tensor{Name: "demo", Shape: []int64{size}, Data: gdrcodec.New(s.payload)}, nil
}

// serve listens on a free port, prints it, and serves until stdin closes.
func serve() {
	payload, err := gdrpc.HostMemory().Alloc(size)
	if err != nil {
		log.Fatal(err)
	}
	defer payload.Release()
	p, _ := payload.HostBytes() // host memory: the CPU may write it
	tensor.Fill(p, seed)

	// Both ends are this program on this host: they trust each other, so the
	// session may move onto UCX (gdrpc.ModeAuto).
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithTrustPeers())
	if err != nil {
		log.Fatal(err)
	}
	opts := listener.ServerOptions(insecure.NewCredentials())
	gs := grpc.NewServer(opts...)
	tensorpb.RegisterTensorServiceServer(gs, &server{payload: payload})
	go func() {
		io.Copy(io.Discard, os.Stdin) // the parent is done (or gone)
		gs.Stop()
	}()
	fmt.Println(listeningOn + lis.Addr().String()) // what the parent waits for
	if err := gs.Serve(lis); err != nil {
		log.Fatal(err)
	}
	// The sessions close once the client pulled what it was sent.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := lis.Shutdown(ctx); err != nil {
		log.Print("sessions cut short: ", err)
	}
}

// ---- the client ---------------------------------------------------------------

// paths records the out-of-band paths that payloads took (the metrics hook).
type paths struct {
	gdrpc.NopMetrics
	mu   sync.Mutex
	seen []string
}

func (p *paths) Transfer(i gdrpc.TransferInfo) {
	if i.Pull && i.Err == nil {
		p.mu.Lock()
		if !slices.Contains(p.seen, i.Route()) {
			p.seen = append(p.seen, i.Route())
		}
		p.mu.Unlock()
	}
}

func (p *paths) TransferFallback(wanted, took gdrpc.Path, reason string) {
	log.Printf("fallback from %s to %s: %s", wanted, took, reason)
}

// run measures both clients and prints the comparison to w.
func run(w io.Writer) error {
	addr, stop, err := startServer()
	if err != nil {
		return err
	}
	defer stop()

	want := make([]byte, size)
	tensor.Fill(want, seed)
	wantSum := tensor.ChecksumBytes(want)
	req := &tensorpb.Sized{Size: size, Seed: seed}

	// gdrpc: the gdrpc dialer; its options bring the gdr codec and its interceptors.
	pathLog := &paths{}
	d := dialer.New(gdrpc.WithTrustPeers(), gdrpc.WithMetrics(pathLog)) // the server is this program
	defer d.Close()                                                     // after gc.Close: its session closes cleanly
	opts := d.DialOptions(insecure.NewCredentials())
	gc, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		return err
	}
	defer gc.Close()
	var session peer.Peer
	gdrpcTime, err := timeCalls(tensorpb.NewTensorServiceClient(gc), req, wantSum, grpc.Peer(&session))
	if err != nil {
		return fmt.Errorf("gdrpc: %w", err)
	}
	over := "?"
	if s := gdrpc.SessionFromPeer(&session); s != nil {
		over = s.Transport()
	}

	// Plain gRPC over TCP to the same server: an ordinary client, with the
	// message size limit raised for a 64 MiB response.
	pc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(size+1<<20)))
	if err != nil {
		return err
	}
	defer pc.Close()
	plainTime, err := timeCalls(tensorpb.NewTensorServiceClient(pc), req, wantSum)
	if err != nil {
		return fmt.Errorf("plain gRPC: %w", err)
	}

	mibs := func(d time.Duration) float64 { return size / float64(1<<20) / d.Seconds() }
	pathLog.mu.Lock()
	took := pathLog.seen
	pathLog.mu.Unlock()
	fmt.Fprintf(w, "A %d MiB payload from a gRPC server in another process (median of %d calls, checksums verified):\n", size>>20, calls)
	gdrpcLabel := fmt.Sprintf("gdrpc, out-of-band (path %s, session over %s):", strings.Join(took, "+"), over)
	fmt.Fprintf(w, "  %-52s %8.1f ms %8.0f MiB/s\n", gdrpcLabel, ms(gdrpcTime), mibs(gdrpcTime))
	fmt.Fprintf(w, "  %-52s %8.1f ms %8.0f MiB/s\n", "plain gRPC over TCP, inline:", ms(plainTime), mibs(plainTime))
	fmt.Fprintf(w, "  gdrpc is %.1fx plain gRPC\n", plainTime.Seconds()/gdrpcTime.Seconds())
	fmt.Fprintln(w, "  (both ends use gdrpc.WithTrustPeers(): without it, sessions run over TCP and payloads take the stream path)")
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// timeCalls makes one untimed call, then returns the median time of the next
// calls; it checks every call's payload, outside the time it takes.
func timeCalls(c tensorpb.TensorServiceClient, req *tensorpb.Sized, wantSum uint32, opts ...grpc.CallOption) (time.Duration, error) {
	var times []time.Duration
	for i := range calls + 1 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		start := time.Now()
		t, err := c.Make(ctx, req, opts...)
		elapsed := time.Since(start)
		cancel()
		if err != nil {
			return 0, err
		}
		sum, n, err := tensor.Checksum(t, 0)
		gdrcodec.ReleaseAll(t) // give the received buffer back to its pool
		if err != nil {
			return 0, err
		}
		if n != size || sum != wantSum {
			return 0, fmt.Errorf("call %d: received %d bytes with CRC-32C %#x, want %d bytes with %#x", i, n, sum, size, wantSum)
		}
		if i > 0 {
			times = append(times, elapsed)
		}
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}

// startServer starts this program again as the server and returns its
// address and a function that stops it.
func startServer() (string, func(), error) {
	exe, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(exe, "-serve")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	// The server's stdout: find its address, pass everything else on.
	addr := make(chan string, 1)
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if _, a, ok := strings.Cut(sc.Text(), listeningOn); ok {
				addr <- a
				continue
			}
			fmt.Fprintln(os.Stderr, sc.Text())
		}
	}()
	stop := func() {
		stdin.Close() // the server stops when its stdin closes
		select {
		case <-drained: // it exited: its stdout closed
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-drained
		}
		cmd.Wait()
	}
	select {
	case a := <-addr:
		return a, stop, nil
	case <-drained:
		stop()
		return "", nil, fmt.Errorf("the server exited before it listened")
	case <-time.After(30 * time.Second):
		stop()
		return "", nil, fmt.Errorf("the server did not start within 30s")
	}
}
