package gdrcodec_test

import (
	"bytes"
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/oobleak"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

func TestMain(m *testing.M) {
	gpuServerChild() // returns unless this process is a test's server child
	registerChild()  // likewise for TestConcurrentRegister's child
	gdrcodec.Register()
	before := runtime.NumGoroutine()
	os.Exit(leaktest.Run(m, func() error {
		if err := oobleak.Settled(before); err != nil {
			return err
		}
		// Settled waited for collected messages to be reported.
		if n := gdrcodec.Leaked() - leaksMade.Load(); n != 0 {
			return fmt.Errorf("%d messages collected with buffers attached (not released)", n)
		}
		return nil
	}))
}

func requireUCX(t testing.TB) {
	t.Helper()
	testenv.Need(t, "ucx", rdma.Available())
}

// pathCounter records the routes transfers took: pulls (this process received)
// in paths, pushes (this process sent) in pushes.
type pathCounter struct {
	mu     sync.Mutex
	paths  map[string]int
	pushes map[string]int
	queued int // pulls of payloads whose copy the owner queued (TransferInfo.Queued)
}

func (p *pathCounter) Transfer(i oob.TransferInfo) {
	if i.Err != nil {
		return
	}
	route := i.Route()
	if i.Advertised {
		route += "@space"
	}
	p.mu.Lock()
	if i.Pull {
		p.paths[route]++
		if i.Queued {
			p.queued++
		}
	} else {
		if p.pushes == nil {
			p.pushes = map[string]int{}
		}
		p.pushes[route]++
	}
	p.mu.Unlock()
}

// takeQueued returns how many pulls were of queued copies since the last call.
func (p *pathCounter) takeQueued() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := p.queued
	p.queued = 0
	return n
}

// takePushes returns the pushes since the last call.
func (p *pathCounter) takePushes() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.pushes
	p.pushes = nil
	return m
}

func (p *pathCounter) Fallback(oob.Path, oob.Path, string) {}

func (p *pathCounter) reset() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.paths
	p.paths = map[string]int{}
	return m
}

type rig struct {
	client tensorpb.TensorServiceClient
	cc     *grpc.ClientConn
	paths  *pathCounter
	server *grpc.Server
	lis    *closeNotifyListener // what server serves, over whatever wrap made
}

// closeNotifyListener closes closed when Close is first called: a test
// that closes the listener itself (its Shutdown) expects Serve to fail.
type closeNotifyListener struct {
	net.Listener
	once   sync.Once
	closed chan struct{}
}

func (l *closeNotifyListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// processEngine makes a face's sessions use the engine with the process's
// configuration (oob.SetTransferConfig), which the tests set.
var processEngine = gdrpc.WithSessionOptions(transport.WithEngine(oob.Engine()))

// newRig starts a TensorService on a gdrpc listener in mode and dials it.
func newRig(t testing.TB, mode transport.Mode, srv tensorpb.TensorServiceServer, opts ...gdrpc.Option) *rig {
	t.Helper()
	return newRigWith(t, mode, srv, nil, opts...)
}

// newRigWith is newRig with server options of gRPC's added, before the
// rig's own: their stats handlers run first.
func newRigWith(t testing.TB, mode transport.Mode, srv tensorpb.TensorServiceServer, serverOpts []grpc.ServerOption, opts ...gdrpc.Option) *rig {
	t.Helper()
	return newRigWrapped(t, mode, srv, serverOpts, nil, opts...)
}

// newRigWrapped is newRigWith with the server serving the listener wrap
// makes of gdrpc's (nil: gdrpc's itself).
func newRigWrapped(t testing.TB, mode transport.Mode, srv tensorpb.TensorServiceServer, serverOpts []grpc.ServerOption, wrap func(net.Listener) net.Listener, opts ...gdrpc.Option) *rig {
	t.Helper()
	if mode == transport.ModeUCX {
		requireUCX(t)
	}
	// A pull may take any live session to the owner (this process): start
	// with none of an earlier test's left, whose engine would not report here.
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	pc := &pathCounter{paths: map[string]int{}}
	// A 256 MiB pull over a TCP session under the race detector took over
	// 20 s once, on a 2-core machine running the other packages' tests.
	oob.SetTransferConfig(oob.TransferConfig{Metrics: pc, Timeout: time.Minute})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })

	opts = append([]gdrpc.Option{gdrpc.WithTransport(mode), processEngine}, opts...)
	var lis net.Listener
	lis, err := listener.Listen("127.0.0.1:0", opts...)
	require.NoError(t, err)
	if wrap != nil {
		lis = wrap(lis)
	}
	cn := &closeNotifyListener{Listener: lis, closed: make(chan struct{})}
	lis = cn
	gs := grpc.NewServer(slices.Concat(serverOpts, listener.ServerOptions(insecure.NewCredentials()))...)
	if srv == nil {
		srv = &tensor.Server{}
	}
	tensorpb.RegisterTensorServiceServer(gs, srv)
	healthpb.RegisterHealthServer(gs, health.NewServer()) // a service whose messages carry no payloads
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()

	d := dialer.New(opts...)
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	t.Cleanup(func() {
		cc.Close()
		var closedFirst bool // by the test: Serve then fails
		select {
		case <-cn.closed:
			closedFirst = true
		default:
		}
		gs.Stop()
		if err := <-served; !closedFirst {
			require.NoError(t, err)
		}
		// The next test starts with no session of this one left.
		require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	})
	return &rig{client: tensorpb.NewTensorServiceClient(cc), cc: cc, paths: pc, server: gs, lis: cn}
}

func pattern(n int, seed uint32) []byte {
	p := make([]byte, n)
	tensor.Fill(p, seed)
	return p
}

var sizes = []int{0, 1, 64<<10 - 1, 64 << 10, 64<<10 + 1, 1 << 20, 16 << 20}

func TestOutOfBand(t *testing.T) {
	for _, mode := range []transport.Mode{transport.ModeTCP, transport.ModeUCX} {
		t.Run("transport="+string(mode), func(t *testing.T) {
			r := newRig(t, mode, nil)
			// Over a TCP session host payloads travel inline up to the
			// stream threshold, where a pull's round trip costs more.
			wantPath, threshold := "stream", gdrcodec.StreamEagerThreshold
			if mode == transport.ModeUCX {
				wantPath, threshold = "rdma", gdrcodec.DefaultEagerThreshold
			}
			all := append(slices.Clone(sizes), gdrcodec.StreamEagerThreshold-1, gdrcodec.StreamEagerThreshold)
			if !testing.Short() {
				all = append(all, 256<<20)
			}
			for _, n := range all {
				t.Run(fmt.Sprintf("size=%d", n), func(t *testing.T) {
					ctx := context.Background()
					want := pattern(n, uint32(n))

					// Request payload out-of-band (client owns, server pulls), in a
					// DeviceBuffer and a marked bytes field.
					src := devicebuf.HostFromBytes(want)
					req := &tensorpb.Tensor{Name: "up", Data: gdrcodec.New(src), Blob: want}
					src.Release()
					sum, err := r.client.Digest(ctx, req)
					require.NoError(t, err)
					require.Equal(t, uint64(2*n), sum.Bytes)
					crc := tensor.ChecksumBytes(want)
					require.Equal(t, crcTwice(want), sum.Crc32C)
					gdrcodec.ReleaseAll(req)

					// Response payload out-of-band (server owns, client pulls).
					for _, blob := range []bool{false, true} {
						got, err := r.client.Make(ctx, &tensorpb.Sized{Size: uint64(n), Seed: uint32(n), Blob: blob})
						require.NoError(t, err)
						if blob {
							requireBytes(t, want, got.Blob)
						} else {
							b, err := tensor.Bytes(got.Data)
							require.NoError(t, err)
							require.Equal(t, crc, tensor.ChecksumBytes(b))
							requireBytes(t, want, b)
						}
						gdrcodec.ReleaseAll(got)
					}
					paths := r.paths.reset()
					if n >= threshold {
						require.Equal(t, map[string]int{wantPath: 4}, paths, "client and server pulls")
					} else {
						require.Empty(t, paths, "below the eager threshold payloads travel inline")
					}
				})
			}
		})
	}
}

func crcTwice(p []byte) uint32 {
	s := tensor.ChecksumBytes(p)
	return crc32Update(s, p)
}

// Payloads in a map's values travel as those of any other field, inline
// and out-of-band, over either transport: each name gets its bytes back,
// the message sent keeps its own, and once both are released nothing is
// attached or offered.
func TestEchoMapPayloads(t *testing.T) {
	for _, mode := range []transport.Mode{transport.ModeTCP, transport.ModeUCX} {
		t.Run("transport="+string(mode), func(t *testing.T) {
			r := newRig(t, mode, nil)
			sizes := map[string]int{"empty": 0, "small": 1 << 10, "large": 1 << 20, "larger": 3<<20 + 1}
			in := &tensorpb.Tensor{Name: "map", Named: map[string]*gdrv1.DeviceBuffer{}}
			seed := uint32(0)
			for name, n := range sizes {
				seed++
				b := devicebuf.HostFromBytes(pattern(n, seed))
				in.Named[name] = gdrcodec.New(b)
				b.Release()
			}
			out, err := r.client.Echo(context.Background(), in)
			require.NoError(t, err)
			pulled := 0
			for _, n := range r.paths.reset() {
				pulled += n
			}
			require.Equal(t, 4, pulled, "the two large payloads, each way, out-of-band")
			require.Len(t, out.Named, len(sizes))
			for name, db := range out.Named {
				got, err := tensor.Bytes(db)
				require.NoError(t, err, name)
				sent, err := tensor.Bytes(in.Named[name])
				require.NoError(t, err, name)
				require.Len(t, got, sizes[name], name)
				requireBytes(t, sent, got)
			}
			gdrcodec.ReleaseAll(out)
			gdrcodec.ReleaseAll(in)
			require.Zero(t, gdrcodec.Attached(), "attachments left")
			require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond, "offered payloads left")
		})
	}
}

func TestEchoAndStreams(t *testing.T) {
	r := newRig(t, transport.ModeAuto, nil)
	ctx := context.Background()
	parts := make([]*gdrv1.DeviceBuffer, 3)
	var all []byte
	for i := range parts {
		p := pattern(200<<10+i, uint32(i))
		all = append(all, p...)
		b := devicebuf.HostFromBytes(p)
		parts[i] = gdrcodec.New(b)
		b.Release()
	}
	in := &tensorpb.Tensor{Name: "echo", Parts: parts, Shape: []int64{1, 2, 3}}
	out, err := r.client.Echo(ctx, in)
	require.NoError(t, err)
	require.True(t, proto.Equal(&tensorpb.Tensor{Name: "echo", Shape: []int64{1, 2, 3}}, &tensorpb.Tensor{Name: out.Name, Shape: out.Shape}))
	require.Len(t, out.Parts, 3)
	var got []byte
	for _, db := range out.Parts {
		p, err := tensor.Bytes(db)
		require.NoError(t, err)
		got = append(got, p...)
	}
	requireBytes(t, all, got)
	gdrcodec.ReleaseAll(in)
	gdrcodec.ReleaseAll(out)

	// Client streaming: every message's payload pulled by the server.
	up, err := r.client.Upload(ctx)
	require.NoError(t, err)
	var crc uint32
	var n uint64
	for i := range 5 {
		p := pattern(100<<10*(i+1), uint32(i))
		crc = crc32Update(crc, p)
		n += uint64(len(p))
		require.NoError(t, up.Send(&tensorpb.Tensor{Blob: p}))
	}
	sum, err := up.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, n, sum.Bytes)
	require.Equal(t, crc, sum.Crc32C)

	// Server streaming.
	down, err := r.client.Download(ctx, &tensorpb.Sized{Size: 300 << 10, Seed: 9})
	require.NoError(t, err)
	for i := range uint32(4) {
		tn, err := down.Recv()
		require.NoError(t, err)
		p, err := tensor.Bytes(tn.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(300<<10, 9+i), p)
		gdrcodec.ReleaseAll(tn)
	}
	_, err = down.Recv()
	require.Equal(t, io.EOF, err)
}

// A payload that happens to begin with the marker of an out-of-band bytes field
// still arrives as itself.
func TestBytesFieldLookingLikeADescriptor(t *testing.T) {
	r := newRig(t, transport.ModeAuto, nil)
	p := append([]byte("\x00\xffgdrpc\x00\x01"), "not a descriptor"...)
	out, err := r.client.Echo(context.Background(), &tensorpb.Tensor{Blob: p})
	require.NoError(t, err)
	require.Equal(t, p, out.Blob)
}

// Device memory from the fake GPU (which faults on any CPU touch) goes out and
// comes back byte-exact, landing in fake GPU memory on the receiver, over every
// path: CUDA IPC, staged through registered host memory over UCX, the stream.
func TestFakeGPU(t *testing.T) {
	devicebuftest.Install(t, 1)
	// Host pool regions get pinned with the fake driver: give them back before it goes.
	t.Cleanup(func() { require.NoError(t, oob.CloseHostPools()) })
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	tests := []struct {
		name  string
		mode  transport.Mode
		paths oob.Path
		chunk int  // staging chunk: the stream path's bounce buffers
		trust bool // TrustPeers: CUDA IPC needs it
		want  string
	}{
		{name: "cuda-ipc", mode: transport.ModeTCP, paths: oob.PathCUDAIPC, chunk: 1 << 20, trust: true, want: "cuda-ipc"},
		{name: "cuda-ipc-untrusted", mode: transport.ModeTCP, paths: oob.PathCUDAIPC, chunk: 1 << 20, want: "stream"},
		{name: "staged-ucx", mode: transport.ModeUCX, paths: oob.PathRDMA, chunk: 1 << 20, want: "staged"},
		// Bounce buffers that do not line up with the bulk lane's pieces.
		{name: "stream", mode: transport.ModeTCP, paths: oob.PathStream, chunk: 300<<10 + 1, want: "stream"},
		{name: "stream-ucx", mode: transport.ModeUCX, paths: oob.PathStream, chunk: 1 << 20, want: "stream"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var trust []gdrpc.Option
			if tt.trust {
				trust = append(trust, gdrpc.WithTrustPeers())
			}
			r := newRig(t, tt.mode, &tensor.Server{Alloc: gpu}, trust...)
			// The rendezvous alone (receive space: space_test.go).
			oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Paths: tt.paths, StagingChunk: tt.chunk, ReceiveSpace: -1})
			gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
			t.Cleanup(func() { gdrcodec.Register() })
			for _, n := range []int{1, 64 << 10, 5<<20 + 3} {
				want := pattern(n, 3)
				got, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: uint64(n), Seed: 3})
				require.NoError(t, err)
				b, ok := gdrcodec.Buffer(got.Data)
				require.True(t, ok)
				require.Equal(t, devicebuf.CUDA, b.Kind(), "received into GPU memory")
				p, err := tensor.Bytes(got.Data)
				require.NoError(t, err)
				requireBytes(t, want, p)

				sum, err := r.client.Digest(context.Background(), got)
				require.NoError(t, err)
				require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)
				gdrcodec.ReleaseAll(got)
				paths := r.paths.reset()
				if n >= gdrcodec.DefaultEagerThreshold {
					require.Equal(t, map[string]int{tt.want: 2}, paths)
				}
			}
		})
	}
}

// A descriptor naming a token nobody holds fails the call with NotFound.
func TestUnknownToken(t *testing.T) {
	r := newRig(t, transport.ModeAuto, nil)
	// Forge a descriptor naming the server's process (our own, in this test) with a
	// token that was never offered, by withdrawing a real one before the call.
	b := devicebuf.HostFromBytes(pattern(1<<20, 1))
	db := gdrcodec.New(b)
	b.Release()
	body, err := gdrcodec.MarshalForTest(&tensorpb.Tensor{Data: db})
	require.NoError(t, err)
	var forged tensorpb.Tensor
	require.NoError(t, proto.Unmarshal(body, &forged))
	d, outOfBand, err := gdrcodec.ParseDescriptor(forged.Data)
	require.NoError(t, err)
	require.True(t, outOfBand)
	oob.Withdraw(d.Token)
	gdrcodec.ReleaseAll(&forged)
	gdrcodec.Detach(db).Release()

	_, err = r.client.Digest(context.Background(), &forged)
	require.Equal(t, codes.NotFound, status.Code(err), "%v", err)
}

// A plain gRPC client (standard TCP dial, default proto codec) gets the payload
// inline from a gdrpc server.
func TestPlainClient(t *testing.T) {
	lis, err := listener.Listen("127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(listener.ServerOptions(insecure.NewCredentials())...)
	tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{})
	go gs.Serve(lis)
	defer gs.Stop()

	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		}))
	require.NoError(t, err)
	defer cc.Close()
	c := tensorpb.NewTensorServiceClient(cc)
	n := 3 << 20
	got, err := c.Make(context.Background(), &tensorpb.Sized{Size: uint64(n), Seed: 5})
	require.NoError(t, err)
	p, err := tensor.Bytes(got.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(n, 5), p)
	gdrcodec.ReleaseAll(got)

	// And a plain client that names the gdr subtype is refused clearly.
	_, err = c.Make(context.Background(), &tensorpb.Sized{Size: 1}, grpc.CallContentSubtype(gdrcodec.Name))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
}

func crc32Update(crc uint32, p []byte) uint32 {
	return crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), p)
}

// requireBytes compares payloads without printing megabytes on a mismatch.
func requireBytes(t testing.TB, want, got []byte) {
	t.Helper()
	if bytes.Equal(want, got) {
		return
	}
	i := 0
	for i < len(want) && i < len(got) && want[i] == got[i] {
		i++
	}
	t.Fatalf("payload differs: want %d bytes, got %d; first difference at byte %d", len(want), len(got), i)
}

// A plain client's request with more than MaxPayloads DeviceBuffers is
// refused with ResourceExhausted before it is decoded, and its handler
// never runs; the connection goes on serving.
func TestPlainClientTooManyPayloads(t *testing.T) {
	lis, err := listener.Listen("127.0.0.1:0")
	require.NoError(t, err)
	var handled atomic.Int64
	gs := grpc.NewServer(listener.ServerOptions(insecure.NewCredentials())...)
	tensorpb.RegisterTensorServiceServer(gs, &countingTensors{Server: &tensor.Server{}, calls: &handled})
	go gs.Serve(lis)
	defer gs.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	c := tensorpb.NewTensorServiceClient(cc)
	m := &tensorpb.Tensor{}
	for range gdrcodec.MaxPayloads + 1 {
		m.Parts = append(m.Parts, &gdrv1.DeviceBuffer{})
	}
	_, err = c.Digest(context.Background(), m)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "more than 4096 payloads")
	require.Zero(t, handled.Load(), "the handler ran")
	m.Parts = m.Parts[:1]
	_, err = c.Digest(context.Background(), m)
	require.NoError(t, err)
	require.Equal(t, int64(1), handled.Load())
}

// countingTensors counts the Digest calls its handler runs.
type countingTensors struct {
	*tensor.Server
	calls *atomic.Int64
}

func (s *countingTensors) Digest(ctx context.Context, m *tensorpb.Tensor) (*tensorpb.Summary, error) {
	s.calls.Add(1)
	return s.Server.Digest(ctx, m)
}
