package interop_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding/gzip"
	grpcinterop "google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// interopCase is one of the gRPC interop test cases shipped with gRPC-Go.
type interopCase struct {
	name string
	run  func(ctx context.Context, tc testgrpc.TestServiceClient, cc *grpc.ClientConn)
	// racy marks a case that gRPC-Go itself fails now and then: it gets three
	// attempts.
	racy bool
}

// racyAttempts is how often a racy case is tried before it fails the test.
const racyAttempts = 3

// runCase runs an interop case as a subtest body: a failure (gRPC's Fatal)
// fails t. A racy case fails t only if every attempt failed.
func runCase(t *testing.T, c interopCase, client testgrpc.TestServiceClient, cc *grpc.ClientConn) {
	if !c.racy {
		glog.bind(t)
		c.run(callCtx(t), client, cc)
		return
	}
	var failures []string
	for range racyAttempts {
		rec := &recordingTB{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			glog.bind(rec)
			c.run(callCtx(t), client, cc)
		}()
		<-done // the case ends (gRPC's Fatal ends its goroutine) within its context's bound
		rec.mu.Lock()
		errs := rec.errors
		rec.mu.Unlock()
		if len(errs) == 0 {
			return
		}
		failures = append(failures, strings.Join(errs, "; "))
		t.Logf("attempt failed: %v", errs)
	}
	t.Fatalf("%d attempts failed: %q", racyAttempts, failures)
}

var interopCases = []interopCase{
	{"empty_unary", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoEmptyUnaryCall(ctx, tc)
	}, false},
	{"large_unary", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoLargeUnaryCall(ctx, tc)
	}, false},
	{"client_streaming", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoClientStreaming(ctx, tc)
	}, false},
	{"server_streaming", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoServerStreaming(ctx, tc)
	}, false},
	{"ping_pong", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoPingPong(ctx, tc)
	}, false},
	{"empty_stream", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoEmptyStream(ctx, tc)
	}, false},
	// gRPC-Go notices a cancellation asynchronously: now and then the call
	// completes (code OK) before it does, over plain TCP as over gdrpc (20000
	// runs under -race on 2 cores: plain gRPC-Go over TCP failed twice, gdrpc's
	// TCP fallback once, UCX shm never).
	{"cancel_after_begin", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoCancelAfterBegin(ctx, tc)
	}, true},
	{"cancel_after_first_response", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoCancelAfterFirstResponse(ctx, tc)
	}, false},
	{"timeout_on_sleeping_server", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoTimeoutOnSleepingServer(ctx, tc)
	}, false},
	{"custom_metadata", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoCustomMetadata(ctx, tc)
	}, false},
	{"status_code_and_message", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoStatusCodeAndMessage(ctx, tc)
	}, false},
	// The same with gzip-compressed messages.
	{"large_unary_gzip", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoLargeUnaryCall(ctx, tc, grpc.UseCompressor(gzip.Name))
	}, false},
	{"ping_pong_gzip", func(ctx context.Context, tc testgrpc.TestServiceClient, _ *grpc.ClientConn) {
		grpcinterop.DoPingPong(ctx, tc, grpc.UseCompressor(gzip.Name))
	}, false},
	{"unimplemented_method", func(ctx context.Context, _ testgrpc.TestServiceClient, cc *grpc.ClientConn) {
		grpcinterop.DoUnimplementedMethod(ctx, cc)
	}, false},
}

// TestInterop runs the gRPC interop cases over gdrpc on every transport, with
// and without TLS, and checks that the calls really took that transport.
func TestInterop(t *testing.T) {
	for _, tc := range transportCases {
		t.Run("transport="+tc.name, func(t *testing.T) {
			opts := tc.options(t)
			screds, ccreds := tc.creds(t)
			srv := startServer(t, opts, screds, func(s *grpc.Server) {
				testgrpc.RegisterTestServiceServer(s, grpcinterop.NewTestServer())
			})
			rec := &dialRecorder{d: dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...)).DialContext}
			cc := dialClient(t, srv.addr, opts, ccreds, grpc.WithContextDialer(rec.DialContext))
			client := testgrpc.NewTestServiceClient(cc)

			for _, c := range interopCases {
				t.Run(c.name, func(t *testing.T) { runCase(t, c, client, cc) })
			}

			// Every call went over one gdrpc session on the transport of the
			// case, under TLS when the case asks for it.
			var p peer.Peer
			_, err := client.EmptyCall(callCtx(t), nil, grpc.Peer(&p))
			require.NoError(t, err)
			sess := transport.SessionFromPeer(&p)
			require.NotNil(t, sess, "peer address %T", p.Addr)
			require.Equal(t, tc.want(), sess.Transport())
			require.Equal(t, "gdrpc+"+tc.want(), p.Addr.Network())
			// The session names the peer process (the server: this process)
			// and its capabilities.
			pp := sess.Peer()
			require.Equal(t, transport.LocalID(), pp.ID)
			require.Equal(t, transport.LocalHostID(), pp.HostID)
			require.True(t, pp.SameHost)
			require.True(t, pp.Caps.HasCodec(gdrcodec.Name), "codecs %v", pp.Caps.Codecs)
			if tc.ucx != "" {
				require.True(t, pp.Caps.UCX)
			}
			// The AuthInfo is the inner credentials' own.
			if tc.tls {
				ti, ok := p.AuthInfo.(credentials.TLSInfo)
				require.True(t, ok, "AuthInfo is %T", p.AuthInfo)
				require.True(t, ti.State.HandshakeComplete)
				require.Equal(t, credentials.PrivacyAndIntegrity, ti.SecurityLevel)
			} else {
				require.Equal(t, "insecure", p.AuthInfo.AuthType())
			}
			sessions := rec.all()
			require.Len(t, sessions, 1, "one session for the whole run")
			require.Same(t, sessions[0], sess)
			if tc.ucx != "" {
				ep := sess.Endpoint()
				require.NotNil(t, ep)
				info := ep.TransportInfo()
				t.Logf("UCX endpoint:\n%s", info)
				requireUCXLanes(t, tc.ucx, info)
			}

			// GracefulStop sends GOAWAY over the session and returns once the
			// client has closed its connection.
			stopped := make(chan struct{})
			go func() {
				srv.gs.GracefulStop()
				close(stopped)
			}()
			select {
			case <-stopped:
			case <-time.After(testTimeout):
				t.Fatal("GracefulStop did not return")
			}
			select {
			case <-sess.Done():
			case <-time.After(testTimeout):
				t.Fatal("the client session outlived the server's GracefulStop")
			}
		})
	}
}

// requireUCXLanes checks that the lane carrying the UCX endpoint's byte
// stream (the active-message lane, marked "am" in UCX's description) uses the
// transport family tls: shared memory (posix, sysv, cma) or tcp. UCX needs tcp
// for the wireup of a client-server endpoint, so the shm family includes it.
func requireUCXLanes(t *testing.T, tls, info string) {
	t.Helper()
	if env, ok := os.LookupEnv("UCX_TLS"); ok && env != tls {
		t.Logf("UCX_TLS=%s in the environment overrides the case's %s: lanes not checked", env, tls)
		return
	}
	var am string
	for _, line := range strings.Split(info, "\n") {
		if strings.Contains(line, "lane[") && slices.Contains(strings.Fields(line), "am") {
			am = line
		}
	}
	require.NotEmpty(t, am, "no active-message lane in:\n%s", info)
	if tls == ucxTCP {
		require.Contains(t, am, "tcp/", "stream over UCX tcp")
		return
	}
	require.True(t, strings.Contains(am, "posix/") || strings.Contains(am, "sysv/") || strings.Contains(am, "cma/"),
		"stream over UCX shared memory, got lane %q", am)
}

// dialRecorder wraps a dial function and records the sessions it made.
type dialRecorder struct {
	d        func(context.Context, string) (net.Conn, error)
	mu       sync.Mutex
	sessions []*transport.Session
}

func (r *dialRecorder) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	c, err := r.d(ctx, addr)
	if err != nil {
		return nil, err
	}
	s := transport.SessionOf(c)
	if s == nil {
		_ = c.Close()
		return nil, fmt.Errorf("dialed conn %T has no gdrpc session", c)
	}
	r.mu.Lock()
	r.sessions = append(r.sessions, s)
	r.mu.Unlock()
	return c, nil
}

func (r *dialRecorder) all() []*transport.Session {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*transport.Session(nil), r.sessions...)
}

// TestFatalFailsTheTest checks the logger the interop cases rely on: an
// interop case that fails (here, an empty call to a server that is gone)
// fails the bound test and ends only the calling goroutine, instead of
// exiting the process.
func TestFatalFailsTheTest(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // nobody listens there any more
	cc := dialClient(t, addr, transportCases[0].options(t), nil)
	rec := &recordingTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		glog.bind(rec)
		grpcinterop.DoEmptyUnaryCall(callCtx(t), testgrpc.NewTestServiceClient(cc), grpc.WaitForReady(false))
		rec.mu.Lock()
		rec.returned = true
		rec.mu.Unlock()
	}()
	<-done
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.False(t, rec.returned, "the case went on after its failure")
	require.Len(t, rec.errors, 1)
	require.Contains(t, rec.errors[0], "EmptyCall RPC failed")
}

// recordingTB records Errorf instead of failing the test.
type recordingTB struct {
	testing.TB
	mu       sync.Mutex
	errors   []string
	returned bool
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *recordingTB) Logf(string, ...any) {}

// FailNow ends the calling goroutine without failing the real test.
func (r *recordingTB) FailNow() { runtime.Goexit() }
