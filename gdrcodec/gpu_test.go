package gdrcodec_test

import (
	"bufio"
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// The GPU service test: two processes on one GPU, a TensorService whose
// request and response payloads live in GPU memory on both sides, over every
// path, byte-exact. The server is this test binary re-executed.

const (
	envGPUChild = "GDRPC_TEST_GPU_SERVER" // set in the child: the transport mode
	envPaths    = "GDRPC_TEST_PATHS"      // the allowed path mask, both processes
	envGPU      = "GDRPC_TEST_GPU"        // the child's CUDA ordinal
	envHostMem  = "GDRPC_TEST_HOST_MEM"   // set: the child's payloads live in host memory
	envTrust    = "GDRPC_TEST_TRUST"      // set: TrustPeers in both processes
	envReqSpace = "GDRPC_TEST_REQ_SPACE"  // the child's receive space for requests (bytes; unset: none)
	envReqLimit = "GDRPC_TEST_REQ_LIMIT"  // the bound of the child's growing spaces for requests (bytes; unset: none)
)

func requireCUDA(t testing.TB) {
	t.Helper()
	testenv.Need(t, "cuda", devicebuf.CUDAAvailable())
}

// gpuServerChild runs the server side when this binary was started as the
// child; it reports its address on stdout and serves until stdin closes.
func gpuServerChild() {
	mode := os.Getenv(envGPUChild)
	if mode == "" {
		return
	}
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "gpu server:", err)
		os.Exit(2)
	}
	paths, _ := strconv.Atoi(os.Getenv(envPaths))
	reqSpace, _ := strconv.Atoi(os.Getenv(envReqSpace))
	reqLimit, _ := strconv.Atoi(os.Getenv(envReqLimit))
	oob.SetTransferConfig(oob.TransferConfig{Paths: oob.Path(paths), ReceiveSpace: reqSpace, ReceiveSpaceLimit: reqLimit})
	dev, _ := strconv.Atoi(os.Getenv(envGPU))
	gpu, err := devicebuf.NewCUDAAllocator(dev)
	if err != nil {
		fail(err)
	}
	if os.Getenv(envHostMem) != "" {
		gpu = nil // Make builds in Go memory; requests land in the registered host pool
		gdrcodec.Register()
	} else {
		gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	}
	opts := []gdrpc.Option{gdrpc.WithTransport(transport.Mode(mode)), processEngine}
	if os.Getenv(envTrust) != "" {
		opts = append(opts, gdrpc.WithTrustPeers())
	}
	lis, err := listener.Listen("127.0.0.1:0", opts...)
	if err != nil {
		fail(err)
	}
	gs := grpc.NewServer(listener.ServerOptions(insecure.NewCredentials())...)
	tensorpb.RegisterTensorServiceServer(gs, &tensor.Server{Alloc: gpu})
	go gs.Serve(lis)
	fmt.Println(lis.Addr().String())
	io.Copy(io.Discard, os.Stdin)
	gs.Stop()
	os.Exit(0)
}

// startGPUServer starts the child server on GPU dev (its payloads in host
// memory with hostMem) with reqSpace bytes of space for requests, or spaces
// that grow within reqLimit, and returns its address.
func startGPUServer(t *testing.T, mode transport.Mode, paths oob.Path, dev int, hostMem, trust bool, reqSpace, reqLimit int) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envGPUChild+"="+string(mode), fmt.Sprintf("%s=%d", envPaths, paths), fmt.Sprintf("%s=%d", envGPU, dev),
		fmt.Sprintf("%s=%d", envReqSpace, reqSpace), fmt.Sprintf("%s=%d", envReqLimit, reqLimit))
	if hostMem {
		cmd.Env = append(cmd.Env, envHostMem+"=1")
	}
	if trust {
		cmd.Env = append(cmd.Env, envTrust+"=1")
	}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			require.NoError(t, err, "server child")
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			t.Error("server child did not stop")
		}
	})
	addr := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		addr <- strings.TrimSpace(line)
	}()
	select {
	case a := <-addr:
		require.NotEmpty(t, a, "server child exited before listening")
		return a
	case <-time.After(60 * time.Second):
		t.Fatal("server child did not start")
	}
	return ""
}

// TestGPUService runs the service with both processes on GPU 0 and, where
// the host has two GPUs, with the server on GPU 0 and the client on GPU 1
// (cuda-ipc then copies between devices).
func TestGPUService(t *testing.T) {
	requireCUDA(t)
	n, err := devicebuf.DeviceCount()
	require.NoError(t, err)
	pairs := [][2]int{{0, 0}} // server, client
	if n >= 2 {
		pairs = append(pairs, [2]int{0, 1})
	}
	for _, p := range pairs {
		t.Run(fmt.Sprintf("gpus=%d,%d", p[0], p[1]), func(t *testing.T) { testGPUService(t, p[0], p[1]) })
	}
}

// ucxMovesCUDA reports whether the loaded UCX registers and moves CUDA memory
// itself (a CUDA-enabled build): the rdma path then reads and writes GPU
// memory directly instead of staging it through host memory.
func ucxMovesCUDA(t *testing.T) bool {
	t.Helper()
	requireUCX(t)
	rc, err := rdma.Default()
	require.NoError(t, err)
	return rc.Info().HasMemoryType(rdma.MemoryCUDA)
}

func testGPUService(t *testing.T, serverGPU, clientGPU int) {
	gpu, err := devicebuf.NewCUDAAllocator(clientGPU)
	require.NoError(t, err)
	sizes := []int{1, 64<<10 - 1, 64 << 10, 64<<10 + 1, 1 << 20, 256 << 20}
	if !testing.Short() {
		sizes = append(sizes, 1<<30)
	}
	// want names the route of the client's pull of the response (server
	// memory to client memory), wantBack the route of the client's push of
	// the request back to the server (named for the client's memory), with a
	// CUDA-enabled UCX; plain and back without one.
	tests := []gpuPath{
		{name: "cuda-ipc", mode: transport.ModeTCP, paths: oob.PathCUDAIPC, trust: true, want: "cuda-ipc", wantBack: "cuda-ipc", plain: "cuda-ipc", back: "cuda-ipc"},
		{name: "rdma", mode: transport.ModeUCX, paths: oob.PathRDMA, trust: true, want: "rdma/cuda", wantBack: "rdma/cuda", plain: "staged", back: "staged"},
		{name: "rdma-gpu-to-host", mode: transport.ModeUCX, paths: oob.PathRDMA, trust: true, clientHost: true, want: "rdma", wantBack: "rdma", plain: "rdma", back: "rdma"},
		{name: "rdma-host-to-gpu", mode: transport.ModeUCX, paths: oob.PathRDMA, trust: true, serverHost: true, want: "rdma/cuda", wantBack: "rdma/cuda", plain: "staged", back: "staged"},
		// Untrusted peers: a key that names memory the owner would map and
		// write itself (here UCX's cuda_ipc) sends it to the stream; host
		// staging registered for the one transfer is reached over tcp.
		{name: "rdma-untrusted", mode: transport.ModeUCX, paths: oob.PathRDMA, want: "stream", wantBack: "stream", plain: "staged", back: "staged"},
		{name: "stream", mode: transport.ModeTCP, paths: oob.PathStream, want: "stream", wantBack: "stream", plain: "stream", back: "stream"},
	}
	for _, tt := range tests {
		for _, space := range []bool{false, true} {
			t.Run(fmt.Sprintf("path=%s/space=%v", tt.name, space), func(t *testing.T) {
				testGPUPath(t, tt, space, false, gpu, sizes, serverGPU, clientGPU)
			})
		}
		if tt.name == "cuda-ipc" {
			// The space's copies run while their responses travel; the
			// client takes the buffers Pending and orders a stream of
			// its own after them.
			t.Run(fmt.Sprintf("path=%s/space=true/stream-ordered", tt.name), func(t *testing.T) {
				testGPUPath(t, tt, true, true, gpu, sizes, serverGPU, clientGPU)
			})
		}
		if tt.name == "cuda-ipc" || tt.name == "rdma" {
			// The server advertises space for requests too: the client
			// writes each request's payload there while marshaling it.
			rt := tt
			rt.reqSpace = true
			t.Run(fmt.Sprintf("path=%s/space=true/requests", tt.name), func(t *testing.T) {
				testGPUPath(t, rt, true, false, gpu, sizes, serverGPU, clientGPU)
			})
			// Spaces for requests that grow with the payloads: a
			// payload larger than the first space is pulled, and the
			// next of its size lands in the space added after it.
			rt.reqGrow = true
			t.Run(fmt.Sprintf("path=%s/space=true/requests-grow", tt.name), func(t *testing.T) {
				testGPUPath(t, rt, true, false, gpu, sizes, serverGPU, clientGPU)
			})
		}
	}
}

// gpuPath is one way of TestGPUService's: see testGPUService.
type gpuPath struct {
	name           string
	mode           transport.Mode
	paths          oob.Path
	serverHost     bool // the server's payloads live in host memory
	clientHost     bool // the client's received payloads land in host memory
	trust          bool // TrustPeers: owners put through any transport a key names
	reqSpace       bool // the server advertises receive space for requests
	reqGrow        bool // with reqSpace: spaces that grow within reqGrowLimit
	want, wantBack string
	plain, back    string // without CUDA in UCX
}

// testGPUPath runs tt's calls for every size. With space the client
// advertises receive space after its first pull by rdma or cuda-ipc, and
// the server's later payloads that fit land there (route "<want>@space"):
// by cuda-ipc, copies the server does not wait for, which the client waits
// for, or with ordered hands out Pending and a stream of the test's waits
// for.
func testGPUPath(t *testing.T, tt gpuPath, space, ordered bool, gpu devicebuf.Allocator, sizes []int, serverGPU, clientGPU int) {
	if tt.mode == transport.ModeUCX && !ucxMovesCUDA(t) {
		tt.want, tt.wantBack = tt.plain, tt.back
	}
	const spaceBytes = 64 << 20
	const reqGrowLimit = 1 << 30 // its first space is 64 MiB, as spaceBytes
	receiveSpace := -1
	if space {
		receiveSpace = spaceBytes
	}
	direct := func(route string) bool { return route == "rdma/cuda" || route == "rdma" || route == "cuda-ipc" }
	landable := space && tt.trust && direct(tt.want)
	reqLandable := tt.reqSpace && direct(tt.wantBack)
	landed, queued, reqLanded := 0, 0, 0
	reqSpace, reqLimit := 0, 0
	switch {
	case tt.reqGrow:
		reqLimit = reqGrowLimit
	case tt.reqSpace:
		reqSpace = spaceBytes
	}
	addr := startGPUServer(t, tt.mode, tt.paths, serverGPU, tt.serverHost, tt.trust, reqSpace, reqLimit)
	pc := &pathCounter{paths: map[string]int{}}
	oob.SetTransferConfig(oob.TransferConfig{Paths: tt.paths, Metrics: pc, ReceiveSpace: receiveSpace, StreamOrdered: ordered})
	if tt.clientHost {
		gdrcodec.Register()
	} else {
		gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	}
	t.Cleanup(func() {
		oob.SetTransferConfig(oob.TransferConfig{})
		gdrcodec.Register()
	})
	opts := []gdrpc.Option{gdrpc.WithTransport(tt.mode), processEngine}
	if tt.trust {
		opts = append(opts, gdrpc.WithTrustPeers())
	}
	d := dialer.New(opts...)
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	defer cc.Close()
	c := tensorpb.NewTensorServiceClient(cc)
	// Every GPU buffer and IPC mapping this process made for the calls
	// is gone once they returned, their messages were released and
	// the session (which holds the receive space) ended.
	base := devicebuf.Live()
	defer func() {
		require.NoError(t, cc.Close())
		require.Eventually(t, func() bool { return oob.ReadStats().Spaces == 0 }, 10*time.Second, time.Millisecond)
		if landable {
			require.NotZero(t, landed, "no payload landed in the receive space")
		}
		if landable && tt.want == "cuda-ipc" {
			require.Equal(t, landed, queued, "copies into the space the server queued")
		}
		if reqLandable {
			require.NotZero(t, reqLanded, "no request landed in the server's receive space")
		}
		left := devicebuf.Live().Sub(base)
		require.Zero(t, left.CUDABuffers, "GPU buffers left: %+v", left)
		require.Zero(t, left.CUDABytes, "GPU bytes left: %+v", left)
		require.Zero(t, left.IPCMappings, "IPC mappings left: %+v", left)
	}()
	for _, n := range sizes {
		t.Run(fmt.Sprintf("size=%d", n), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			want := pattern(n, uint32(n))
			start := time.Now()
			// Response: the server's payload lands in this process's memory.
			got, err := c.Make(ctx, &tensorpb.Sized{Size: uint64(n), Seed: uint32(n)})
			require.NoError(t, err)
			elapsed := time.Since(start)
			b, ok := gdrcodec.Buffer(got.Data)
			require.True(t, ok)
			if tt.clientHost {
				require.Equal(t, devicebuf.Host, b.Kind())
			} else {
				require.Equal(t, devicebuf.CUDA, b.Kind())
				require.Equal(t, clientGPU, b.Device())
			}
			if b.Pending() {
				require.True(t, ordered, "a Pending buffer without stream-ordered completion")
				requireBytes(t, want, readOrdered(t, b))
			}
			p, err := tensor.Bytes(got.Data) // copies back from the GPU
			require.NoError(t, err)
			requireBytes(t, want, p)
			queued += pc.takeQueued()
			paths := pc.reset()
			pc.takePushes()
			if n >= gdrcodec.DefaultEagerThreshold {
				if landable && n <= spaceBytes && paths[tt.want+"@space"] == 1 {
					// Written into the receive space the client
					// advertised after its first pull (once the server
					// took the advertisement).
					landed++
				} else {
					require.Equal(t, map[string]int{tt.want: 1}, paths, "the client's pull")
				}
			}

			// Request: this process's payload lands in the server's memory;
			// the server checksums what arrived and reports the path.
			sum, err := c.Digest(ctx, got)
			require.NoError(t, err)
			require.Equal(t, uint64(n), sum.Bytes)
			require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)
			if n >= gdrcodec.DefaultEagerThreshold {
				pushes := pc.takePushes()
				if reqLandable && (n <= spaceBytes || tt.reqGrow) && pushes[tt.wantBack+"@space"] == 1 {
					// Written into the server's space for requests, which
					// it advertised after its first pull of one.
					reqLanded++
				} else {
					require.Equal(t, map[string]int{tt.wantBack: 1}, pushes, "the client's push")
				}
			}
			gdrcodec.ReleaseAll(got)
			t.Logf("path=%s size=%d make=%v (%.0f MiB/s incl. server fill)", tt.want, n, elapsed, float64(n)/(1<<20)/elapsed.Seconds())
			// A space the calls' pulls prompted is made off their path:
			// the next call is to find it.
			waitSpacesMade(t)
		})
	}
	if tt.reqGrow {
		// The largest size under the limit was pulled once: the server
		// added a space after it, which the next one of its size lands in.
		n := 0
		for _, m := range sizes {
			if 2*m <= reqGrowLimit-spaceBytes {
				n = max(n, m)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		got, err := c.Make(ctx, &tensorpb.Sized{Size: uint64(n), Seed: 7})
		require.NoError(t, err)
		pc.reset()
		pc.takePushes()
		sum, err := c.Digest(ctx, got)
		require.NoError(t, err)
		gdrcodec.ReleaseAll(got)
		require.Equal(t, uint64(n), sum.Bytes)
		require.Equal(t, tensor.ChecksumBytes(pattern(n, 7)), sum.Crc32C)
		if reqLandable {
			require.Equal(t, map[string]int{tt.wantBack + "@space": 1}, pc.takePushes(), "%d bytes into the grown space", n)
		}
	}
	if tt.reqSpace {
		// A client stream's messages in this process's GPU memory land in
		// the server's space too; the server checksums what arrived.
		t.Run("upload", func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			st, err := c.Upload(ctx)
			require.NoError(t, err)
			const n = 1 << 20
			var want uint32
			var alloc devicebuf.Allocator = gpu
			if tt.clientHost {
				alloc = nil
			}
			for i := range 4 {
				m, err := tensor.Make(alloc, &tensorpb.Sized{Size: n, Seed: uint32(80 + i)})
				require.NoError(t, err)
				want = crc32.Update(want, crc32.MakeTable(crc32.Castagnoli), pattern(n, uint32(80+i)))
				require.NoError(t, st.Send(m))
				gdrcodec.ReleaseAll(m)
			}
			sum, err := st.CloseAndRecv()
			require.NoError(t, err)
			require.Equal(t, uint64(4*n), sum.Bytes)
			require.Equal(t, want, sum.Crc32C)
			pushes := pc.takePushes()
			pc.reset()
			if reqLandable {
				require.NotZero(t, pushes[tt.wantBack+"@space"], "no message landed: %v", pushes)
			}
		})
	}
}

// readOrdered reads b, a Pending buffer, back to the host by a copy queued on
// a stream of its own after b.WaitOn: the bytes the stream sees.
func readOrdered(t *testing.T, b *devicebuf.Buffer) []byte {
	t.Helper()
	s, err := devicebuf.NewStream(b.Device())
	require.NoError(t, err)
	defer s.Close()
	host, err := devicebuf.NewHostAllocator().Alloc(b.Len())
	require.NoError(t, err)
	defer host.Release()
	require.NoError(t, b.WaitOn(s))
	require.NoError(t, devicebuf.CopyAsync(s, host, b))
	require.NoError(t, s.Synchronize())
	hb, _ := host.HostBytes()
	return append([]byte(nil), hb...)
}

// A client that holds more payloads than its receive space has events (32)
// on a GPU: the server queues every copy by CUDA IPC without waiting for
// it, the later copies sharing the events of held ranges, and every held
// payload is byte-exact, read back at once or, stream-ordered, by a stream
// ordered after it.
func TestGPUEventsShared(t *testing.T) {
	requireCUDA(t)
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream-ordered=%v", ordered), func(t *testing.T) {
			gpu, err := devicebuf.NewCUDAAllocator(0)
			require.NoError(t, err)
			addr := startGPUServer(t, transport.ModeTCP, oob.PathCUDAIPC, 0, false, true, 0, 0)
			pc := &pathCounter{paths: map[string]int{}}
			oob.SetTransferConfig(oob.TransferConfig{Paths: oob.PathCUDAIPC, Metrics: pc, ReceiveSpace: 256 << 20, StreamOrdered: ordered})
			gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
			t.Cleanup(func() {
				oob.SetTransferConfig(oob.TransferConfig{})
				gdrcodec.Register()
			})
			d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine, gdrpc.WithTrustPeers())
			cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials())...)
			require.NoError(t, err)
			defer cc.Close()
			c := tensorpb.NewTensorServiceClient(cc)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			base := devicebuf.Live()
			const n, held = 1<<20 + 3, 40
			// Calls until one lands in the space: the first is pulled, and
			// the space it prompts reaches the server meanwhile.
			for pc.reset()["cuda-ipc@space"] == 0 {
				require.NoError(t, ctx.Err(), "no payload landed in the receive space")
				got, err := c.Make(ctx, &tensorpb.Sized{Size: n, Seed: 1})
				require.NoError(t, err)
				gdrcodec.ReleaseAll(got)
			}
			pc.takeQueued()
			var got []*tensorpb.Tensor
			defer releaseHeld(&got)
			for i := range held {
				m, err := c.Make(ctx, &tensorpb.Sized{Size: n, Seed: uint32(i + 2)})
				require.NoError(t, err)
				got = append(got, m)
			}
			require.Equal(t, held, pc.takeQueued(), "copies the server queued, not waited for")
			require.Equal(t, map[string]int{"cuda-ipc@space": held}, pc.reset())
			for i, m := range got {
				b, ok := gdrcodec.Buffer(m.Data)
				require.True(t, ok)
				require.Equal(t, devicebuf.CUDA, b.Kind())
				var p []byte
				if b.Pending() {
					require.True(t, ordered, "a Pending buffer without stream-ordered completion")
					p = readOrdered(t, b)
				} else {
					p, err = tensor.Bytes(m.Data) // copies back from the GPU
					require.NoError(t, err)
				}
				requireBytes(t, pattern(n, uint32(i+2)), p)
			}
			releaseHeld(&got)
			require.NoError(t, cc.Close())
			require.Eventually(t, func() bool { return oob.ReadStats().Spaces == 0 }, 10*time.Second, time.Millisecond)
			left := devicebuf.Live().Sub(base)
			require.Zero(t, left.CUDABuffers, "GPU buffers left: %+v", left)
			require.Zero(t, left.IPCMappings, "IPC mappings left: %+v", left)
		})
	}
}
