package transport

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
)

// TestJunkConnectionsLogLimited: connections that anyone who reaches the
// port can open and fail (junk bytes, a lane with an unknown token, a
// hello cut short) are logged once per kind at Warn, the rest at Debug,
// instead of one Warn line each.
func TestJunkConnectionsLogLimited(t *testing.T) {
	var logs testenv.LogBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithLogger(logger))
	require.NoError(t, err)
	defer l.Close()
	kinds := []struct {
		send []byte
		msg  string
	}{
		{[]byte("xxxxxx"), "not a gdrpc, HTTP/2 or TLS client"},
		{append([]byte(laneMagic), make([]byte, 17)...), "lane refused"},
		{[]byte(magic), "handshake failed"},
	}
	const per = 40
	for _, k := range kinds {
		for range per {
			c, err := net.Dial("tcp", l.Addr().String())
			require.NoError(t, err)
			_, err = c.Write(k.send)
			require.NoError(t, err)
			require.NoError(t, c.Close())
		}
	}
	lines := func(msg string) (warn, debug int) {
		for _, line := range strings.Split(logs.String(), "\n") {
			if !strings.Contains(line, msg) {
				continue
			}
			switch {
			case strings.Contains(line, "level=WARN"):
				warn++
			case strings.Contains(line, "level=DEBUG"):
				debug++
			default:
				t.Errorf("logged at another level: %s", line)
			}
		}
		return warn, debug
	}
	for _, k := range kinds {
		require.Eventually(t, func() bool {
			w, d := lines(k.msg)
			return w+d == per
		}, 10*time.Second, time.Millisecond, "every connection logged: %s", k.msg)
		w, _ := lines(k.msg)
		require.Equal(t, 1, w, "%s: one line at Warn", k.msg)
	}
	require.Contains(t, logs.String(), "peer closed the connection before its hello")
	// Another class of failure has its own Warn: a hello whose header
	// announces no body.
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	_, err = c.Write(append([]byte(magic), 0, 1, 0, 0, 0, 0))
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool {
		w, _ := lines("handshake failed")
		return w == 2
	}, 10*time.Second, time.Millisecond, "a malformed hello logged at Warn")
}

// TestUnservedSessionLogsDebug: a session whose client completed its
// handshake and opened no gRPC stream (any peer can, with a fresh key) is
// closed and logged at Debug, not as a session lost at Info.
func TestUnservedSessionLogsDebug(t *testing.T) {
	var logs testenv.LogBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithLogger(logger), WithHandshakeTimeout(time.Second))
	require.NoError(t, err)
	defer l.Close()
	const n = 3
	for range n {
		handClient(t, l.Addr().String(), ModeTCP, Caps{}, true)
	}
	require.Eventually(t, func() bool {
		return strings.Count(logs.String(), "opened no gRPC stream") == n
	}, 10*time.Second, time.Millisecond, logs.String())
	require.NotContains(t, logs.String(), "session lost")
	require.NotContains(t, logs.String(), "level=INFO")
	require.NotContains(t, logs.String(), "level=WARN")
}

// TestPeerLogHeldBack: a kind of line logged again within the interval goes
// to Debug, and the next one at its level says how many did.
func TestPeerLogHeldBack(t *testing.T) {
	var logs testenv.LogBuffer
	p := newPeerLog(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})), time.Hour)
	p.Warn("a", "n", 1)
	p.Warn("a", "n", 2)
	p.Warn("a", "n", 3)
	p.Info("b")
	require.Equal(t, 1, strings.Count(logs.String(), "level=WARN msg=a n=1\n"))
	require.Equal(t, 1, strings.Count(logs.String(), "level=DEBUG msg=a n=2\n"))
	require.Equal(t, 1, strings.Count(logs.String(), "level=INFO msg=b\n"), "each kind has its own interval")
	p.mu.Lock()
	p.kinds["a"].at = time.Now().Add(-2 * time.Hour) // the interval is over
	p.mu.Unlock()
	p.Warn("a", "n", 4)
	require.Contains(t, logs.String(), "level=WARN msg=a n=4 more_at_debug=2 since=")
	p.Warn("a", "n", 5)
	require.Contains(t, logs.String(), "level=DEBUG msg=a n=5\n")

	// WarnErr: each class of error on its own interval.
	gone := fmt.Errorf("%w: x", ErrPeerGone)
	p.WarnErr("h", gone)
	p.WarnErr("h", gone)
	p.WarnErr("h", &VersionError{Remote: 9})
	p.WarnErr("h", &IdentityError{Reason: "y"})
	require.Equal(t, 3, strings.Count(logs.String(), "level=WARN msg=h "), logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), "level=DEBUG msg=h "), logs.String())
}

// TestLostSessionsLogLimited: a peer that completes handshakes with fresh
// keys and then breaks the protocol (here: a stream of unknown role) loses
// one server session per connection; the listener logs the first loss at
// Info and the next ones, within its interval, at Debug.
func TestLostSessionsLogLimited(t *testing.T) {
	var logs testenv.LogBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	l, err := Listen("127.0.0.1:0", WithEngine(testEngine{}), WithMode(ModeTCP), WithLanes(false), WithLogger(logger))
	require.NoError(t, err)
	defer l.Close()
	const n = 3
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		cs, err := Dial(ctx, l.Addr().String(), WithEngine(testEngine{}), WithMode(ModeTCP), WithLanes(false), WithIdentity(NewIdentity()))
		cancel()
		require.NoError(t, err)
		t.Cleanup(func() { _ = cs.Close() })
		st, err := cs.mux.OpenStream()
		require.NoError(t, err)
		_, _ = st.Write([]byte{'X'})
		select {
		case <-cs.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the session outlived its stream of unknown role")
		}
	}
	require.Eventually(t, func() bool { return strings.Count(logs.String(), "session lost") == n }, 10*time.Second, time.Millisecond, logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), `level=INFO msg="session lost"`), logs.String())
	require.Equal(t, n-1, strings.Count(logs.String(), `level=DEBUG msg="session lost"`), logs.String())
}
