package dialer_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// A client process that closes its ClientConn, then its Dialer, before it
// exits ends its session cleanly: its server logs the session closed by its
// peer, at debug level, not lost (ClientConn.Close alone does not wait for
// the session, and a UCX session cut short by the exit looks lost).
func TestDialerCloseEndsSessions(t *testing.T) {
	for _, tc := range []transportCase{transportCases[0], transportCases[2]} {
		t.Run(tc.name, func(t *testing.T) {
			var logs testenv.LogBuffer
			logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(tc.options(t)...), gdrpc.WithLogger(logger))
			require.NoError(t, err)
			srv := grpc.NewServer(listener.ServerOptions(nil)...)
			testpb.RegisterTestServiceServer(srv, testService{})
			go func() { _ = srv.Serve(lis) }()
			defer srv.Stop()

			_, line := startChild(t, nil, "grpc-client", "GDRPC_TEST_ADDR="+lis.Addr().String(), "GDRPC_TEST_UCX="+tc.ucx, "GDRPC_TEST_DIALER_CLOSE=1")
			require.Equal(t, "OK transport="+tc.want()+" samehost=true", line)
			// The child printed its line once its Dialer was closed.
			require.Eventually(t, func() bool {
				return strings.Contains(logs.String(), "session closed") || strings.Contains(logs.String(), "session lost")
			},
				testTimeout, time.Millisecond)
			require.NotContains(t, logs.String(), "session lost", "the server's log")
		})
	}
}

// A closed Dialer dials no more, and closes a second time as it did the
// first.
func TestDialerClosed(t *testing.T) {
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP))
	require.NoError(t, d.Close())
	_, err := d.DialContext(t.Context(), "127.0.0.1:1")
	require.ErrorContains(t, err, "dialer closed")
	require.NoError(t, d.Close())
}

// Close returns once every session the Dialer made is closed, whether its
// ClientConn was closed first or not, and a Close called meanwhile returns
// only then too.
func TestDialerCloseWaits(t *testing.T) {
	for _, tc := range []transportCase{transportCases[0], transportCases[2]} {
		t.Run(tc.name, func(t *testing.T) {
			addr, _ := start(t, tc, testService{})
			d := dialer.New(gdrpc.WithSessionOptions(tc.options(t)...))
			var sessions []*gdrpc.Session
			for i := range 2 {
				cc, s := dialCall(t, d, addr)
				sessions = append(sessions, s)
				if i == 0 {
					require.NoError(t, cc.Close()) // closing gracefully
				} else {
					defer cc.Close() // still up when the Dialer closes
				}
			}
			var wg sync.WaitGroup
			for range 2 {
				wg.Go(func() {
					require.NoError(t, d.Close())
					for i, s := range sessions {
						select {
						case <-s.Released():
						default:
							t.Errorf("session %d still up when Close returned", i)
						}
					}
				})
			}
			wg.Wait()
		})
	}
}

// Shutdown whose context ended cuts the sessions' graceful close short (a
// session that carried the gdr codec lingers oob.LingerIdle after its conn
// closed, for pulls still to come), returns the context's error once they
// are closed, and a Close after it returns at once.
func TestDialerShutdownCuts(t *testing.T) {
	for _, tc := range []transportCase{transportCases[0], transportCases[2]} {
		t.Run(tc.name, func(t *testing.T) {
			addr, _ := start(t, tc, testService{})
			d := dialer.New(gdrpc.WithSessionOptions(tc.options(t)...))
			cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(nil)...)
			require.NoError(t, err)
			defer cc.Close()
			var p peer.Peer
			_, err = testpb.NewTestServiceClient(cc).UnaryCall(t.Context(), &testpb.SimpleRequest{Payload: &testpb.Payload{Body: pattern(1024)}}, grpc.Peer(&p))
			require.NoError(t, err)
			s := gdrpc.SessionFromPeer(&p)
			require.NotNil(t, s)
			require.True(t, s.Speaks("gdr"), "the session lingers when closed gracefully")

			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			start := time.Now()
			require.ErrorIs(t, d.Shutdown(ctx), context.Canceled)
			took := time.Since(start)
			select {
			case <-s.Released():
			default:
				t.Fatal("session still up when Shutdown returned")
			}
			require.Less(t, took, oob.LingerIdle, "the linger was cut")
			require.NoError(t, d.Close())
			_, err = d.DialContext(t.Context(), addr)
			require.ErrorContains(t, err, "dialer closed")
		})
	}
}

// Close and Shutdown cancel a dial under way rather than wait for it: to a
// server that accepts the TCP connection and never answers, the dial would
// take its whole handshake timeout (a minute here). Both return at once, and
// the dial fails with an error wrapping net.ErrClosed, returning no conn.
func TestDialerCloseCancelsDials(t *testing.T) {
	for _, shutdown := range []bool{false, true} {
		t.Run(map[bool]string{false: "Close", true: "Shutdown"}[shutdown], func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			accepted := make(chan net.Conn, 1)
			go func() {
				if c, err := ln.Accept(); err == nil {
					accepted <- c
				}
			}()
			t.Cleanup(func() { ln.Close() })
			d := dialer.New(gdrpc.WithTransport(transport.ModeTCP),
				gdrpc.WithSessionOptions(transport.WithHandshakeTimeout(time.Minute)))
			dialed := make(chan error, 1)
			go func() {
				c, err := d.DialContext(context.Background(), ln.Addr().String())
				if c != nil {
					c.Close()
					err = fmt.Errorf("a conn came back (and %v)", err)
				}
				dialed <- err
			}()
			var c net.Conn
			select {
			case c = <-accepted: // the dial waits for the server's answer
			case <-time.After(testTimeout):
				t.Fatal("the dial never connected")
			}
			defer c.Close()
			start := time.Now()
			if shutdown {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				require.NoError(t, d.Shutdown(ctx))
			} else {
				require.NoError(t, d.Close())
			}
			require.Less(t, time.Since(start), 10*time.Second, "closing waited for the dial")
			// Closing waited for the dial (its goroutine may not have sent
			// the result yet).
			select {
			case err := <-dialed:
				require.True(t, errors.Is(err, net.ErrClosed), "the dial's error: %v", err)
			case <-time.After(testTimeout):
				t.Fatal("the dial went on after closing returned")
			}
		})
	}
}

// slowEngine stands for an engine whose handlers still run after their
// session was released: its first session's Closed waits for release.
type slowEngine struct {
	n       atomic.Int32
	release chan struct{}
	ran     atomic.Bool // the first session's Closed returned
}

func (e *slowEngine) Codecs() []string { return []string{"gdr"} }
func (e *slowEngine) Attach(*transport.Session, *transport.Link) transport.Handler {
	return &slowHandler{e: e, first: e.n.Add(1) == 1}
}

type slowHandler struct {
	e     *slowEngine
	first bool
}

func (h *slowHandler) Control(byte, []byte) {}
func (h *slowHandler) Bulk(c net.Conn)      { _ = c.Close() }
func (h *slowHandler) Lane(c net.Conn) error {
	_, err := io.Copy(io.Discard, c)
	return err
}
func (h *slowHandler) Linger() {}
func (h *slowHandler) Closed() {
	if h.first {
		<-h.e.release
		h.e.ran.Store(true)
	}
}
func (h *slowHandler) Join() {}

// Close waits for a session that a later dial found released and dropped
// from the Dialer's sessions: its engine's handlers may still be running.
func TestDialerCloseWaitsForReleasedSessions(t *testing.T) {
	addr, _ := start(t, transportCases[2], testService{}) // tcp
	eng := &slowEngine{release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(eng.release) }) }
	defer release()
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), gdrpc.WithSessionOptions(transport.WithEngine(eng)))
	call := func() (*grpc.ClientConn, *gdrpc.Session) {
		cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(nil)...)
		require.NoError(t, err)
		var p peer.Peer
		_, err = testpb.NewTestServiceClient(cc).EmptyCall(t.Context(), &testpb.Empty{}, grpc.Peer(&p))
		require.NoError(t, err)
		return cc, gdrpc.SessionFromPeer(&p)
	}
	cc, first := call()
	require.NoError(t, cc.Close())
	select {
	case <-first.Released():
	case <-time.After(10 * time.Second):
		t.Fatal("the first session was not released")
	}
	cc, _ = call() // this dial drops the first session from the Dialer's
	require.NoError(t, cc.Close())

	closed := make(chan struct{})
	go func() {
		_ = d.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while the first session's handler still ran")
	case <-time.After(time.Second): // Close returning this soon would be wrong
	}
	release()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return once the handler ended")
	}
	require.True(t, eng.ran.Load())
}

// A Dialer forgets a session it made once the session is released (its
// ClientConn closed), without waiting for its next dial or its Close.
func TestDialerForgetsReleased(t *testing.T) {
	tc := transportCases[2]
	addr, _ := start(t, tc, testService{})
	d := dialer.New(gdrpc.WithSessionOptions(tc.options(t)...))
	defer d.Close()
	var sessions []*gdrpc.Session
	for range 3 {
		cc, s := dialCall(t, d, addr)
		sessions = append(sessions, s)
		require.NoError(t, cc.Close())
	}
	for i, s := range sessions {
		select {
		case <-s.Released():
		case <-time.After(testTimeout):
			t.Fatalf("session %d was not released after its ClientConn closed", i)
		}
	}
	require.Eventually(t, func() bool { return d.Sessions() == 0 }, testTimeout, time.Millisecond, "sessions the Dialer still holds")
}

// dialCall makes a ClientConn to addr over d and calls it once (1 KiB): it
// returns the conn and the session the call went over.
func dialCall(t *testing.T, d *dialer.Dialer, addr string) (*grpc.ClientConn, *gdrpc.Session) {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(nil)...)
	require.NoError(t, err)
	var p peer.Peer
	_, err = testpb.NewTestServiceClient(cc).UnaryCall(t.Context(), &testpb.SimpleRequest{Payload: &testpb.Payload{Body: pattern(1024)}}, grpc.Peer(&p))
	require.NoError(t, err)
	s := gdrpc.SessionFromPeer(&p)
	require.NotNil(t, s)
	return cc, s
}
