package interop_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	grpcinterop "google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// payloadSizes cross the eager threshold (64 KiB) and the default gRPC
// message limit (4 MiB).
var payloadSizes = []int{0, 1, 64<<10 - 1, 64 << 10, 1 << 20, 16 << 20}

func pattern(n int, seed uint32) []byte {
	p := make([]byte, n)
	tensor.Fill(p, seed)
	return p
}

// bothServices registers the interop TestService and the TensorService.
func bothServices(s *grpc.Server) {
	testgrpc.RegisterTestServiceServer(s, grpcinterop.NewTestServer())
	tensorpb.RegisterTensorServiceServer(s, &tensor.Server{})
}

// peerKinds records, on the server, whether the latest call came over a
// gdrpc session ("gdrpc") or from a plain client ("plain").
type peerKinds struct {
	mu     sync.Mutex
	latest string
}

func (k *peerKinds) interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	kind := "plain"
	if transport.SessionFromContext(ctx) != nil {
		kind = "gdrpc"
	}
	k.mu.Lock()
	k.latest = kind
	k.mu.Unlock()
	return handler(ctx, req)
}

// last returns the kind of the latest call and forgets it.
func (k *peerKinds) last(tb testing.TB) string {
	tb.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	kind := k.latest
	k.latest = ""
	require.NotEmpty(tb, kind, "the server saw no call")
	return kind
}

// TestMixedPeers serves one gdrpc listener (mode auto, and each transport
// case) to a gdrpc client and to a standard gRPC-Go client (plain TCP dial,
// default codec, TLS when the case has it): both pass the interop cases, and
// the plain client receives the device-buffer payloads inline, byte-exact,
// while the gdrpc client gets them out-of-band.
func TestMixedPeers(t *testing.T) {
	auto := []transportCase{{name: "auto"}, {name: "auto+tls", tls: true}}
	for _, tc := range append(auto, transportCases...) {
		t.Run("listener="+tc.name, func(t *testing.T) {
			opts := []transport.Option{transport.WithMode(transport.ModeAuto)}
			if tc.name != "auto" && tc.name != "auto+tls" {
				opts = tc.options(t)
			}
			screds, ccreds := tc.creds(t)
			kinds := &peerKinds{}
			paths := countPaths(t)
			srv := startServer(t, opts, screds, bothServices, grpc.ChainUnaryInterceptor(kinds.interceptor))

			gdr := dialClient(t, srv.addr, opts, ccreds)
			// A gdrpc session with the default codec: payloads inline.
			gdrProto := dialClientWith(t, srv.addr, opts, ccreds, false)
			plain := plainClient(t, srv.addr, ccreds)
			for _, c := range []struct {
				name string
				cc   *grpc.ClientConn
				kind string // what the server sees: "gdrpc" session or "plain" conn
				oob  bool   // payloads travel out-of-band (the gdr codec)
			}{
				{"gdrpc", gdr, "gdrpc", true},
				{"gdrpc-proto", gdrProto, "gdrpc", false},
				{"plain", plain, "plain", false},
			} {
				t.Run("client="+c.name, func(t *testing.T) {
					client := testgrpc.NewTestServiceClient(c.cc)
					for _, ic := range interopCases {
						t.Run(ic.name, func(t *testing.T) { runCase(t, ic, client, c.cc) })
					}
					var p peer.Peer
					_, err := client.EmptyCall(callCtx(t), nil, grpc.Peer(&p))
					require.NoError(t, err)
					require.Equal(t, c.kind, kinds.last(t))
					wantPath := "" // the path of out-of-band pulls
					threshold := 0 // the size from which payloads go out-of-band
					if sess := transport.SessionFromPeer(&p); sess != nil {
						wantPath, threshold = oobPath(t, sess.Transport()), eagerThreshold(sess.Transport())
					}
					if c.kind == "plain" {
						require.Equal(t, "tcp", p.Addr.Network(), "a plain client dials TCP")
						if tc.tls {
							require.Equal(t, "tls", p.AuthInfo.AuthType())
						}
					}

					tensors := tensorpb.NewTensorServiceClient(c.cc)
					sizes := payloadSizes
					if !strings.HasPrefix(tc.name, "auto") {
						sizes = sizes[:len(sizes)-1] // 16 MiB on the auto listeners only: CI time
					}
					for _, n := range sizes {
						for _, blob := range []bool{false, true} {
							t.Run(fmt.Sprintf("make/size=%d/blob=%v", n, blob), func(t *testing.T) {
								got, err := tensors.Make(callCtx(t), &tensorpb.Sized{Size: uint64(n), Seed: uint32(n), Blob: blob},
									grpc.MaxCallRecvMsgSize(64<<20))
								require.NoError(t, err)
								require.Equal(t, c.kind, kinds.last(t))
								defer gdrcodec.ReleaseAll(got)
								var p []byte
								if blob {
									p = got.Blob
								} else {
									if c.name == "plain" {
										// A plain client sees the DeviceBuffer as an
										// ordinary message: the bytes inline, no descriptor.
										require.Empty(t, got.GetData().GetOwner(), "descriptor sent to a plain client")
										require.Empty(t, got.GetData().GetToken(), "descriptor sent to a plain client")
										require.Equal(t, uint64(n), got.GetData().GetLength())
									}
									p, err = tensor.Bytes(got.Data)
									require.NoError(t, err)
								}
								require.Equal(t, n, len(p))
								require.True(t, bytes.Equal(pattern(n, uint32(n)), p), "payload differs")
								pulls := paths.reset()
								if c.oob && n >= threshold {
									require.Equal(t, map[string]int{wantPath: 1}, pulls, "the gdrpc client pulls out-of-band")
								} else {
									require.Empty(t, pulls, "inline")
								}
							})
						}
					}
					// A request payload from the client reaches the server too.
					want := pattern(3<<20+5, 7)
					src := devicebuf.HostFromBytes(want)
					req := &tensorpb.Tensor{Name: "up", Data: gdrcodec.New(src)}
					src.Release()
					sum, err := tensors.Digest(callCtx(t), req, grpc.MaxCallSendMsgSize(64<<20))
					gdrcodec.ReleaseAll(req)
					require.NoError(t, err)
					require.Equal(t, c.kind, kinds.last(t))
					require.Equal(t, uint64(len(want)), sum.Bytes)
					require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)
					if c.oob {
						require.Equal(t, map[string]int{wantPath: 1}, paths.reset(), "the server pulled the request")
					} else {
						require.Empty(t, paths.reset(), "inline")
					}
					require.Empty(t, paths.failures())
				})
			}

			// A plain client that asks for the gdr codec is refused clearly.
			_, err := tensorpb.NewTensorServiceClient(plain).Make(callCtx(t), &tensorpb.Sized{Size: 1},
				grpc.CallContentSubtype(gdrcodec.Name))
			require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
		})
	}
}

// pythonExe is Debian's interpreter, where python3-grpcio is installed.
const pythonExe = "/usr/bin/python3"

// requirePythonGRPC skips the test unless Debian's python3 can import grpc
// (fails it under GDRPC_REQUIRE=python).
func requirePythonGRPC(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(pythonExe); err != nil {
		skipUnless(t, "python", "no %s: %v", pythonExe, err)
	}
	out, err := exec.CommandContext(callCtx(t), pythonExe, "-c", "import grpc; print(grpc.__version__)").CombinedOutput()
	if err != nil {
		skipUnless(t, "python", "python3-grpcio missing (%v): %s", err, out)
	}
	t.Logf("python grpcio %s", strings.TrimSpace(string(out)))
}

// TestPythonClient runs a Python grpcio client (hand-encoded protobuf, no
// generated code) against a gdrpc server: Make delivers the payloads inline
// and byte-exact, Digest checksums what Python sent.
func TestPythonClient(t *testing.T) {
	requirePythonGRPC(t)
	kinds := &peerKinds{}
	srv := startServer(t, nil, nil, bothServices, grpc.ChainUnaryInterceptor(kinds.interceptor))
	var sizes []string
	for _, n := range payloadSizes {
		sizes = append(sizes, fmt.Sprint(n))
	}
	cmd := exec.CommandContext(callCtx(t), pythonExe, "testdata/tensor_client.py", srv.addr, strings.Join(sizes, ","))
	cmd.Env = append(os.Environ(), "no_proxy=*", "NO_PROXY=*", "GRPC_ENABLE_FORK_SUPPORT=0")
	out, err := cmd.CombinedOutput()
	t.Logf("python client:\n%s", out)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var oks int
	for _, l := range lines {
		require.False(t, strings.HasPrefix(l, "FAIL"), l)
		if strings.HasPrefix(l, "OK ") {
			oks++
		}
	}
	require.Equal(t, 2*len(payloadSizes)+1, oks, "one OK per Make and one for Digest")
	require.Equal(t, "plain", kinds.last(t), "python came as a plain HTTP/2 client")
}
