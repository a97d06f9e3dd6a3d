package dialer_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

type netConn = net.Conn

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }

const testTimeout = 30 * time.Second

// testService echoes.
type testService struct {
	testpb.UnimplementedTestServiceServer
}

func (testService) EmptyCall(context.Context, *testpb.Empty) (*testpb.Empty, error) {
	return &testpb.Empty{}, nil
}

func (testService) UnaryCall(_ context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	return &testpb.SimpleResponse{Payload: req.GetPayload()}, nil
}

func (testService) StreamingInputCall(st testpb.TestService_StreamingInputCallServer) error {
	n := 0
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return st.SendAndClose(&testpb.StreamingInputCallResponse{AggregatedPayloadSize: int32(n)})
		}
		if err != nil {
			return err
		}
		n += len(m.GetPayload().GetBody())
	}
}

func (testService) StreamingOutputCall(req *testpb.StreamingOutputCallRequest, st testpb.TestService_StreamingOutputCallServer) error {
	for _, p := range req.GetResponseParameters() {
		if err := st.Send(&testpb.StreamingOutputCallResponse{Payload: &testpb.Payload{Body: pattern(int(p.GetSize()))}}); err != nil {
			return err
		}
	}
	return nil
}

func (testService) FullDuplexCall(st testpb.TestService_FullDuplexCallServer) error {
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := st.Send(&testpb.StreamingOutputCallResponse{Payload: m.GetPayload()}); err != nil {
			return err
		}
	}
}

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i>>8)
	}
	return b
}

var ucxContexts sync.Map

func ucxContext(tb testing.TB, tls string) *rdma.Context {
	tb.Helper()
	testenv.Need(tb, "ucx", rdma.Available())
	if c, ok := ucxContexts.Load(tls); ok {
		return c.(*rdma.Context)
	}
	c, err := rdma.NewContext(rdma.WithTransports(tls))
	require.NoError(tb, err)
	actual, loaded := ucxContexts.LoadOrStore(tls, c)
	if loaded {
		_ = c.Close()
	}
	return actual.(*rdma.Context)
}

// A transport a test or benchmark runs over. plain is gRPC over TCP without
// gdrpc, the baseline.
type transportCase struct {
	name    string
	ucx     string
	plain   bool
	noLanes bool // UCX sessions multiplex the gRPC stream with yamux (transport.WithLanes(false))
}

// The UCX shm family keeps tcp for UCX's connection manager.
var transportCases = []transportCase{
	{name: "ucx-shm", ucx: "posix,sysv,cma,tcp"},
	{name: "ucx-tcp", ucx: "tcp"},
	{name: "tcp"},
}

var plainCase = transportCase{name: "grpc-tcp", plain: true}

func (tc transportCase) options(tb testing.TB) []transport.Option {
	return tc.optionsOn(tb, ucxContext)
}

// isolated is options with a UCX context of the test's own
// (testenv.UCXContext), for a test that kills or stops a peer process.
func (tc transportCase) isolated(tb testing.TB) []transport.Option {
	return tc.optionsOn(tb, testenv.UCXContext)
}

// optionsOn is options with the UCX context that contextOf returns.
func (tc transportCase) optionsOn(tb testing.TB, contextOf func(testing.TB, string) *rdma.Context) []transport.Option {
	if tc.ucx == "" {
		return []transport.Option{transport.WithMode(transport.ModeTCP)}
	}
	return []transport.Option{transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(contextOf(tb, tc.ucx)),
		transport.WithLanes(!tc.noLanes)}
}

func (tc transportCase) want() string {
	if tc.ucx != "" {
		return "ucx"
	}
	return "tcp"
}

// serve starts the test service over tc and returns a client connection to it.
func serve(tb testing.TB, tc transportCase) *grpc.ClientConn {
	tb.Helper()
	addr, dopts := start(tb, tc, testService{})
	cc, err := grpc.NewClient("passthrough:///"+addr, dopts...)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// start serves svc over tc until the test ends and returns its address and
// the options a client dials it with.
func start(tb testing.TB, tc transportCase, svc testpb.TestServiceServer) (string, []grpc.DialOption) {
	tb.Helper()
	var l net.Listener
	var srv *grpc.Server
	var dopts []grpc.DialOption
	if tc.plain {
		var err error
		l, err = net.Listen("tcp", "127.0.0.1:0")
		require.NoError(tb, err)
		srv = grpc.NewServer()
		dopts = []grpc.DialOption{grpc.WithTransportCredentials(insecureCreds())}
	} else {
		opts := tc.options(tb)
		var err error
		l, err = listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(opts...))
		require.NoError(tb, err)
		srv = grpc.NewServer(listener.ServerOptions(nil)...)
		dopts = dialer.New(gdrpc.WithSessionOptions(opts...)).DialOptions(nil)
	}
	testpb.RegisterTestServiceServer(srv, svc)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(l)
	}()
	// Cleanups run last first: the clients close before the server stops.
	tb.Cleanup(func() {
		srv.Stop()
		<-served
	})
	return l.Addr().String(), dopts
}

// TestGRPC runs unary and streaming calls over every transport and checks
// the bytes and the transport the session chose.
func TestGRPC(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			cc := serve(t, tc)
			c := testpb.NewTestServiceClient(cc)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			_, err := c.EmptyCall(ctx, &testpb.Empty{})
			require.NoError(t, err)
			for _, n := range []int{0, 1024, 1 << 20, 4<<20 - 64} {
				body := pattern(n)
				resp, err := c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: &testpb.Payload{Body: body}})
				require.NoError(t, err)
				require.True(t, bytes.Equal(body, resp.GetPayload().GetBody()), "size %d: payload differs", n)
			}
			st, err := c.FullDuplexCall(ctx)
			require.NoError(t, err)
			for i := range 20 {
				body := pattern(1000 * i)
				require.NoError(t, st.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: body}}))
				m, err := st.Recv()
				require.NoError(t, err)
				require.True(t, bytes.Equal(body, m.GetPayload().GetBody()), "message %d differs", i)
			}
			require.NoError(t, st.CloseSend())
			_, err = st.Recv()
			require.ErrorIs(t, err, io.EOF)

			in, err := c.StreamingInputCall(ctx)
			require.NoError(t, err)
			for range 8 {
				require.NoError(t, in.Send(&testpb.StreamingInputCallRequest{Payload: &testpb.Payload{Body: pattern(1 << 20)}}))
			}
			r, err := in.CloseAndRecv()
			require.NoError(t, err)
			require.Equal(t, int32(8<<20), r.GetAggregatedPayloadSize())
		})
	}
}

// TestDialContextTransport: the conn DialContext returns belongs to a session
// over the transport asked for, and closing it closes the session.
func TestDialContextTransport(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.options(t)
			l, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(opts...))
			require.NoError(t, err)
			defer l.Close()
			accepted := make(chan net.Conn, 1)
			go func() {
				c, err := l.Accept()
				if err == nil {
					accepted <- c
				}
			}()
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			c, err := dialer.New(gdrpc.WithSessionOptions(opts...)).DialContext(ctx, l.Addr().String())
			require.NoError(t, err)
			s := transport.SessionOf(c)
			require.NotNil(t, s)
			require.Equal(t, tc.want(), s.Transport())
			require.Equal(t, "gdrpc+"+tc.want(), c.RemoteAddr().Network())
			var sc net.Conn
			select {
			case sc = <-accepted:
			case <-ctx.Done():
				t.Fatal("no accept")
			}
			require.NoError(t, c.Close())
			select {
			case <-s.Done():
			case <-ctx.Done():
				t.Fatal("session not closed with its conn")
			}
			ss := transport.SessionOf(sc)
			select {
			case <-ss.Done():
			case <-ctx.Done():
				t.Fatal("server session not closed")
			}
			require.NoError(t, sc.Close())
		})
	}
}

// startChild re-executes the test binary in a role (prefix: a command to run
// it under, e.g. ip netns exec), and returns the process and its first line.
func startChild(tb testing.TB, prefix []string, role string, env ...string) (*exec.Cmd, string) {
	tb.Helper()
	return testenv.StartChild(tb, testTimeout, prefix, append([]string{childEnv + "=" + role}, env...)...)
}

// TestPeerKilledMidStream: the server process dies during a stream; the RPC
// fails with codes.Unavailable promptly, and the session leaves the registry.
func TestPeerKilledMidStream(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.isolated(t)
			cmd, line := startChild(t, nil, "grpc-server", "GDRPC_TEST_LISTEN=127.0.0.1:0", "GDRPC_TEST_UCX="+tc.ucx)
			addr, ok := strings.CutPrefix(line, "ADDR ")
			require.True(t, ok, line)
			d := dialer.New(gdrpc.WithSessionOptions(opts...))
			cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(nil)...)
			require.NoError(t, err)
			defer cc.Close()
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			st, err := testpb.NewTestServiceClient(cc).FullDuplexCall(ctx)
			require.NoError(t, err)
			require.NoError(t, st.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: []byte("ping")}}))
			_, err = st.Recv()
			require.NoError(t, err)
			require.Equal(t, 1, transport.ReadStats().Sessions)

			require.NoError(t, cmd.Process.Kill())
			start := time.Now()
			_, err = st.Recv()
			require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			require.Less(t, time.Since(start), 10*time.Second)
			t.Logf("stream failed %v after the kill: %v", time.Since(start), err)
			deadline := time.Now().Add(testTimeout)
			for transport.ReadStats().Sessions != 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond) // polling an observable, bounded
			}
			require.Zero(t, transport.ReadStats().Sessions)
		})
	}
}
