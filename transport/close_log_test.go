package transport

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
)

// TestPeerCloseLogsNoLoss: a peer that closes its session (a client's
// ClientConn.Close, its process exiting) ends whichever of the session's
// streams reaches the end first, a frame lane among them. The other side logs
// that at debug level, as the session closed by its peer, not as a session
// lost at info level.
func TestPeerCloseLogsNoLoss(t *testing.T) {
	setHook(t, &testHooks.lane, func(_ *Session, c net.Conn) error {
		// As the out-of-band engine's reader: until the lane fails, and
		// then its error as it came.
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				return err
			}
		}
	})
	for _, mode := range []Mode{ModeTCP, ModeUCX} {
		t.Run(string(mode), func(t *testing.T) {
			if mode == ModeUCX && rdma.Available() != nil {
				t.Skip("no UCX")
			}
			var logs testenv.LogBuffer
			logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			_, cs, ss, _, _ := lanePair(t, []Option{WithMode(mode), WithLogger(logger)}, []Option{WithMode(mode)})
			select {
			case <-ss.bulk.ready:
			case <-time.After(10 * time.Second):
				t.Fatal("the server's bulk lane never came up")
			}
			require.NoError(t, cs.Close())
			select {
			case <-ss.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the server's session outlived its peer's close")
			}
			require.Eventually(t, func() bool {
				return strings.Contains(logs.String(), "session closed") || strings.Contains(logs.String(), "session lost")
			}, 10*time.Second, time.Millisecond, logs.String())
			require.NotContains(t, logs.String(), "session lost", "the server's log")
			require.NotContains(t, logs.String(), "level=INFO", "the server's log")
		})
	}
}

// TestOrderlyCloseIsNoLoss: a side that began an orderly close (its gRPC
// stream closed) reports its session closed, not lost, when the peer's end
// of the connection, which that close prompts, reaches it before its own
// close completes; a session that began no close still reports the loss.
func TestOrderlyCloseIsNoLoss(t *testing.T) {
	for _, mode := range []Mode{ModeTCP, ModeUCX} {
		t.Run(string(mode), func(t *testing.T) {
			if mode == ModeUCX && rdma.Available() != nil {
				t.Skip("no UCX")
			}
			_, cs, ss, _, _ := lanePair(t, []Option{WithMode(mode)}, []Option{WithMode(mode)})
			release := heldLinger(t, cs)
			cs.closeGracefully()
			cs.closeWith(ErrPeerGone) // as the monitor does when the peer's end comes first
			release()
			require.ErrorIs(t, cs.Err(), ErrSessionClosed)
			require.NotErrorIs(t, cs.Err(), ErrPeerGone)

			ss.closeWith(ErrPeerGone)
			require.ErrorIs(t, ss.Err(), ErrPeerGone, "no close begun: the peer is gone")

			// A reset during an orderly close is a loss all the same.
			_, cs, _, _, _ = lanePair(t, []Option{WithMode(mode)}, []Option{WithMode(mode)})
			release = heldLinger(t, cs)
			cs.closeGracefully()
			cs.closeWith(fmt.Errorf("%w: %w", ErrPeerGone, syscall.ECONNRESET))
			release()
			require.ErrorIs(t, cs.Err(), ErrPeerGone)
			require.ErrorIs(t, cs.Err(), syscall.ECONNRESET)
		})
	}
}

// heldLinger holds the orderly close of s in the handler's Linger until the
// returned release runs (at the latest as the test ends): what the test does
// meanwhile comes before that close completes, however the goroutines are
// scheduled.
func heldLinger(t *testing.T, s *Session) (release func()) {
	held := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(held) }) }
	setHook(t, &testHooks.linger, func(ls *Session) {
		if ls == s {
			<-held
		}
	})
	t.Cleanup(release)
	return release
}

// TestOrderlyCloseLeavesNoReset: a side whose orderly close completes while
// bytes its peer sent are still unread (a notice on a lane nobody read yet)
// ends its TCP connections with their end, not a reset: the peer reports its
// session closed by the peer, not lost.
func TestOrderlyCloseLeavesNoReset(t *testing.T) {
	// The server's reader reads a duplicate of the lane's socket, which the
	// server's own close (on whichever of the client's ends reaches it
	// first) leaves open: it sees the client's end of that lane as it came.
	ends := make(chan error, 2)
	setHook(t, &testHooks.lane, func(s *Session, c net.Conn) error {
		if s.client {
			return nil // the client's lanes stay unread
		}
		f, err := tcpOf(c.(*laneConn).ep).File()
		if err != nil {
			ends <- err
			return err
		}
		defer f.Close()
		buf := make([]byte, 4096)
		for {
			if _, err := f.Read(buf); err != nil {
				ends <- err
				return err
			}
		}
	})
	var logs testenv.LogBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	_, cs, ss, _, _ := lanePair(t, []Option{WithMode(ModeTCP), WithLogger(logger)}, []Option{WithMode(ModeTCP)})
	for _, l := range []*frameLane{&ss.bulk, &cs.bulk} {
		select {
		case <-l.ready:
		case <-time.After(10 * time.Second):
			t.Fatal("a bulk lane never came up")
		}
	}
	const n = 1024
	_, err := ss.bulk.conn().Write(make([]byte, n))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return unreadBytes(t, cs.bulk.conn()) == n }, 10*time.Second, time.Millisecond,
		"the server's bytes reached the client's socket")

	cs.closeGracefully()
	for _, s := range []*Session{cs, ss} {
		select {
		case <-s.Released():
		case <-time.After(10 * time.Second):
			t.Fatal("a session did not close")
		}
	}
	require.ErrorIs(t, cs.Err(), ErrSessionClosed)
	require.ErrorIs(t, <-ends, io.EOF, "the client's end of the server's bulk lane")
	require.ErrorIs(t, ss.Err(), ErrPeerGone)
	require.NotErrorIs(t, ss.Err(), syscall.ECONNRESET)
	require.NotContains(t, logs.String(), "session lost", "the server's log")
}

// unreadBytes returns how many bytes wait in the socket of c, a TCP lane.
func unreadBytes(t *testing.T, c net.Conn) int {
	t.Helper()
	tc := tcpOf(c.(*laneConn).ep)
	require.NotNil(t, tc)
	rc, err := tc.SyscallConn()
	require.NoError(t, err)
	var n int32
	var errno syscall.Errno
	require.NoError(t, rc.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCINQ, uintptr(unsafe.Pointer(&n)))
	}))
	require.Zero(t, errno)
	return int(n)
}
