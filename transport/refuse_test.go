package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
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
			// The write's error is not looked at: the server may end the
			// session over the role before yamux reports the write done.
			_, _ = st.Write([]byte{tc.role})
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
			// Pings every 100 ms, all answered; the timeout, which bounds
			// the control write too, is long enough that a loaded machine
			// (the race detector beside other packages' tests) still gets
			// its pongs back in time, so the write's deadline is what ends
			// the session, not a missed ping.
			opts := []Option{WithMode(ModeTCP), WithLanes(lanes), WithIdleTimeout(-1), WithKeepAlive(100*time.Millisecond, 3*time.Second)}
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

// A peer that floods keepalive pings and reads nothing (yamux answers each
// on a goroutine of its own, which waits for the peer to read) ends its
// session; honest pings, however many, are answered.
func TestPingFloodEndsSession(t *testing.T) {
	cli, s := handPlayedPeer(t, WithKeepAlive(-1, 0))
	flood := make([]byte, 0, (maxPeerPings+1)*yamuxHeaderLen)
	for i := range maxPeerPings + 1 {
		// version 0, type ping, flag SYN, stream 0, the ping's id
		flood = append(flood, 0, 2, 0, 1, 0, 0, 0, byte(i>>8), 0, 0, 0, byte(i))
	}
	go func() { _, _ = cli.Write(flood) }() // a pipe: it waits for the reader
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the session outlived a ping flood")
	}
	require.ErrorIs(t, s.Err(), ErrPeerGone)
	require.ErrorIs(t, s.Err(), errPingFlood)

	// Pings answered one by one never add up, at any rate.
	opts := []Option{WithMode(ModeTCP), WithLanes(false), WithIdleTimeout(-1), WithKeepAlive(time.Millisecond, 5*time.Second)}
	_, cs, ss, _, _ := lanePair(t, opts, opts)
	for range 2 * maxPeerPings {
		_, err := cs.mux.Ping()
		require.NoError(t, err)
	}
	require.NoError(t, ss.Err())
	require.NoError(t, cs.Err())
}

// The ping counter follows frames across reads of any size: data bodies
// are passed over whatever they contain, and only ping requests count.
func TestPingCounterFrames(t *testing.T) {
	var stream []byte
	data := []byte{0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 24}
	for range 2 * maxPeerPings {
		stream = append(stream, data...)
		// a body full of ping requests
		for range 2 {
			stream = append(stream, 0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9)
		}
		stream = append(stream, 0, 2, 0, 2, 0, 0, 0, 0, 0, 0, 0, 9) // a ping's answer
	}
	for _, piece := range []int{1, 5, 12, 13, 4096} {
		var pc pingCounter
		for rest := stream; len(rest) > 0; {
			k := min(piece, len(rest))
			require.NoError(t, pc.scan(rest[:k]), "piece %d", piece)
			rest = rest[k:]
		}
		require.NoError(t, pc.scan([]byte{0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1}))
		require.Equal(t, int64(1), pc.unanswered.Load(), "piece %d", piece)
	}
	// Answers written take their requests off.
	var pc pingCounter
	for i := range maxPeerPings {
		require.NoError(t, pc.scan([]byte{0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, byte(i)}))
	}
	pc.wrote([]byte{0, 2, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0})
	require.NoError(t, pc.scan([]byte{0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0}))
	require.ErrorIs(t, pc.scan([]byte{0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0}), errPingFlood)
}

// A control message's header without its payload ends the session within
// the keepalive timeout, and the payload's memory is not taken up front.
func TestControlPayloadBounded(t *testing.T) {
	for _, lanes := range []bool{true, false} {
		t.Run(map[bool]string{true: "lane", false: "mux"}[lanes], func(t *testing.T) {
			// No pings: the payload's deadline, the keepalive timeout, is
			// what ends the session. The timeout bounds the multiplexer's
			// writes too, so it leaves a loaded machine room to set up.
			opts := []Option{WithMode(ModeTCP), WithLanes(lanes), WithIdleTimeout(-1), WithKeepAlive(time.Hour, 2*time.Second)}
			_, cs, ss, _, _ := lanePair(t, opts, opts)
			<-cs.ctrl.ready
			hdr := []byte{7, 0, 0, 0, 0}
			binary.BigEndian.PutUint32(hdr[1:], MaxControlPayload)
			_, err := cs.ctrl.c.Write(append(hdr, "a few bytes"...))
			require.NoError(t, err)
			select {
			case <-ss.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("a control header without its payload held the session")
			}
			require.ErrorIs(t, ss.Err(), ErrPeerGone)
			var te net.Error
			require.ErrorAs(t, ss.Err(), &te)
			require.True(t, te.Timeout(), "%v", ss.Err())
		})
	}
}

// Control payloads of every size arrive whole, whatever pieces they come in.
func TestControlPayloadSizes(t *testing.T) {
	got := make(chan []byte, 1)
	setHook(t, &testHooks.control, func(s *Session, typ byte, payload []byte) {
		if !s.client && typ == 9 {
			got <- bytes.Clone(payload)
		}
	})
	opts := []Option{WithMode(ModeTCP), WithLanes(false), WithIdleTimeout(-1)}
	_, cs, _, _, _ := lanePair(t, opts, opts)
	for _, n := range []int{0, 1, 64<<10 - 1, 64 << 10, 64<<10 + 1, 300_001, MaxControlPayload} {
		want := make([]byte, n)
		for i := range want {
			want[i] = byte(i * 7)
		}
		require.NoError(t, cs.link.SendControl(context.Background(), 9, want))
		require.Equal(t, want, <-got, "%d bytes", n)
	}
}

// Control messages sent back to back, the first of them large, arrive each
// whole and in order: a payload's read stops at its announced length, with
// lanes and without.
func TestControlMessagesBackToBack(t *testing.T) {
	type msg struct {
		typ     byte
		payload []byte
	}
	got := make(chan msg, 8)
	setHook(t, &testHooks.control, func(s *Session, typ byte, payload []byte) {
		if !s.client && (typ == 9 || typ == 10) {
			got <- msg{typ, bytes.Clone(payload)}
		}
	})
	for _, lanes := range []bool{false, true} {
		t.Run(fmt.Sprintf("lanes=%v", lanes), func(t *testing.T) {
			opts := []Option{WithMode(ModeTCP), WithLanes(lanes), WithIdleTimeout(-1)}
			_, cs, _, _, _ := lanePair(t, opts, opts)
			big := make([]byte, 300_001)
			for i := range big {
				big[i] = byte(i * 7)
			}
			small := []byte("hello")
			for range 3 {
				require.NoError(t, cs.link.SendControl(context.Background(), 9, big))
				require.NoError(t, cs.link.SendControl(context.Background(), 10, small))
			}
			// Handlers run concurrently: compare what arrived, in any order.
			var nBig, nSmall int
			for range 6 {
				select {
				case m := <-got:
					switch m.typ {
					case 9:
						require.Equal(t, big, m.payload)
						nBig++
					case 10:
						require.Equal(t, small, m.payload)
						nSmall++
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("%d large and %d small messages arrived of 3 each", nBig, nSmall)
				}
			}
			require.NoError(t, cs.Err())
		})
	}
}
