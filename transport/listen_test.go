package transport_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/gdrpc/gdrpc/transport"
)

func TestListenerClose(t *testing.T) {
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP))
	require.NoError(t, err)
	acceptErr := make(chan error, 1)
	go func() {
		_, err := l.Accept()
		acceptErr <- err
	}()
	require.NoError(t, l.Close())
	require.NoError(t, l.Close()) // idempotent
	select {
	case err := <-acceptErr:
		require.ErrorIs(t, err, net.ErrClosed)
	case <-time.After(testTimeout):
		t.Fatal("Close did not wake Accept")
	}
	_, err = l.Accept()
	require.ErrorIs(t, err, net.ErrClosed)
	// The port is closed: a dial fails.
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	_, err = transport.Dial(ctx, l.Addr().String(), transport.WithMode(transport.ModeTCP))
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
}

// TestListenerCloseUCX: Close also closes the UCX listener it owns.
func TestListenerCloseUCX(t *testing.T) {
	rc := ucxContext(t, ucxTCP)
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(rc))
	require.NoError(t, err)
	require.NotNil(t, l.UCXAddr())
	require.NoError(t, l.Close())
	_, err = l.Accept()
	require.ErrorIs(t, err, net.ErrClosed)
}

// healthServer serves the health service on l with gdrpc credentials and
// returns a func that waits for Serve to return.
func healthServer(t *testing.T, l net.Listener, opts ...grpc.ServerOption) (*grpc.Server, func() error) {
	t.Helper()
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.Creds(transport.NewCredentials(nil))}, opts...)...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return srv, func() error {
		select {
		case err := <-served:
			return err
		case <-time.After(testTimeout):
			return errors.New("Serve did not return")
		}
	}
}

func gdrpcClient(t *testing.T, addr string, opts ...transport.Option) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			s, err := transport.Dial(ctx, addr, opts...)
			if err != nil {
				return nil, err
			}
			return s.Conn(ctx)
		}),
		grpc.WithTransportCredentials(transport.NewCredentials(nil)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func checkHealth(t *testing.T, cc *grpc.ClientConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.Status)
}

// TestServeReturnsAfterClose: gRPC's Serve returns (does not spin) once the
// listener is closed, over every transport; RPCs work before.
func TestServeReturnsAfterClose(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.options(t)
			l, err := transport.Listen("127.0.0.1:0", opts...)
			require.NoError(t, err)
			_, wait := healthServer(t, l)
			cc := gdrpcClient(t, l.Addr().String(), opts...)
			checkHealth(t, cc)
			require.NoError(t, l.Close())
			err = wait()
			require.Error(t, err)
			require.ErrorIs(t, err, net.ErrClosed)
		})
	}
}

// TestPlainGRPCClient: a standard gRPC client (plain TCP, HTTP/2 preface)
// reaches a gdrpc listener on the same port as gdrpc clients.
func TestPlainGRPCClient(t *testing.T) {
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP))
	require.NoError(t, err)
	defer l.Close()
	healthServer(t, l)
	plain, err := grpc.NewClient("passthrough:///"+l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer plain.Close()
	checkHealth(t, plain)
	checkHealth(t, gdrpcClient(t, l.Addr().String(), transport.WithMode(transport.ModeTCP)))
	checkHealth(t, plain)
}

// TestGarbageClient: a client speaking neither gdrpc nor HTTP/2 is closed,
// and the listener keeps serving.
func TestGarbageClient(t *testing.T) {
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP), transport.WithHandshakeTimeout(2*time.Second))
	require.NoError(t, err)
	defer l.Close()
	healthServer(t, l)
	for _, junk := range [][]byte{[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), {0, 1, 2, 3, 4, 5, 6, 7}, []byte("GDRPC\x00\x00\x07\x00\x00\x00\x01\x01")} {
		c, err := net.Dial("tcp", l.Addr().String())
		require.NoError(t, err)
		_, err = c.Write(junk)
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(testTimeout)))
		b, err := io.ReadAll(c) // the server closes the connection (after a reject for gdrpc frames)
		if junk[0] == 'G' && junk[1] == 'D' {
			require.NoError(t, err)
			require.Contains(t, string(b), "version")
		} else {
			// Closed with unread bytes: EOF or a reset, never an answer.
			if err != nil {
				require.ErrorIs(t, err, syscall.ECONNRESET)
			}
			require.Empty(t, b)
		}
		_ = c.Close()
	}
	checkHealth(t, gdrpcClient(t, l.Addr().String(), transport.WithMode(transport.ModeTCP)))
}

// TestVersionMismatchOverTCP: a client of protocol version 9 gets a reject
// that says which version the server speaks.
func TestVersionMismatchOverTCP(t *testing.T) {
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP))
	require.NoError(t, err)
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	frame := []byte("GDRPC\x00\x00\x09\x00\x00\x00\x01\x01")
	_, err = c.Write(frame)
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(testTimeout)))
	hdr := make([]byte, 12)
	_, err = io.ReadFull(c, hdr)
	require.NoError(t, err)
	require.Equal(t, "GDRPC\x00", string(hdr[:6]))
	body := make([]byte, binary.BigEndian.Uint32(hdr[8:]))
	_, err = io.ReadFull(c, body)
	require.NoError(t, err)
	require.Equal(t, byte(3), body[0], "a reject")
	require.Regexp(t, `server speaks gdrpc protocol version [0-9]+, client 9`, string(body))
}

func TestModeMismatch(t *testing.T) {
	rc := ucxContext(t, ucxTCP)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	// Server TCP only, client requires UCX: the server says why.
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP))
	require.NoError(t, err)
	defer l.Close()
	_, err = transport.Dial(ctx, l.Addr().String(), transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(rc))
	require.ErrorIs(t, err, transport.ErrRejected)
	require.ErrorContains(t, err, "one side requires transport ucx, the other transport tcp")

	// Server requires UCX, client TCP only.
	l2, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(rc))
	require.NoError(t, err)
	defer l2.Close()
	_, err = transport.Dial(ctx, l2.Addr().String(), transport.WithMode(transport.ModeTCP))
	require.ErrorIs(t, err, transport.ErrRejected)

	// Auto on both ends with UCX, peers not trusted: the session stays on TCP.
	lu, err := transport.Listen("127.0.0.1:0", transport.WithRDMAContext(rc))
	require.NoError(t, err)
	defer lu.Close()
	su, err := transport.Dial(ctx, lu.Addr().String(), transport.WithRDMAContext(rc))
	require.NoError(t, err)
	defer su.Close()
	require.Equal(t, "tcp", su.Transport())

	// Auto on both ends with UCX, peers trusted: the session upgrades.
	trust := transport.WithTrustPeers(true)
	l3, err := transport.Listen("127.0.0.1:0", transport.WithRDMAContext(rc), trust)
	require.NoError(t, err)
	defer l3.Close()
	s, err := transport.Dial(ctx, l3.Addr().String(), transport.WithRDMAContext(rc), trust)
	require.NoError(t, err)
	defer s.Close()
	require.Equal(t, "ucx", s.Transport())

	// The environment forces TCP when no option says otherwise.
	t.Setenv(transport.EnvTransport, "tcp")
	s2, err := transport.Dial(ctx, l3.Addr().String(), transport.WithRDMAContext(rc), trust)
	require.NoError(t, err)
	defer s2.Close()
	require.Equal(t, "tcp", s2.Transport())
	t.Setenv(transport.EnvTransport, "bogus")
	_, err = transport.Dial(ctx, l3.Addr().String())
	require.ErrorContains(t, err, "unknown transport mode")

	// It asks for UCX only where the code trusts the peers: UCX exposes the
	// process to them.
	t.Setenv(transport.EnvTransport, "ucx")
	s3, err := transport.Dial(ctx, l3.Addr().String(), transport.WithRDMAContext(rc), trust)
	require.NoError(t, err)
	defer s3.Close()
	require.Equal(t, "ucx", s3.Transport())
	_, err = transport.Dial(ctx, l3.Addr().String(), transport.WithRDMAContext(rc))
	require.ErrorContains(t, err, "GDRPC_TRANSPORT=ucx in a process that does not trust its peers")
	_, err = transport.Listen("127.0.0.1:0", transport.WithRDMAContext(rc))
	require.ErrorContains(t, err, "GDRPC_TRANSPORT=ucx in a process that does not trust its peers")
}

// TestDefaultsUpgrade: with no options but trusted peers (auto mode,
// rdma.Default()) two processes on one host end up on UCX over shared memory.
func TestDefaultsUpgrade(t *testing.T) {
	requireUCX(t)
	t.Setenv(transport.EnvTransport, "")
	p := dialPair(t, []transport.Option{transport.WithTrustPeers(true)})
	require.Equal(t, "ucx", p.client.Transport())
	require.Equal(t, "ucx", p.server.Transport())
	require.True(t, p.client.Peer().SameHost)
	info := p.client.Endpoint().TransportInfo()
	require.True(t, strings.Contains(info, "sysv/memory") || strings.Contains(info, "posix/memory") || strings.Contains(info, "cma/memory"), info)
	roundTripPair(t, p)
}

func roundTripPair(t *testing.T, p *setup) {
	t.Helper()
	go func() { _, _ = io.Copy(p.sc, p.sc) }()
	roundTrip(t, p.cc, "over the default transport")
}

// UCX endpoints are made over IPv4 alone: a listener on every address
// (":port") gives a trusted client that reached it over IPv6 a TCP session
// at once, without an upgrade that would dial its UCX listener where it does
// not listen, and a client requiring UCX over IPv6 a rejection that says
// why. Over IPv4 the same listener upgrades.
func TestUCXSessionsOverIPv4(t *testing.T) {
	if ln, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skip("no IPv6 loopback:", err)
	} else {
		ln.Close()
	}
	rc := ucxContext(t, ucxTCP)
	auto := []transport.Option{transport.WithRDMAContext(rc), transport.WithTrustPeers(true)}
	l, err := transport.Listen(":0", auto...)
	require.NoError(t, err)
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	_, port, err := net.SplitHostPort(l.Addr().String())
	require.NoError(t, err)
	dial := func(host string, opts ...transport.Option) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		c, err := transport.DialConn(ctx, net.JoinHostPort(host, port), opts...)
		if err != nil {
			return "", err
		}
		s := transport.SessionOf(c)
		defer s.Close()
		defer c.Close()
		return s.Transport(), nil
	}
	mode, err := dial("127.0.0.1", auto...)
	require.NoError(t, err)
	require.Equal(t, "ucx", mode, "over IPv4")
	mode, err = dial("::1", auto...)
	require.NoError(t, err)
	require.Equal(t, "tcp", mode, "over IPv6")
	_, err = dial("::1", append(auto, transport.WithMode(transport.ModeUCX))...)
	require.ErrorContains(t, err, "the client came over IPv6")
}
