package transport

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A stream the peer should not have opened (a role this side does not
// know, a second gRPC stream) ends the session with a protocol error:
// closing the stream alone left yamux keeping what the peer sent on it, up
// to its 16 MiB window each, for a minute.
func TestRefusedStreamEndsSession(t *testing.T) {
	for _, tc := range []struct {
		name string
		role byte
		want string
	}{{"unknown role", 'X', "unknown role"}, {"second gRPC stream", roleGRPC, "unexpected gRPC stream"}} {
		t.Run(tc.name, func(t *testing.T) {
			opts := []Option{WithMode(ModeTCP), WithLanes(false), WithIdleTimeout(-1)}
			_, cs, ss, cc, _ := lanePair(t, opts, opts)
			require.NotNil(t, cc, "the session's gRPC stream is open")
			st, err := cs.mux.OpenStream()
			require.NoError(t, err)
			_, err = st.Write([]byte{tc.role})
			require.NoError(t, err)
			select {
			case <-ss.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the server's session outlived the stream")
			}
			require.ErrorContains(t, ss.Err(), tc.want)
		})
	}
}

// A peer that keeps its keepalive going but reads nothing of its control
// stream ends the session once a control write waited for the keepalive
// timeout, instead of holding the writer, and every sender after it, for
// good.
func TestControlWriteBounded(t *testing.T) {
	for _, lanes := range []bool{true, false} {
		t.Run(map[bool]string{true: "lane", false: "mux"}[lanes], func(t *testing.T) {
			release := make(chan struct{})
			var once sync.Once
			unblock := func() { once.Do(func() { close(release) }) }
			setHook(t, &testHooks.control, func(s *Session, typ byte, payload []byte) {
				if s.client {
					<-release // the client reads its control stream no more
				}
			})
			opts := []Option{WithMode(ModeTCP), WithLanes(lanes), WithIdleTimeout(-1), WithKeepAlive(100*time.Millisecond, 500*time.Millisecond)}
			_, cs, ss, _, _ := lanePair(t, opts, opts)
			t.Cleanup(func() { unblock(); _ = cs.Close() })
			payload := make([]byte, 64<<10)
			var err error
			for err == nil {
				// Each call's own bound is long: the write's deadline ends it.
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				err = ss.link.SendControl(ctx, 7, payload)
				cancel()
			}
			require.ErrorIs(t, err, ErrPeerGone)
			<-ss.Done()
			require.ErrorContains(t, ss.Err(), "control write")
		})
	}
}
