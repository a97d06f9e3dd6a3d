package transport

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
)

// Control message types the tests use, away from the engine's.
const (
	testCtlEcho  = 0xE1
	testCtlCount = 0xE2
	testCtlNone  = 0xEF // no handler
)

var testControl = struct {
	once sync.Once
	mu   sync.Mutex
	ch   map[*Session]chan []byte
}{ch: map[*Session]chan []byte{}}

// controlInbox registers the test handlers once and returns the channel that
// receives the payloads of testCtlEcho messages arriving on s.
func controlInbox(s *Session) chan []byte {
	testControl.once.Do(func() {
		testHooks.mu.Lock()
		testHooks.control = func(s *Session, typ byte, p []byte) {
			if typ != testCtlEcho {
				return
			}
			testControl.mu.Lock()
			ch := testControl.ch[s]
			testControl.mu.Unlock()
			if ch != nil {
				ch <- p
			}
		}
		testHooks.mu.Unlock()
	})
	ch := make(chan []byte, 1024)
	testControl.mu.Lock()
	testControl.ch[s] = ch
	testControl.mu.Unlock()
	return ch
}

// pipePair is a session pair over net.Pipe with distinct process ids.
func pipePair(t *testing.T, opts ...Option) (client, server *Session) {
	t.Helper()
	return pipePairWith(t, opts, opts)
}

// pipePairWith is pipePair with options per side.
func pipePairWith(t *testing.T, clientOpts, serverOpts []Option) (client, server *Session) {
	t.Helper()
	c1, c2 := net.Pipe()
	return pairOver(t, c1, c2, clientOpts, serverOpts)
}

// pairOver is pipePairWith over c1 (the client's end) and c2.
func pairOver(t *testing.T, c1, c2 net.Conn, clientOpts, serverOpts []Option) (client, server *Session) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ch := make(chan *Session, 1)
	errCh := make(chan error, 1)
	go func() {
		s, err := NewServerSession(ctx, c2, append([]Option{WithIdentity(NewIdentity()), WithEngine(testEngine{})}, serverOpts...)...)
		ch <- s
		errCh <- err
	}()
	client, err := NewClientSession(ctx, c1, append([]Option{WithIdentity(NewIdentity()), WithEngine(testEngine{})}, clientOpts...)...)
	server = <-ch
	require.NoError(t, <-errCh)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = client.Close()
		_ = server.Close()
	})
	return client, server
}

func recvPayload(t *testing.T, ch chan []byte) []byte {
	t.Helper()
	select {
	case p := <-ch:
		return p
	case <-time.After(10 * time.Second):
		t.Fatal("control message did not arrive")
	}
	return nil
}

func TestControlMessages(t *testing.T) {
	c, s := pipePair(t)
	cin, sin := controlInbox(c), controlInbox(s)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	for _, n := range []int{0, 1, 1000, MaxControlPayload} {
		p := bytes.Repeat([]byte{byte(n)}, n)
		require.NoError(t, c.link.SendControl(ctx, testCtlEcho, p))
		require.Equal(t, p, recvPayload(t, sin))
		require.NoError(t, s.link.SendControl(ctx, testCtlEcho, p))
		require.Equal(t, p, recvPayload(t, cin))
	}
	err := c.link.SendControl(ctx, testCtlEcho, make([]byte, MaxControlPayload+1))
	require.ErrorContains(t, err, "max")

	// A message of a type without handler is dropped; the stream goes on.
	require.NoError(t, c.link.SendControl(ctx, testCtlNone, []byte("nobody")))
	require.NoError(t, c.link.SendControl(ctx, testCtlEcho, []byte("after")))
	require.Equal(t, "after", string(recvPayload(t, sin)))

	// Concurrent writers never interleave: every payload arrives whole.
	const writers, each = 8, 25
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				body := bytes.Repeat([]byte{byte(w)}, 100+w*1000+i)
				sum := sha256.Sum256(body)
				p := append(sum[:], body...)
				if err := c.link.SendControl(ctx, testCtlEcho, p); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	seen := map[string]int{}
	for range writers * each {
		p := recvPayload(t, sin)
		require.GreaterOrEqual(t, len(p), 32)
		sum := sha256.Sum256(p[32:])
		require.Equal(t, sum[:], p[:32], "a payload arrived corrupted")
		seen[fmt.Sprint(p[32], len(p))]++
	}
	wg.Wait()
	require.Len(t, seen, writers*each)

	// ctx and session life bound SendControl; what they stop is not written
	// (ErrNoLaneTurn), so that a caller may send it elsewhere.
	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	err = c.link.SendControl(cctx, testCtlEcho, nil)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, ErrNoLaneTurn)
	require.NoError(t, c.Close())
	err = c.link.SendControl(ctx, testCtlEcho, nil)
	require.ErrorIs(t, err, net.ErrClosed)
	require.ErrorIs(t, err, ErrNoLaneTurn)
}

// TestControlFrameTooLarge: a peer announcing a control message above the
// maximum gets its session closed.
func TestControlFrameTooLarge(t *testing.T) {
	c, s := pipePair(t)
	var hdr [controlHeaderLen]byte
	hdr[0] = testCtlEcho
	binary.BigEndian.PutUint32(hdr[1:], MaxControlPayload+1)
	// The write may itself see the session close: the peer can read the header
	// and close before the write is confirmed.
	if _, err := c.ctrl.c.Write(hdr[:]); err != nil {
		require.ErrorIs(t, err, net.ErrClosed)
	}
	requireEnds(t, s, "control message of")
}

func TestBulkStreams(t *testing.T) {
	var handled sync.WaitGroup
	setHook(t, &testHooks.bulk, func(s *Session, c net.Conn) { // echo
		defer handled.Done()
		defer c.Close()
		_, _ = io.Copy(c, c)
	})
	c, s := pipePair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, from := range []*Session{c, s, c} {
		handled.Add(1)
		b, err := from.link.OpenBulk(ctx)
		require.NoError(t, err)
		want := bytes.Repeat([]byte("bulk"), 100000)
		go func() {
			_, _ = b.Write(want)
		}()
		got := make([]byte, len(want))
		_, err = io.ReadFull(b, got)
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.NoError(t, b.Close())
	}
	handled.Wait()

	// Without a handler the peer closes bulk streams at once.
	setHook(t, &testHooks.bulk, nil)
	b, err := c.link.OpenBulk(ctx)
	require.NoError(t, err)
	require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = b.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, b.Close())
}

func TestRegistryAndCloseHook(t *testing.T) {
	var mu sync.Mutex
	var closed []*Session
	setHook(t, &testHooks.closed, func(s *Session) {
		select {
		case <-s.Done():
		default:
			t.Error("hook ran before Done was closed")
		}
		for _, x := range SessionsTo(s.Peer().ID) {
			if x == s {
				t.Error("hook ran before the session left the registry")
			}
		}
		mu.Lock()
		closed = append(closed, s)
		mu.Unlock()
	})

	c, s := pipePair(t)
	require.Equal(t, []*Session{s}, SessionsTo(c.cfg.identity.ID())) // s's peer is c's process
	require.Equal(t, []*Session{c}, SessionsTo(s.cfg.identity.ID()))
	require.Equal(t, s.cfg.identity.ID(), c.Peer().ID)
	require.True(t, c.Peer().SameHost)
	require.Equal(t, "tcp", c.Transport())
	require.NoError(t, c.Close())
	require.NoError(t, c.Close()) // idempotent
	require.ErrorIs(t, c.Err(), ErrSessionClosed)
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("peer session still open")
	}
	require.ErrorIs(t, s.Err(), ErrPeerGone)
	require.Empty(t, SessionsTo(s.cfg.identity.ID()))
	require.Empty(t, SessionsTo(c.cfg.identity.ID()))
	_ = s.Close()
	mu.Lock()
	defer mu.Unlock()
	require.ElementsMatch(t, []*Session{c, s}, closed)
}

func TestConnOnce(t *testing.T) {
	c, s := pipePair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc, err := c.Conn(ctx)
	require.NoError(t, err)
	_, err = c.Conn(ctx)
	require.ErrorIs(t, err, ErrConnTaken)
	sc, err := s.Conn(ctx)
	require.NoError(t, err)
	require.Same(t, s, SessionOf(sc))
	require.Same(t, c, SessionOf(cc))
	// The server waits for a gRPC stream bounded by ctx.
	sctx, scancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer scancel()
	_, err = s.Conn(sctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// A peer that opens streams and leaves them hanging holds a bounded number of
// goroutines: further streams wait in the multiplexer's backlog.
func TestStreamFlood(t *testing.T) {
	const flood = MaxStreamHandlers + streamBacklog // the handlers and the backlog beyond them
	release := make(chan struct{})
	defer close(release)
	streams := make(chan struct{}, flood)
	var victim atomic.Pointer[Session]
	setHook(t, &testHooks.bulk, func(s *Session, c net.Conn) {
		defer c.Close()
		if s != victim.Load() {
			return
		}
		streams <- struct{}{}
		select {
		case <-release:
		case <-s.Done():
		}
	})
	attacker, v := pipePair(t)
	victim.Store(v)
	mark := controlInbox(v)
	before := runtime.NumGoroutine()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for range flood {
		st, err := attacker.mux.OpenStream()
		require.NoError(t, err)
		_, err = st.Write([]byte{roleBulk})
		require.NoError(t, err)
	}
	require.NoError(t, attacker.link.SendControl(ctx, testCtlEcho, []byte("mark")))
	recvPayload(t, mark) // the control reader saw every stream opened before it
	for range MaxStreamHandlers {
		select {
		case <-streams:
		case <-ctx.Done():
			t.Fatal("a stream was not served")
		}
	}
	select {
	case <-streams:
		t.Fatalf("more than %d streams served at once", MaxStreamHandlers)
	case <-time.After(100 * time.Millisecond): // one more would come at once
	}
	// The attacker's own end waits for the streams left in the backlog to be
	// accepted, a goroutine each: those are not the victim's.
	// Handlers that just ended may still be on their way out: a goroutine
	// kept for each stream stays above the bound.
	buf := make([]byte, 16<<20)
	var g, waiting int
	require.Eventually(t, func() bool {
		waiting = bytes.Count(buf[:runtime.Stack(buf, true)], []byte("yamux.(*Session).setOpenTimeout("))
		g = runtime.NumGoroutine() - waiting - before
		return g < MaxStreamHandlers+MaxControlHandlers
	}, 10*time.Second, 10*time.Millisecond, "goroutines during a flood of %d streams", flood)
	t.Logf("%d goroutines more during the flood, and %d of the attacker's waiting opens", g, waiting)
}

// TestControlHandlersReused: control messages that arrive one after another
// are handled on a few goroutines that wait for the next message, not on a
// new goroutine each.
func TestControlHandlersReused(t *testing.T) {
	c, s := pipePair(t)
	handled := make(chan string, 1)
	setHook(t, &testHooks.control, func(at *Session, typ byte, _ []byte) {
		if at != s || typ != testCtlCount {
			return
		}
		handled <- testenv.GoroutineID()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const messages = 64
	ids := map[string]int{}
	for range messages {
		require.NoError(t, c.link.SendControl(ctx, testCtlCount, nil))
		select {
		case id := <-handled:
			ids[id]++
		case <-ctx.Done():
			t.Fatal("control message not handled")
		}
	}
	// Each message came after the last was handled: a handler was almost
	// always waiting for it (a goroutine per message: 64).
	require.Less(t, len(ids), messages/2, "goroutines that handled %d messages: %v", messages, ids)
}

// TestPeerInProcessIdentities: the ends of a session inside this process
// know it whatever identity each has.
func TestPeerInProcessIdentities(t *testing.T) {
	client, server := pipePair(t)
	require.NotEqual(t, client.PeerID(), server.PeerID())
	require.True(t, client.PeerInProcess())
	require.True(t, server.PeerInProcess())
}
