package transport

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
)

// internalUCX returns a UCX context over tcp, skipping (or failing under
// GDRPC_REQUIRE=ucx) when UCX is absent.
func internalUCX(t *testing.T) *rdma.Context {
	t.Helper()
	testenv.Need(t, "ucx", rdma.Available())
	rc, err := rdma.NewContext(rdma.WithTransports("tcp"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = rc.Close() })
	return rc
}

// TestUpgradeFallback: the server offers UCX but the client cannot reach its
// UCX listener. In auto mode the session stays on TCP; when either side
// requires UCX the dial fails with a clear error.
func TestUpgradeFallback(t *testing.T) {
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithTrustPeers(true)) // auto mode upgrades
	require.NoError(t, err)
	defer l.Close()
	require.NotNil(t, l.ucx)
	require.NoError(t, l.ucx.Close()) // UCX dials to it now fail

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	m := &countMetrics{}
	s, err := Dial(ctx, l.Addr().String(), WithRDMAContext(rc), WithMetrics(m), WithTrustPeers(true))
	require.NoError(t, err)
	require.Equal(t, "tcp", s.Transport())
	m.mu.Lock()
	require.Equal(t, 1, m.up["tcp"])
	require.Len(t, m.fallbacks, 1)
	require.Contains(t, m.fallbacks[0], "UCX upgrade failed")
	m.mu.Unlock()
	defer func() {
		require.NoError(t, s.Close())
		m.mu.Lock()
		defer m.mu.Unlock()
		require.Equal(t, 1, m.down["tcp"])
	}()
	c, err := s.Conn(ctx)
	require.NoError(t, err)
	var sc net.Conn
	select {
	case sc = <-accepted:
	case <-ctx.Done():
		t.Fatal("no session accepted")
	}
	require.Equal(t, "tcp", SessionOf(sc).Transport())
	_, err = c.Write([]byte("x"))
	require.NoError(t, err)
	b := make([]byte, 1)
	_, err = io.ReadFull(sc, b)
	require.NoError(t, err)
	require.Equal(t, "x", string(b))

	_, err = Dial(ctx, l.Addr().String(), WithRDMAContext(rc), WithMode(ModeUCX))
	require.ErrorContains(t, err, "UCX upgrade")
}

// TestUpgradeWrongToken: the UCX listener turns a connection away while no
// handshake whose client proved its id waits for one; while one waits, an
// endpoint that does not present a pending session's token is refused and
// closed.
func TestUpgradeWrongToken(t *testing.T) {
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX))
	require.NoError(t, err)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = rc.Worker().Dial(ctx, l.UCXAddr().String())
	require.ErrorIs(t, err, rdma.ErrRejected, "no handshake waits for a UCX endpoint")

	pu := l.expect(newToken()) // a handshake that waits for its upgrade
	defer l.abandon(pu)
	_, err = rc.Worker().Dial(ctx, l.UCXAddr().String())
	require.ErrorIs(t, err, rdma.ErrRejected, "its client has not proved its id yet")
	l.prove(pu)
	ep, err := rc.Worker().Dial(ctx, l.UCXAddr().String())
	require.NoError(t, err)
	defer ep.Close()
	tok := newToken()
	_, err = ep.Write(append([]byte(upgradeMagic), tok[:]...))
	require.NoError(t, err)
	require.NoError(t, ep.SetReadDeadline(time.Now().Add(20*time.Second)))
	b, err := io.ReadAll(ep)
	require.Equal(t, []byte{0}, b, "a refusal, then the end")
	if err != nil {
		require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
	}
}

type countMetrics struct {
	mu        sync.Mutex
	up, down  map[string]int
	fallbacks []string
}

func (m *countMetrics) SessionUp(tr string, _ bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.up == nil {
		m.up = map[string]int{}
	}
	m.up[tr]++
}

func (m *countMetrics) SessionDown(tr string, _ bool, _ error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.down == nil {
		m.down = map[string]int{}
	}
	m.down[tr]++
}

func (m *countMetrics) Fallback(reason string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fallbacks = append(m.fallbacks, reason)
}

// A session without an engine runs no transfers: a peer that writes on its
// bulk lane anyway ends the session at the first byte, instead of leaving
// what it sends unread (over UCX, where nothing bounds it, it would pile up
// in this process).
func TestLaneWithoutEngine(t *testing.T) {
	for _, mode := range []Mode{ModeTCP, ModeUCX} {
		t.Run(string(mode), func(t *testing.T) {
			opts := []Option{WithMode(mode)}
			if mode == ModeUCX {
				opts = append(opts, WithRDMAContext(internalUCX(t)))
			}
			l, err := Listen("127.0.0.1:0", opts...)
			require.NoError(t, err)
			defer l.Close()
			accepted := acceptOne(l)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			s, err := Dial(ctx, l.Addr().String(), opts...)
			require.NoError(t, err)
			defer s.Close()
			_, err = s.Conn(ctx) // the gRPC stream: the session lives on its own
			require.NoError(t, err)
			var server *Session
			select {
			case c := <-accepted:
				server = SessionOf(c)
			case <-ctx.Done():
				t.Fatal("no conn accepted")
			}
			require.NotNil(t, server)
			b := s.bulkLane()
			require.NotNil(t, b, "transport %s", s.Transport())
			_, err = b.Write([]byte("frame"))
			require.NoError(t, err)
			select {
			case <-server.Done():
			case <-ctx.Done():
				t.Fatal("the session outlived data on a lane it does not read")
			}
			require.ErrorIs(t, server.Err(), errLaneNoEngine)
		})
	}
}

// acceptOne accepts l's next conn, if one comes, into the channel it returns.
func acceptOne(l *Listener) <-chan net.Conn {
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	return accepted
}

// TestServerChoseTCP: a client that trusts its peers and offers UCX, dialing
// a server that does not trust its clients, gets a TCP session and says why
// (a fallback, a log line); a client that offered nothing says nothing.
func TestServerChoseTCP(t *testing.T) {
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", WithRDMAContext(rc)) // untrusted clients: TCP
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
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, trust := range []bool{true, false} {
		m := &countMetrics{}
		var logs testenv.LogBuffer
		logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
		s, err := Dial(ctx, l.Addr().String(), WithRDMAContext(rc), WithMetrics(m), WithTrustPeers(trust), WithLogger(logger))
		require.NoError(t, err)
		require.Equal(t, "tcp", s.Transport())
		require.NoError(t, s.Close())
		m.mu.Lock()
		fallbacks := m.fallbacks
		m.mu.Unlock()
		if !trust {
			require.Empty(t, fallbacks, "a client that offered no UCX")
			require.NotContains(t, logs.String(), "server chose TCP")
			continue
		}
		require.Equal(t, []string{serverChoseTCP}, fallbacks)
		require.Contains(t, logs.String(), "server chose TCP: it does not trust this client")
	}
}
