package transport_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// childEnv makes the test binary, re-executed, play a role instead of
// running tests.
const childEnv = "GDRPC_TEST_CHILD"

// runChild plays a role in a child process: "echo-server" listens (address
// from GDRPC_TEST_LISTEN, transport from GDRPC_TEST_UCX: "" for TCP, else
// UCX_TLS), prints "ADDR <addr>", echoes every gRPC stream conn, and exits
// when its stdin closes. "tcp-echo-server" does the same on a plain TCP
// listener (the baseline of the benchmarks).
func runChild(role string) int {
	switch role {
	case "tcp-echo-server":
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		go echoAll(l)
		fmt.Println("ADDR", l.Addr().String())
		_, _ = io.Copy(io.Discard, os.Stdin)
		_ = l.Close()
		return 0
	case "echo-server":
		opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
		if tls := os.Getenv("GDRPC_TEST_UCX"); tls != "" {
			rc, err := rdma.NewContext(rdma.WithTransports(tls))
			if err != nil {
				fmt.Println("ERR", err)
				return 1
			}
			opts = []transport.Option{transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(rc)}
		}
		addr := os.Getenv("GDRPC_TEST_LISTEN")
		if addr == "" {
			addr = "127.0.0.1:0"
		}
		l, err := transport.Listen(addr, opts...)
		if err != nil {
			fmt.Println("ERR", err)
			return 1
		}
		go echoAll(l)
		fmt.Println("ADDR", l.Addr().String())
		_, _ = io.Copy(io.Discard, os.Stdin) // until the parent goes away
		_ = l.Close()
		return 0
	}
	fmt.Fprintln(os.Stderr, "unknown child role", role)
	return 2
}

// echoAll echoes every conn l accepts, until l closes.
func echoAll(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_, _ = io.Copy(c, c)
		}()
	}
}

// startChild re-executes the test binary in a role and returns the process
// and the address it printed. The child is killed when the test ends.
func startChild(tb testing.TB, role string, env ...string) (*exec.Cmd, string) {
	tb.Helper()
	cmd, l := testenv.StartChild(tb, testTimeout, nil, append([]string{childEnv + "=" + role}, env...)...)
	addr, ok := strings.CutPrefix(l, "ADDR ")
	require.True(tb, ok, "child said %q", l)
	return cmd, addr
}

// dialEchoChild starts an echo-server child for tc, dials it with opts and
// echoes one message over the session's conn: the child's end is up. The
// session closes when the test ends.
func dialEchoChild(t *testing.T, tc transportCase, opts []transport.Option) (*exec.Cmd, *transport.Session, net.Conn) {
	t.Helper()
	cmd, addr := startChild(t, "echo-server", childEnvFor(tc)...)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	s, err := transport.Dial(ctx, addr, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	c, err := s.Conn(ctx)
	require.NoError(t, err)
	roundTrip(t, c, "hello")
	return cmd, s, c
}

func roundTrip(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(testTimeout)))
	_, err := c.Write([]byte(msg))
	require.NoError(t, err)
	got := make([]byte, len(msg))
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, msg, string(got))
	require.NoError(t, c.SetDeadline(time.Time{}))
}

func childEnvFor(tc transportCase) []string {
	return []string{"GDRPC_TEST_UCX=" + tc.ucx}
}

// TestKeepAliveStoppedPeer stops the peer process (SIGSTOP): its connection
// stays open, only the keepalive can tell. The session must close within the
// configured bound, leave the registry, and fail the conn's pending Read.
func TestKeepAliveStoppedPeer(t *testing.T) {
	// The timeout is live from the dial on: a loaded machine (the race
	// detector, other packages' tests) must not miss a pong before the stop.
	const interval, timeout = 100 * time.Millisecond, 4 * time.Second
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.isolated(t, transport.WithKeepAlive(interval, timeout))
			cmd, s, c := dialEchoChild(t, tc, opts)
			require.Equal(t, tc.want(), s.Transport())
			require.Contains(t, transport.SessionsTo(s.Peer().ID), s)
			require.NotZero(t, waitRTT(t, s))

			readErr := make(chan error, 1)
			go func() {
				_, err := c.Read(make([]byte, 1))
				readErr <- err
			}()
			require.NoError(t, s.Err(), "the session ended before the peer stopped")
			require.NoError(t, cmd.Process.Signal(syscall.SIGSTOP))
			start := time.Now()
			bound := interval + 2*timeout + 5*time.Second // slack for a loaded 2-core CI
			select {
			case <-s.Done():
			case <-time.After(bound):
				t.Fatalf("session still open %v after the peer stopped", bound)
			}
			t.Logf("dead peer detected after %v", time.Since(start))
			require.ErrorIs(t, s.Err(), transport.ErrKeepAlive)
			require.NotContains(t, transport.SessionsTo(s.Peer().ID), s)
			select {
			case err := <-readErr:
				require.ErrorIs(t, err, net.ErrClosed)
			case <-time.After(testTimeout):
				t.Fatal("pending Read not failed")
			}
		})
	}
}

// waitRTT waits (bounded) until a keepalive ping has been answered.
func waitRTT(t *testing.T, s *transport.Session) time.Duration {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for s.RTT() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // polling an observable, bounded
	}
	return s.RTT()
}

// TestPeerKilled kills the peer process: the session closes promptly (the
// connection breaks; no keepalive needed), leaves the registry, and a pending
// Read fails.
func TestPeerKilled(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			// Keepalive off: the broken connection alone must be noticed.
			opts := tc.isolated(t, transport.WithKeepAlive(-1, 0))
			cmd, s, c := dialEchoChild(t, tc, opts)
			readErr := make(chan error, 1)
			go func() {
				_, err := c.Read(make([]byte, 1))
				readErr <- err
			}()
			require.NoError(t, cmd.Process.Kill())
			start := time.Now()
			select {
			case <-s.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("session still open 10s after the peer was killed")
			}
			t.Logf("killed peer detected after %v", time.Since(start))
			require.ErrorIs(t, s.Err(), transport.ErrPeerGone)
			require.Empty(t, transport.SessionsTo(s.Peer().ID))
			select {
			case err := <-readErr:
				require.Error(t, err)
			case <-time.After(testTimeout):
				t.Fatal("pending Read not failed")
			}
		})
	}
}
