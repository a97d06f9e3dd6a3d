package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"runtime"
	"strconv"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
)

// verifyHeader asks the server to checksum what it received.
const verifyHeader = "gdrperf-verify"

// maxMsg is the message size limit both baseline ends raise to.
const maxMsg = 1<<31 - 1

// seedFor is the pattern seed of a size's payload (tensor.Fill).
func seedFor(size int) uint32 { return uint32(size) ^ 0x9e3779b9 }

// pattern returns the payload of a size, as both ends build it.
func pattern(size int) []byte { return variantPattern(size, 0) }

// variants is how many payloads of a size the server keeps for Make, each a
// pattern of its own: a call names one (Sized.Seed), and calls in turn
// alternate, so that a payload left over from the previous call, or another
// call's, is told from the one asked for.
const variants = 2

// variantPattern is payload variant v of a size. tensor.Fill's pattern
// repeats every 251 bytes from a start its seed sets (seed mod 251): the
// variants start 97 apart, so that no byte of one equals the same byte of
// another.
func variantPattern(size, v int) []byte {
	p := make([]byte, size)
	tensor.Fill(p, (seedFor(size)%251+uint32(v)*97)%251)
	return p
}

// readyInfo is what a server announces once it listens.
type readyInfo struct {
	GDRPC        string `json:"gdrpc"`         // gdrpc listener (host:port)
	GRPC         string `json:"grpc"`          // plain gRPC over TCP (host:port)
	PerftestPort int    `json:"perftest_port"` // ucx_perftest server port; 0: none
	PerftestNote string `json:"perftest_note,omitempty"`
	Procs        int    `json:"gomaxprocs,omitempty"` // the server's GOMAXPROCS; 0: not announced
	CPUs         string `json:"cpus,omitempty"`       // the CPUs the server may run on ("0-3"); "": not announced
}

// payloads keeps, per size, the buffers the server sends and receives into,
// so that each call measures the transfer and not the making of a payload.
type payloads struct {
	alloc devicebuf.Allocator // where gdrpc payloads live (host pool or GPU)
	cuda  devicebuf.Allocator // GPU memory for the naive baseline; nil for -mem host

	mu    sync.Mutex
	src   map[[2]int]*devicebuf.Buffer // gdrpc payloads in alloc memory, by size and variant
	plain map[int][]byte               // baseline payloads
	sinks map[int]*devicebuf.Buffer    // naive baseline: device destinations
}

func newPayloads(alloc, cuda devicebuf.Allocator) *payloads {
	return &payloads{alloc: alloc, cuda: cuda, src: map[[2]int]*devicebuf.Buffer{},
		plain: map[int][]byte{}, sinks: map[int]*devicebuf.Buffer{}}
}

// source returns variant v of the size's payload in alloc memory (kept for
// later calls).
func (p *payloads) source(size, v int) (*devicebuf.Buffer, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := [2]int{size, v}
	if b := p.src[k]; b != nil {
		return b, nil
	}
	b, err := filledVariant(p.alloc, size, v)
	if err != nil {
		return nil, err
	}
	p.src[k] = b
	return b, nil
}

// filled allocates size bytes from alloc holding pattern(size).
func filled(alloc devicebuf.Allocator, size int) (*devicebuf.Buffer, error) {
	return filledVariant(alloc, size, 0)
}

// filledVariant allocates size bytes from alloc holding variantPattern(size, v).
func filledVariant(alloc devicebuf.Allocator, size, v int) (*devicebuf.Buffer, error) {
	b, err := alloc.Alloc(size)
	if err != nil {
		return nil, fmt.Errorf("allocate %d bytes: %w", size, err)
	}
	src := devicebuf.HostFromBytes(variantPattern(size, v))
	defer src.Release()
	if err := devicebuf.Copy(b, src); err != nil {
		b.Release()
		return nil, fmt.Errorf("fill %d bytes: %w", size, err)
	}
	return b, nil
}

func (p *payloads) plainBytes(size int) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b := p.plain[size]; b != nil {
		return b
	}
	b := pattern(size)
	p.plain[size] = b
	return b
}

func (p *payloads) sink(size int) (*devicebuf.Buffer, error) {
	if p.cuda == nil {
		return nil, errors.New("no GPU memory in this process (-mem host)")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if b := p.sinks[size]; b != nil {
		return b, nil
	}
	b, err := p.cuda.Alloc(size)
	if err != nil {
		return nil, err
	}
	p.sinks[size] = b
	return b, nil
}

// Close releases every buffer kept.
func (p *payloads) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range p.src {
		b.Release()
	}
	for _, b := range p.sinks {
		b.Release()
	}
	clear(p.src)
	clear(p.sinks)
	clear(p.plain)
}

// perfServer is the server side of both services.
type perfServer struct {
	tensorpb.UnimplementedTensorServiceServer
	p *payloads
}

func verify(ctx context.Context) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	return len(md.Get(verifyHeader)) > 0
}

// Make returns the size's payload, variant Seed mod variants, out-of-band,
// from the kept buffer.
func (s *perfServer) Make(_ context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	if r.GetSize() == 0 || r.GetSize() > 1<<36 {
		return nil, status.Errorf(codes.InvalidArgument, "size %d", r.GetSize())
	}
	b, err := s.p.source(int(r.GetSize()), int(r.GetSeed()%variants))
	if err != nil {
		return nil, status.Error(codes.ResourceExhausted, err.Error())
	}
	// New takes its own reference; the server's stats handler drops it once the
	// response is sent, and the outbox keeps one until the client pulled.
	return &tensorpb.Tensor{Name: "gdrperf", Shape: []int64{int64(b.Len())}, Data: gdrcodec.New(b)}, nil
}

// Digest answers the size of the payload that arrived, and its checksum when
// asked to verify.
func (s *perfServer) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	defer gdrcodec.ReleaseAll(t)
	if verify(ctx) {
		sum, n, err := tensor.Checksum(t, 0)
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		return &tensorpb.Summary{Name: t.GetName(), Bytes: n, Crc32C: sum}, nil
	}
	var n uint64
	if b, ok := gdrcodec.Buffer(t.GetData()); ok {
		n = uint64(b.Len())
	}
	return &tensorpb.Summary{Name: t.GetName(), Bytes: n}, nil
}

// baseline is the plain gRPC side.
type baseline struct{ p *payloads }

func (b baseline) Make(_ context.Context, r *wrapperspb.UInt64Value) (*wrapperspb.BytesValue, error) {
	if r.GetValue() == 0 || r.GetValue() > 1<<31-1<<20 {
		return nil, status.Errorf(codes.InvalidArgument, "size %d", r.GetValue())
	}
	return wrapperspb.Bytes(b.p.plainBytes(int(r.GetValue()))), nil
}

func (b baseline) Push(ctx context.Context, r *wrapperspb.BytesValue) (*wrapperspb.UInt64Value, error) {
	if verify(ctx) {
		return wrapperspb.UInt64(uint64(tensor.ChecksumBytes(r.GetValue()))), nil
	}
	return wrapperspb.UInt64(uint64(len(r.GetValue()))), nil
}

// MakeNaive copies the device payload to fresh host memory and sends it.
func (b baseline) MakeNaive(_ context.Context, r *wrapperspb.UInt64Value) (*wrapperspb.BytesValue, error) {
	if b.p.cuda == nil {
		return nil, status.Error(codes.FailedPrecondition, "the server runs with -mem host")
	}
	if r.GetValue() == 0 || r.GetValue() > 1<<31-1<<20 {
		return nil, status.Errorf(codes.InvalidArgument, "size %d", r.GetValue())
	}
	src, err := b.p.source(int(r.GetValue()), 0)
	if err != nil {
		return nil, status.Error(codes.ResourceExhausted, err.Error())
	}
	out := make([]byte, src.Len())
	dst := devicebuf.HostFromBytes(out)
	defer dst.Release()
	if err := devicebuf.Copy(dst, src); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return wrapperspb.Bytes(out), nil
}

// PushNaive copies the received bytes into a device buffer.
func (b baseline) PushNaive(ctx context.Context, r *wrapperspb.BytesValue) (*wrapperspb.UInt64Value, error) {
	n := len(r.GetValue())
	if n == 0 {
		return nil, status.Error(codes.InvalidArgument, "empty payload")
	}
	dst, err := b.p.sink(n)
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	src := devicebuf.HostFromBytes(r.GetValue())
	defer src.Release()
	if err := devicebuf.Copy(dst, src); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if !verify(ctx) {
		return wrapperspb.UInt64(uint64(n)), nil
	}
	back := make([]byte, n)
	hb := devicebuf.HostFromBytes(back)
	defer hb.Release()
	if err := devicebuf.Copy(hb, dst); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return wrapperspb.UInt64(uint64(tensor.ChecksumBytes(back))), nil
}

// serve runs both servers (and a ucx_perftest server) until ctx ends. ready
// is called once they listen.
func serve(ctx context.Context, o *options, ready func(readyInfo), logf func(string, ...any)) error {
	alloc, cuda, err := o.allocators()
	if err != nil {
		return err
	}
	unregister, err := registerCodec(o, cuda)
	if err != nil {
		return err
	}
	defer unregister()
	p := newPayloads(alloc, cuda)
	defer p.Close()

	host, portStr, err := net.SplitHostPort(o.server)
	if err != nil {
		return fmt.Errorf("-server %q: %w", o.server, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return fmt.Errorf("-server %q: port: %w", o.server, err)
	}
	bin, note, err := perftestBinary(o.perftest)
	if err != nil {
		return err
	}
	offset := func(n int) string {
		if port == 0 {
			return net.JoinHostPort(host, "0")
		}
		return net.JoinHostPort(host, strconv.Itoa(port+n))
	}

	lis, err := listener.Listen(o.server, o.listenerOptions()...)
	if err != nil {
		return fmt.Errorf("gdrpc listener: %w", err)
	}
	gopts := listener.ServerOptions(insecure.NewCredentials())
	gopts = append(gopts, grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg))
	gs := grpc.NewServer(gopts...)
	tensorpb.RegisterTensorServiceServer(gs, &perfServer{p: p})

	bl, err := net.Listen("tcp", offset(1))
	if err != nil {
		gs.Stop() // its stream workers
		lis.Close()
		return fmt.Errorf("plain gRPC listener: %w", err)
	}
	bs := grpc.NewServer(grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg))
	bs.RegisterService(&baselineDesc, baseline{p: p})

	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Go(func() { errs <- gs.Serve(lis) })
	wg.Go(func() { errs <- bs.Serve(bl) })

	info := readyInfo{GDRPC: lis.Addr().String(), GRPC: bl.Addr().String(), Procs: runtime.GOMAXPROCS(0), CPUs: allowedCPUs()}
	if bin != "" {
		pp := port + 2
		if port == 0 {
			if pp, err = freePort(host); err != nil {
				pp = 0
				note = "no free port for ucx_perftest: " + err.Error()
			}
		}
		if pp != 0 {
			info.PerftestPort = pp
			wg.Go(func() { servePerftest(ctx, bin, pp, logf) })
		}
	}
	info.PerftestNote = note
	ready(info)

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errs:
	}
	gs.Stop()
	bs.Stop()
	wg.Wait()
	return serveErr
}

// perftestBinary finds ucx_perftest (flag "" looks it up in PATH; "none"
// skips it) and says why when it is not there: a note where the flag left
// it to PATH, an error where the flag named it.
func perftestBinary(flag string) (bin, note string, err error) {
	switch flag {
	case "none":
		return "", "ucx_perftest skipped (-perftest none)", nil
	case "":
		if bin, err = exec.LookPath("ucx_perftest"); err != nil {
			return "", "ucx_perftest not found (install ucx-utils): " + err.Error(), nil
		}
		return bin, "", nil
	}
	if bin, err = exec.LookPath(flag); err != nil {
		return "", "", fmt.Errorf("-perftest %q: %w", flag, err)
	}
	return bin, "", nil
}
