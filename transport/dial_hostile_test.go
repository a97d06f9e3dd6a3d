package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/leaktest"
)

// stallingLaneServer answers a client's hello with a signed welcome that
// offers lanes, takes its proof, and then accepts the client's lane
// connections without ever answering them. It reports each lane accepted.
func stallingLaneServer(t *testing.T) (addr string, lanes <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	id := NewIdentity()
	accepted := make(chan struct{}, 16)
	var mu sync.Mutex
	var held []net.Conn
	var wg sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range held {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for first := true; ; first = false {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
			if !first {
				accepted <- struct{}{}
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, hb, err := readFrame(c, false)
				if err != nil {
					return
				}
				wf := encodeWelcome(welcome{ID: id.ID(), HostID: LocalHostID(), Caps: Caps{Lanes: true}, Transport: "tcp", FallbackOK: true, Token: newToken(), Key: id.publicKey(), Nonce: newNonce()})
				wb := wf[frameHeaderLen:]
				sig := id.signTranscript(transcript(roleServerLabel, hb, unsignedWelcome(wb)))
				copy(wb[len(wb)-signatureLen:], sig[:])
				if _, err := c.Write(wf); err != nil {
					return
				}
				_, _, _ = readFrame(c, false) // the proof; then silence
			}()
		}
	}()
	return ln.Addr().String(), accepted
}

// A dial's context bounds the whole dial, the opening of the session's
// lanes included: a server that stalls its lanes holds the dial no longer
// than the context, not for the handshake timeout.
func TestDialContextBoundsLanes(t *testing.T) {
	t.Run("deadline", func(t *testing.T) {
		addr, _ := stallingLaneServer(t)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		s, err := Dial(ctx, addr, WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
		require.Nil(t, s)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(start), 30*time.Second, "the dial outlived its context")
	})
	t.Run("cancel", func(t *testing.T) {
		addr, lanes := stallingLaneServer(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		res := make(chan error, 1)
		go func() {
			s, err := Dial(ctx, addr, WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
			if s != nil {
				_ = s.Close()
			}
			res <- err
		}()
		<-lanes // the dial waits for its lane's answer
		cancel()
		select {
		case err := <-res:
			require.ErrorIs(t, err, context.Canceled)
		case <-time.After(30 * time.Second):
			t.Fatal("the dial went on after its context was cancelled")
		}
	})
}

// Connections that stall before their handshake ends take at most
// maxHandshakes goroutines and first frames: past that the listener serves
// no more until one ends (they wait in their host's queue), and then serves
// the next.
func TestListenerBoundsHandshakes(t *testing.T) {
	defer func(n int) { maxHandshakes = n }(maxHandshakes)
	maxHandshakes = 4
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	defer l.Close()
	// Each announces the largest hello and sends nothing of it.
	hdr := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint16([]byte(magic), protocolVersion), maxBodyLen)
	var stalled []net.Conn
	for range maxHandshakes {
		c, err := net.Dial("tcp", l.Addr().String())
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write(hdr)
		require.NoError(t, err)
		stalled = append(stalled, c)
	}
	require.Eventually(t, func() bool { return len(l.handshakes) == maxHandshakes }, 10*time.Second, time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	s, err := Dial(ctx, l.Addr().String(), WithMode(ModeTCP))
	require.Nil(t, s)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a handshake beyond the bound was served")

	require.NoError(t, stalled[0].Close())
	ctx, cancel = context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	s, err = Dial(ctx, l.Addr().String(), WithMode(ModeTCP))
	require.NoError(t, err)
	require.NoError(t, s.Close())
}

// awaitingListener is a TCP listener that lets 4 sessions wait for their
// gRPC stream or for Accept (maxHandshakes, restored at the test's end),
// with a context for the test's dials.
func awaitingListener(t *testing.T) (*Listener, context.Context) {
	n := maxHandshakes
	maxHandshakes = 4
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	t.Cleanup(func() {
		cancel()
		l.Close()
		maxHandshakes = n
	})
	return l, ctx
}

// A peer that completes handshakes and opens no gRPC stream holds at most
// maxHandshakes sessions of the listener at once: past them the one that
// waited longest is closed, its lane slot forgotten; a session whose gRPC
// conn came counts no more.
func TestListenerBoundsSessionsAwaitingGRPC(t *testing.T) {
	l, ctx := awaitingListener(t)
	dial := func() *Session {
		t.Helper()
		s, err := Dial(ctx, l.Addr().String(), WithMode(ModeTCP))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	var idle []*Session
	for i := range maxHandshakes {
		idle = append(idle, dial())
		// A dial returns before its server side counts the session: the
		// next waits for it, so that idle[0] waited longest.
		require.Eventually(t, func() bool { return l.awaitingSessions() == i+1 }, handTimeout, time.Millisecond)
	}
	// Their lane slots wait for gRPC lanes over TCP: no UCX listener of the
	// process takes connection requests for them.
	require.False(t, lanesExpected(), "a TCP session's lane slot opened UCX listeners")

	// One more: the oldest is closed, and its lane slot forgotten.
	extra := dial()
	select {
	case <-idle[0].Done():
	case <-time.After(handTimeout):
		t.Fatal("the session that waited longest was kept past the bound")
	}
	require.Equal(t, maxHandshakes, l.awaitingSessions())
	require.Eventually(t, func() bool {
		laneWaiting.Lock()
		defer laneWaiting.Unlock()
		_, ok := laneWaiting.m[idle[0].token]
		return !ok
	}, handTimeout, time.Millisecond, "the closed session's lane slot is left")
	for _, s := range append(idle[1:], extra) {
		require.NoError(t, s.Err(), "a session other than the oldest was closed")
	}

	// One of them opens its gRPC stream: Accept gets it, and it counts no
	// more.
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	cc, err := idle[1].Conn(ctx)
	require.NoError(t, err)
	defer cc.Close()
	select {
	case sc := <-accepted:
		defer sc.Close()
	case <-time.After(handTimeout):
		t.Fatal("the session's gRPC conn never reached Accept")
	}
	require.Eventually(t, func() bool { return l.awaitingSessions() == maxHandshakes-1 }, handTimeout, time.Millisecond)
	require.NoError(t, idle[1].Err())
}

// Sessions whose gRPC stream came while the server does not accept (its
// Serve not started, or stalled) stay counted until Accept takes them: past
// maxHandshakes the one that waited longest is closed, so they cannot pile
// up. Accept then returns the conns of the sessions still up.
func TestListenerBoundsSessionsAwaitingAccept(t *testing.T) {
	l, ctx := awaitingListener(t)
	var sessions []*Session
	for i := range maxHandshakes + 1 {
		c, err := DialConn(ctx, l.Addr().String(), WithMode(ModeTCP))
		require.NoError(t, err)
		s := SessionOf(c)
		t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
		sessions = append(sessions, s)
		if i < maxHandshakes {
			// The next waits for this one to count, so that sessions[0]
			// waited longest.
			require.Eventually(t, func() bool { return l.awaitingSessions() == i+1 }, handTimeout, time.Millisecond)
		}
	}
	select {
	case <-sessions[0].Done():
	case <-time.After(handTimeout):
		t.Fatal("the session that waited longest for Accept was kept past the bound")
	}
	require.Equal(t, maxHandshakes, l.awaitingSessions())
	for i, s := range sessions[1:] {
		require.NoError(t, s.Err(), "session %d was closed", i+1)
	}
	for range maxHandshakes {
		c, err := l.Accept()
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		require.NoError(t, SessionOf(c).Err(), "Accept returned a closed session's conn")
	}
	require.Eventually(t, func() bool { return l.awaitingSessions() == 0 }, handTimeout, time.Millisecond)
}

// A listener's Close closes the sessions gRPC never accepted and returns
// once they are released, their goroutines ended, as the sessions closed
// mid-handshake are.
func TestListenerCloseReleasesUnaccepted(t *testing.T) {
	l, ctx := awaitingListener(t)
	c, err := DialConn(ctx, l.Addr().String(), WithMode(ModeTCP))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(); _ = SessionOf(c).Close() })
	require.Eventually(t, func() bool { return l.awaitingSessions() == 1 }, handTimeout, time.Millisecond)
	l.awaitMu.Lock()
	s := l.awaiting[0]
	l.awaitMu.Unlock()
	require.NoError(t, l.Close())
	select {
	case <-s.Released():
	default:
		t.Fatal("the unaccepted session was not released when Close returned")
	}
	select {
	case <-SessionOf(c).Done():
	case <-time.After(handTimeout):
		t.Fatal("the client's session outlived the server's")
	}
}

// readAnnounced reads exactly what was announced, in pieces of any size,
// and not a byte of what follows it.
func TestReadAnnounced(t *testing.T) {
	for _, n := range []int{0, 1, 1023, 1024, 1025, 1500, 3000, 4097, 70_000, 100_000} {
		want := make([]byte, 2*n+3)
		for i := range want {
			want[i] = byte(i * 13)
		}
		got, err := readAnnounced(iotest.OneByteReader(bytes.NewReader(want)), n, 1<<10)
		require.NoError(t, err)
		require.Equal(t, want[:n], got)
		r := bytes.NewReader(want) // reads as much as it is asked for
		got, err = readAnnounced(r, n, 1<<10)
		require.NoError(t, err)
		require.Equal(t, want[:n], got, "n=%d", n)
		require.Equal(t, len(want)-n, r.Len(), "n=%d: what follows stays unread", n)
		_, err = readAnnounced(bytes.NewReader(want[:n/2]), n, 1<<10)
		if n > 1 {
			require.ErrorIs(t, err, io.ErrUnexpectedEOF)
		}
	}
}

// Opening a stream is bounded by its context even when yamux waits: a peer
// that acknowledges none of the streams this side opens fills yamux's slots
// for streams in opening (streamBacklog), and the next open returns at its
// deadline.
func TestOpenStreamBounded(t *testing.T) {
	cli, s := handPlayedPeer(t, WithKeepAlive(-1, 0), WithHandshakeTimeout(time.Minute))
	// The peer: a multiplexer that accepts no stream (its backlog holds
	// them all, unacknowledged).
	yc := yamux.DefaultConfig()
	yc.AcceptBacklog = 1024
	yc.EnableKeepAlive = false
	yc.LogOutput = io.Discard
	peer, err := yamux.Client(cli, yc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = peer.Close() })
	for i := range streamBacklog {
		c, err := s.link.OpenBulk(context.Background())
		require.NoError(t, err, "stream %d", i)
		defer c.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = s.link.OpenBulk(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(start), 30*time.Second)
	require.NoError(t, s.Err(), "the session lives on")

	// Opens given up on leave no more than streamBacklog goroutines
	// waiting in yamux for the peer.
	for range 3 * streamBacklog {
		ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		_, err := s.link.OpenBulk(ctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
	}
	waiting := 0
	for _, g := range leaktest.Goroutines("yamux.(*Session).OpenStream") {
		if strings.Contains(g, "transport.(*Session).openStream") {
			waiting++
		}
	}
	require.LessOrEqual(t, waiting, streamBacklog)
	require.NoError(t, s.Err(), "the session lives on")
}

// A listener's session whose client opens no gRPC stream within the
// handshake timeout is closed: it would never reach gRPC, and control
// messages would keep it from the idle timeout.
func TestListenerSessionWithoutGRPC(t *testing.T) {
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithHandshakeTimeout(2*time.Second), WithIdleTimeout(-1))
	require.NoError(t, err)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	s, err := Dial(ctx, l.Addr().String(), WithMode(ModeTCP), WithIdleTimeout(-1))
	require.NoError(t, err)
	defer s.Close()
	for {
		select {
		case <-s.Done():
			require.ErrorIs(t, s.Err(), ErrPeerGone)
			return
		case <-ctx.Done():
			t.Fatal("the server kept a session that carries no gRPC")
		default:
		}
		// What a peer's dropped control messages did: count as traffic.
		_ = s.link.SendControl(ctx, 0xEE, nil)
		select {
		case <-s.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// handPlayedPeer returns a server session whose client is played by hand
// over a pipe (cli): a handshake with a fresh identity, then whatever the
// test writes and reads.
func handPlayedPeer(t *testing.T, opts ...Option) (cli net.Conn, s *Session) {
	t.Helper()
	cli, srv := net.Pipe()
	t.Cleanup(func() { _ = cli.Close() })
	get := asyncSession(t, func() (*Session, error) {
		return NewServerSession(context.Background(), srv, append([]Option{WithMode(ModeTCP), WithIdleTimeout(-1)}, opts...)...)
	})
	id := NewIdentity()
	hf := encodeHello(hello{ID: id.ID(), HostID: LocalHostID(), Mode: ModeTCP, Key: id.publicKey(), Nonce: newNonce()})
	_, err := cli.Write(hf)
	require.NoError(t, err)
	v, wb := readHandFrame(t, cli)
	_, err = parseWelcome(v, wb)
	require.NoError(t, err)
	_, err = cli.Write(encodeProof(proof{Signature: id.signTranscript(transcript(roleClientLabel, hf[frameHeaderLen:], wb))}))
	require.NoError(t, err)
	s, err = get()
	require.NoError(t, err)
	return cli, s
}

// A peer that opens streams faster than they are served pins at most the
// backlog's initial windows: a stream is acknowledged, and its window opened
// to the session's 16 MiB, only once a handler is free for it; until then it
// takes 256 KiB at most, and streams past the backlog are reset.
func TestStreamBacklogBounded(t *testing.T) {
	release := make(chan struct{})
	served := make(chan struct{}, MaxStreamHandlers+streamBacklog)
	var victim atomic.Pointer[Session]
	setHook(t, &testHooks.bulk, func(s *Session, c net.Conn) {
		defer c.Close()
		if s != victim.Load() {
			return
		}
		served <- struct{}{}
		select {
		case <-release:
		case <-s.Done():
		}
	})
	cli, s := handPlayedPeer(t, WithEngine(testEngine{}), WithKeepAlive(-1, 0), WithHandshakeTimeout(time.Minute))
	victim.Store(s)
	defer close(release)
	yc := yamux.DefaultConfig()
	yc.AcceptBacklog = 4 * MaxStreamHandlers // the peer's own opens never wait
	yc.EnableKeepAlive = false
	yc.LogOutput = io.Discard
	peer, err := yamux.Client(cli, yc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = peer.Close() })
	open := func() *yamux.Stream {
		st, err := peer.OpenStream()
		require.NoError(t, err)
		// Refused streams may be reset before the role byte goes.
		_, _ = st.Write([]byte{roleBulk})
		return st
	}

	for i := range MaxStreamHandlers {
		// One at a time: a burst of opens past the backlog is reset.
		open()
		select {
		case <-served:
		case <-time.After(20 * time.Second):
			t.Fatalf("%d of %d handlers ran", i, MaxStreamHandlers)
		}
	}
	waiting := make([]*yamux.Stream, streamBacklog)
	for i := range waiting {
		waiting[i] = open()
	}
	const past = 8
	for i := range past {
		st := open()
		_ = st.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, err := st.Read(make([]byte, 1))
		require.ErrorIs(t, err, yamux.ErrConnectionReset, "stream %d past the backlog", i)
	}

	// Each stream in the backlog takes what is left of its initial window
	// and no more: a write past it waits until its deadline.
	var wg sync.WaitGroup
	wrote := make([]int, len(waiting))
	errs := make([]error, len(waiting))
	for i, st := range waiting {
		wg.Go(func() {
			_ = st.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
			wrote[i], errs[i] = st.Write(make([]byte, 1<<20))
		})
	}
	wg.Wait()
	for i := range waiting {
		require.ErrorIs(t, errs[i], yamux.ErrTimeout, "stream %d in the backlog took %d bytes", i, wrote[i])
		require.Less(t, wrote[i], 256<<10, "stream %d in the backlog", i)
	}
	require.Len(t, served, 0, "no stream beyond the handlers was served")
	require.NoError(t, s.Err(), "the session lives on")
}

// A peer that opens a multiplexed stream under an id of this side's (here
// a client opening even ids, as a yamux server does, with the id the
// server's next stream would take) ends the session at once: yamux's own
// open would later take the same id and drop the peer's stream from its
// map, and a reader of that stream (the control stream's, here) would then
// spin for good, holding Close.
func TestStreamOfOwnIDRefused(t *testing.T) {
	cli, s := handPlayedPeer(t, WithEngine(testEngine{}), WithKeepAlive(-1, 0), WithLanes(false))
	yc := yamux.DefaultConfig()
	yc.EnableKeepAlive = false
	yc.LogOutput = io.Discard
	peer, err := yamux.Server(cli, yc) // even stream ids, the server's own
	require.NoError(t, err)
	defer peer.Close()
	// The open may fail here: the server can refuse the stream, and end the
	// session, before the open returns.
	if st, err := peer.OpenStream(); err == nil {
		require.Equal(t, uint32(2), st.StreamID())
		_, _ = st.Write([]byte{roleControl})
	}
	select {
	case <-s.Done():
	case <-time.After(handTimeout):
		t.Fatal("the session took the stream")
	}
	require.ErrorContains(t, s.Err(), "an id of this side's")
	closed := make(chan struct{})
	go func() {
		_ = s.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(handTimeout):
		t.Fatal("Session.Close did not return")
	}
}
