package transport

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// hostsRig is a TCP listener with a long handshake timeout, its Accept
// drained into accepted, and helpers that connect from a loopback address.
type hostsRig struct {
	t        *testing.T
	l        *Listener
	accepted chan net.Conn
}

func newHostsRig(t *testing.T) *hostsRig {
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	r := &hostsRig{t: t, l: l, accepted: make(chan net.Conn, 16)}
	go func() {
		defer close(r.accepted)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			r.accepted <- c
		}
	}()
	t.Cleanup(func() {
		require.NoError(t, l.Close())
		for c := range r.accepted {
			_ = c.Close()
		}
		hs := l.hosts
		hs.mu.Lock()
		defer hs.mu.Unlock()
		require.Empty(t, hs.hosts, "hosts counted after the listener closed")
		require.Zero(t, hs.queued)
		require.Zero(t, len(l.handshakes), "handshake slots held after the listener closed")
	})
	return r
}

// from connects from ip (127.0.0.x: another host, as the listener counts
// them).
func (r *hostsRig) from(ip string) net.Conn {
	r.t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	c, err := d.Dial("tcp", r.l.Addr().String())
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = c.Close() })
	return c
}

// stall connects from ip and announces the largest hello, of which it
// sends nothing: the connection holds a slot until the handshake timeout.
func (r *hostsRig) stall(ip string) net.Conn {
	r.t.Helper()
	c := r.from(ip)
	hdr := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint16([]byte(magic), protocolVersion), maxBodyLen)
	_, err := c.Write(hdr)
	require.NoError(r.t, err)
	return c
}

// plain connects from ip as a plain HTTP/2 client: once served, it reaches
// Accept.
func (r *hostsRig) plain(ip string) net.Conn {
	r.t.Helper()
	c := r.from(ip)
	_, err := c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	require.NoError(r.t, err)
	return c
}

// served waits for c to reach Accept, the first connection to do so.
func (r *hostsRig) served(c net.Conn) {
	r.t.Helper()
	select {
	case a, ok := <-r.accepted:
		require.True(r.t, ok, "the listener closed")
		defer a.Close()
		require.Equal(r.t, c.LocalAddr().String(), a.RemoteAddr().String(), "another connection was served")
	case <-time.After(20 * time.Second): // the handshake timeout is a minute
		r.t.Fatalf("%v was not served", c.LocalAddr())
	}
}

// closedAtOnce checks that the listener closed c, long before any timeout.
func (r *hostsRig) closedAtOnce(c net.Conn) {
	r.t.Helper()
	require.NoError(r.t, c.SetReadDeadline(time.Now().Add(20*time.Second)))
	_, err := c.Read(make([]byte, 1))
	// A reset where the listener closed it with what c sent unread.
	if !errors.Is(err, syscall.ECONNRESET) {
		require.ErrorIs(r.t, err, io.EOF)
	}
}

// waits reports how many of ip's connections wait for a slot.
func (r *hostsRig) waits(ip string) int {
	hs := r.l.hosts
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if h := hs.hosts[netip.PrefixFrom(netip.MustParseAddr(ip), 32)]; h != nil {
		return len(h.queued)
	}
	return 0
}

func (r *hostsRig) slots(n int) {
	r.t.Helper()
	require.Eventually(r.t, func() bool { return len(r.l.handshakes) == n }, 10*time.Second, time.Millisecond)
}

func (r *hostsRig) queued(ip string, n int) {
	r.t.Helper()
	require.Eventually(r.t, func() bool { return r.waits(ip) == n }, 10*time.Second, time.Millisecond)
}

// setHostBounds sets the bounds for a test, until its listener closed (a
// cleanup registered before the rig's runs after it).
func setHostBounds(t *testing.T, total, perHost, queued int) {
	n, m, q := maxHandshakes, maxHandshakesPerHost, maxQueued
	t.Cleanup(func() { maxHandshakes, maxHandshakesPerHost, maxQueued = n, m, q })
	maxHandshakes, maxHandshakesPerHost, maxQueued = total, perHost, queued
}

// One host's stalled connections take at most maxHandshakesPerHost slots:
// its next connection waits, another host's is served, and the waiting one
// takes the slot of the host's first connection that ends.
func TestHandshakeSlotsPerHost(t *testing.T) {
	setHostBounds(t, maxHandshakes, 2, maxQueued)
	r := newHostsRig(t)
	stalled := []net.Conn{r.stall("127.0.0.1"), r.stall("127.0.0.1")}
	r.slots(2)
	waiting := r.plain("127.0.0.1")
	r.queued("127.0.0.1", 1)

	other := r.plain("127.0.0.2")
	r.served(other)
	require.Equal(t, 1, r.waits("127.0.0.1"))

	require.NoError(t, stalled[0].Close())
	r.served(waiting)
	r.slots(1)
}

// Where every slot is taken, one that frees goes to the waiting host that
// holds the fewest, before the host that holds the others, whose
// connections wait longer.
func TestHandshakeSlotsFairShare(t *testing.T) {
	setHostBounds(t, 4, 4, maxQueued)
	r := newHostsRig(t)
	var stalled []net.Conn
	for range maxHandshakes {
		stalled = append(stalled, r.stall("127.0.0.1"))
	}
	r.slots(maxHandshakes)
	r.stall("127.0.0.1")
	r.stall("127.0.0.1")
	r.queued("127.0.0.1", 2)
	other := r.plain("127.0.0.2")
	r.queued("127.0.0.2", 1)

	require.NoError(t, stalled[0].Close())
	r.served(other)
	// The slot other held goes back to the first host's queue.
	r.queued("127.0.0.1", 1)
	r.slots(maxHandshakes)
}

// With maxQueued connections waiting, the host with the longest queue loses
// its newest, the newcomer itself where that is its host (a tie included);
// closing the listener closes those that wait.
func TestHandshakeQueueFull(t *testing.T) {
	setHostBounds(t, 2, 2, 2)
	r := newHostsRig(t)
	r.stall("127.0.0.1")
	r.stall("127.0.0.1")
	r.slots(2)
	q1, q2 := r.stall("127.0.0.1"), r.stall("127.0.0.1")
	r.queued("127.0.0.1", 2)

	other := r.plain("127.0.0.2")
	r.closedAtOnce(q2)
	r.queued("127.0.0.2", 1)
	r.closedAtOnce(r.stall("127.0.0.1"))
	require.Equal(t, 1, r.waits("127.0.0.1"))

	require.NoError(t, r.l.Close())
	r.closedAtOnce(q1)
	r.closedAtOnce(other)
}

// With the queues full, a newcomer from a fresh host takes the place of the
// newest connection of the host that came latest to the longest length, not
// of the one that has waited longest, which is served first when a slot
// frees.
func TestHandshakeQueueFullKeepsTheOldest(t *testing.T) {
	setHostBounds(t, 2, 2, 2)
	r := newHostsRig(t)
	stalled := r.stall("127.0.0.1")
	r.stall("127.0.0.1")
	r.slots(2)
	first := r.plain("127.0.0.3")
	r.queued("127.0.0.3", 1)
	second := r.stall("127.0.0.4")
	r.queued("127.0.0.4", 1)

	r.stall("127.0.0.5")
	r.closedAtOnce(second)
	r.queued("127.0.0.5", 1)
	require.Equal(t, 1, r.waits("127.0.0.3"))

	require.NoError(t, stalled.Close())
	r.served(first)
}

// A burst of sessions from one host, beyond its share of slots, waits its
// turn: every one is set up.
func TestHandshakeBurstFromOneHost(t *testing.T) {
	setHostBounds(t, maxHandshakes, 4, maxQueued)
	const sessions = 48
	r := newHostsRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, sessions)
	got := make(chan *Session, sessions)
	for range sessions {
		wg.Go(func() {
			s, err := Dial(ctx, r.l.Addr().String(), WithMode(ModeTCP))
			if err == nil {
				got <- s
				_, err = s.Conn(ctx)
			}
			errs <- err
		})
	}
	for range sessions {
		select {
		case c := <-r.accepted:
			defer c.Close()
		case <-ctx.Done():
			t.Fatal("sessions not set up")
		}
	}
	wg.Wait()
	close(errs)
	close(got)
	for err := range errs {
		require.NoError(t, err)
	}
	for s := range got {
		require.NoError(t, s.Close())
	}
}

// hostConn is a connection of a host, as the share-out sees it.
type hostConn struct {
	net.Conn // nil: only RemoteAddr and Close are called
	addr     *net.TCPAddr
	closed   bool
}

func (c *hostConn) RemoteAddr() net.Addr { return c.addr }
func (c *hostConn) Close() error         { c.closed = true; return nil }

// The share-out's bookkeeping, driven by random admits and releases over
// random bounds: after every step its indexes agree with the hosts' queues
// and slots, no host waits while a slot is free, and everything drains.
func TestHandshakeSharesRandom(t *testing.T) {
	for seed := range 300 {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		total, perHost, queued := 1+rng.IntN(8), 1+rng.IntN(4), rng.IntN(12)
		n, m := maxHandshakesPerHost, maxQueued
		maxHandshakesPerHost, maxQueued = perHost, queued
		hs := newHostShares()
		maxHandshakesPerHost, maxQueued = n, m
		l := &Listener{handshakes: make(chan struct{}, total), hosts: hs, log: slog.New(slog.DiscardHandler)}
		type served struct {
			c    *hostConn
			host netip.Prefix
		}
		var serving []served
		hs.serve = func(c net.Conn, host netip.Prefix) { serving = append(serving, served{c.(*hostConn), host}) }
		var open []*hostConn // admitted, neither served nor closed yet
		step := func(what string) {
			t.Helper()
			checkShares(t, l, len(serving), fmt.Sprintf("seed %d, %s", seed, what))
			open = slices.DeleteFunc(open, func(c *hostConn) bool {
				return c.closed || slices.ContainsFunc(serving, func(s served) bool { return s.c == c })
			})
		}
		for range 200 {
			if rng.IntN(3) > 0 || len(serving) == 0 {
				c := &hostConn{addr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, byte(rng.IntN(6))), Port: 1}}
				open = append(open, c)
				l.admit(c)
				step("admit")
			} else {
				i := rng.IntN(len(serving))
				s := serving[i]
				serving = slices.Delete(serving, i, i+1)
				l.release(s.host)
				step("release")
			}
		}
		for len(serving) > 0 {
			s := serving[0]
			serving = serving[1:]
			l.release(s.host)
			step("drain")
		}
		require.Empty(t, open, "seed %d: connections neither served nor closed", seed)
		require.Empty(t, hs.hosts, "seed %d", seed)
	}
}

// checkShares checks the share-out's indexes against its hosts.
func checkShares(t *testing.T, l *Listener, serving int, at string) {
	t.Helper()
	hs := l.hosts
	hs.mu.Lock()
	defer hs.mu.Unlock()
	queued, most, slots := 0, 0, 0
	for host, h := range hs.hosts {
		require.Equal(t, host, h.host, at)
		require.False(t, h.serving == 0 && len(h.queued) == 0, "%s: idle host %v kept", at, host)
		require.LessOrEqual(t, h.serving, hs.perHost, at)
		queued += len(h.queued)
		most = max(most, len(h.queued))
		slots += h.serving
		inLen := 0
		if l := hs.byLen[len(h.queued)]; l != nil {
			for e := l.Front(); e != nil; e = e.Next() {
				if e.Value.(*hostSlots) == h {
					inLen++
				}
			}
		}
		require.Equal(t, min(len(h.queued), 1), inLen, "%s: %v filed by its queue's length", at, host)
		inReady := 0
		for n, r := range hs.ready {
			for e := r.Front(); e != nil; e = e.Next() {
				if e.Value.(*hostSlots) == h {
					require.Equal(t, h.serving, n, "%s: %v filed under another count", at, host)
					inReady++
				}
			}
		}
		want := 0
		if len(h.queued) > 0 && h.serving < hs.perHost {
			want = 1
		}
		require.Equal(t, want, inReady, "%s: %v filed as ready", at, host)
		if want == 1 {
			require.Equal(t, cap(l.handshakes), len(l.handshakes), "%s: %v waits while a slot is free", at, host)
		}
	}
	for n, byLen := range hs.byLen {
		require.Positive(t, byLen.Len(), "%s: empty list for length %d kept", at, n)
	}
	require.Equal(t, queued, hs.queued, at)
	require.LessOrEqual(t, queued, hs.maxQueued, at)
	require.Equal(t, most, hs.most, at)
	require.Equal(t, slots, len(l.handshakes), at)
	require.Equal(t, serving, slots, at)
}
