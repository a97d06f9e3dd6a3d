package transport

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// handClient plays a client's handshake by hand on a new TCP connection to
// addr: a hello from a fresh identity asking for mode with the caps given,
// then, if prove, the proof. It returns the connection, bounded by
// handTimeout and closed when the test ends, the welcome and the identity.
// What follows (the UCX upgrade, its decision, lanes) is the test's.
func handClient(tb testing.TB, addr string, mode Mode, caps Caps, prove bool) (net.Conn, welcome, *Identity) {
	tb.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = c.Close() })
	require.NoError(tb, c.SetDeadline(time.Now().Add(handTimeout)))
	id := NewIdentity()
	h := handHello(id.ID(), id.publicKey())
	h.Mode, h.Caps = mode, caps
	hf := encodeHello(h)
	_, err = c.Write(hf)
	require.NoError(tb, err)
	v, body, err := readFrame(c, false)
	require.NoError(tb, err)
	w, err := parseWelcome(v, body)
	require.NoError(tb, err)
	if prove {
		_, err = c.Write(encodeProof(proof{Signature: id.signTranscript(transcript(roleClientLabel, hf[frameHeaderLen:], body))}))
		require.NoError(tb, err)
	}
	return c, w, id
}

// goroutinesIn counts the goroutines whose stack holds fn (as a stack dump
// names it, e.g. "(*Listener).serveUCX(").
func goroutinesIn(fn string) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), fn)
		}
		buf = make([]byte, 2*len(buf))
	}
}

// heldOpenUCX returns a listener (with opts) serving at most two endpoints
// before their token, whose UCX window a proven client in mode holds open
// by stalling before its upgrade decision, and the UCX context it uses.
func heldOpenUCX(t *testing.T, mode Mode, opts ...Option) (*Listener, *rdma.Context) {
	t.Helper()
	return heldOpenUCXSlots(t, 2, mode, opts...)
}

// heldOpenUCXSlots is heldOpenUCX with slots endpoints served at most.
func heldOpenUCXSlots(t *testing.T, slots int, mode Mode, opts ...Option) (*Listener, *rdma.Context) {
	t.Helper()
	defer func(n int) { maxHandshakes = n }(maxHandshakes)
	maxHandshakes = slots // read by Listen alone
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", append([]Option{WithRDMAContext(rc), WithHandshakeTimeout(time.Minute)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	handClient(t, l.Addr().String(), mode, Caps{UCX: true}, true)
	require.Eventually(t, l.expectsUCX, handTimeout, time.Millisecond, "the proven handshake opens the UCX listener")
	return l, rc
}

// idleUCXEndpoints dials n endpoints to l's UCX listener from rc that never
// send a token, each read until it fails, and returns the count of those
// the listener turned away or closed (counted as it happens) and those it
// took; taken, if set, runs after each one taken. They are closed when the
// test ends.
func idleUCXEndpoints(t *testing.T, ctx context.Context, rc *rdma.Context, l *Listener, n int, taken func(int)) (*atomic.Int32, []*rdma.Endpoint) {
	t.Helper()
	var refused atomic.Int32
	var readers sync.WaitGroup
	var eps []*rdma.Endpoint
	t.Cleanup(func() {
		for _, ep := range eps {
			_ = ep.Close()
		}
		readers.Wait()
	})
	for range n {
		ep, err := rc.Worker().Dial(ctx, l.UCXAddr().String())
		if err != nil {
			refused.Add(1)
			continue
		}
		eps = append(eps, ep)
		readers.Go(func() {
			var b [1]byte
			if _, err := ep.Read(b[:]); err != nil && ctx.Err() == nil {
				refused.Add(1)
			}
		})
		if taken != nil {
			taken(len(eps))
		}
	}
	return &refused, eps
}

// TestUCXEndpointsBounded: while a proven client stalls before its upgrade
// (which holds the UCX listener open to everyone), endpoints that never send
// their token are served by at most maxHandshakes goroutines; the others are
// closed at once, and the slots come back when the idle endpoints go.
func TestUCXEndpointsBounded(t *testing.T) {
	l, rc := heldOpenUCX(t, ModeUCX, WithMode(ModeUCX))
	slots := l.ucxSlots

	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	const idle = 16
	refused, eps := idleUCXEndpoints(t, ctx, rc, l, idle, nil)
	const serving = "(*Listener).serveUCX("
	require.Eventually(t, func() bool {
		return refused.Load() == int32(idle-slots) && goroutinesIn(serving) == slots
	}, handTimeout, 5*time.Millisecond, "at most maxHandshakes endpoints served, the rest closed")
	_, err := rc.Worker().Dial(ctx, l.UCXAddr().String())
	require.ErrorIs(t, err, rdma.ErrRejected, "while every slot is taken the listener turns requests away (a client dials again)")

	for _, ep := range eps {
		_ = ep.Close()
	}
	require.Eventually(t, func() bool { return goroutinesIn(serving) == 0 && l.ucxSlotsHeld() == 0 },
		handTimeout, 5*time.Millisecond, "the slots come back when the idle endpoints go")
	s, err := Dial(ctx, l.Addr().String(), WithRDMAContext(rc), WithMode(ModeUCX))
	require.NoError(t, err)
	defer s.Close()
	require.Equal(t, "ucx", s.Transport())
}

// TestUCXSlotsSharedPerHost: the endpoints one host opens and never send a
// token are served at most its share of the slots (maxHandshakesPerHost),
// however many slots are free: its other requests are turned away (a client
// dials again), while the filter still takes requests from other hosts. The
// share comes back when the endpoints go.
func TestUCXSlotsSharedPerHost(t *testing.T) {
	defer func(n int) { maxHandshakesPerHost = n }(maxHandshakesPerHost)
	maxHandshakesPerHost = 2 // read by Listen alone
	l, rc := heldOpenUCXSlots(t, 8, ModeUCX, WithMode(ModeUCX))
	require.Equal(t, 2, l.ucxPerHost)

	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	const idle = 6
	refused, eps := idleUCXEndpoints(t, ctx, rc, l, idle, func(taken int) {
		// Served before the next request comes (requests that come
		// together pass the filter together, and are served).
		require.Eventually(t, func() bool { return l.ucxSlotsHeld() == taken }, handTimeout, time.Millisecond)
	})
	require.Len(t, eps, 2, "the others turned away by the filter")
	const serving = "(*Listener).serveUCX("
	require.Eventually(t, func() bool {
		return refused.Load() == idle-2 && goroutinesIn(serving) == 2
	}, handTimeout, 5*time.Millisecond, "one host is served its share, the rest turned away")
	require.Equal(t, 2, l.ucxSlotsHeld(), "6 slots are still free")
	require.False(t, l.admitsUCX(&rdma.Addr{IP: net.ParseIP("127.0.0.1")}), "the host's share is taken")
	require.True(t, l.admitsUCX(&rdma.Addr{IP: net.ParseIP("192.0.2.7")}), "another host's request is taken")
	require.True(t, l.admitsUCX(&rdma.Addr{IP: net.ParseIP("2001:db8::1")}), "another host's request is taken")

	for _, ep := range eps {
		_ = ep.Close()
	}
	require.Eventually(t, func() bool {
		l.ucxMu.Lock()
		defer l.ucxMu.Unlock()
		return goroutinesIn(serving) == 0 && l.ucxHeld == 0 && len(l.ucxHosts) == 0
	}, handTimeout, 5*time.Millisecond, "the share comes back when the idle endpoints go")
	require.True(t, l.admitsUCX(&rdma.Addr{IP: net.ParseIP("127.0.0.1")}))
}

// TestHostOfAddr: TCP and UCX addresses of one host count as one host, an
// IPv6 host as its /64, and addresses of no known kind as one host.
func TestHostOfAddr(t *testing.T) {
	tcp := &net.TCPAddr{IP: net.ParseIP("10.0.0.1"), Port: 1}
	require.Equal(t, netip.MustParsePrefix("10.0.0.1/32"), hostOfAddr(tcp))
	require.Equal(t, hostOfAddr(tcp), hostOfAddr(&rdma.Addr{IP: net.ParseIP("10.0.0.1"), Port: 2}))
	require.Equal(t, hostOfAddr(tcp), hostOfAddr(&net.TCPAddr{IP: net.ParseIP("::ffff:10.0.0.1")}), "an IPv4-mapped address")
	require.Equal(t, netip.MustParsePrefix("2001:db8::/64"), hostOfAddr(&rdma.Addr{IP: net.ParseIP("2001:db8::ffff:1")}))
	require.Equal(t, netip.Prefix{}, hostOfAddr(nil))
	require.Equal(t, netip.Prefix{}, hostOfAddr((*rdma.Addr)(nil)))
	require.Equal(t, netip.Prefix{}, hostOfAddr(&net.UnixAddr{Name: "x"}))
}

// TestUCXUpgradeNeedsProof: a client that sent its hello and no proof gets
// no UCX endpoint: the UCX listener turns its request away while nothing
// else holds it open, and while something does, the endpoint that presents
// the unproven handshake's token is never acknowledged and is refused once
// the handshake fails.
func TestUCXUpgradeNeedsProof(t *testing.T) {
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	dialUCX := func() (*rdma.Endpoint, error) { return rc.Worker().Dial(ctx, l.UCXAddr().String()) }

	unproven, w, id := handClient(t, l.Addr().String(), ModeUCX, Caps{UCX: true, Lanes: true}, false)
	require.Equal(t, "ucx", w.Transport)
	require.True(t, w.Caps.Lanes)
	_, err = dialUCX()
	require.ErrorIs(t, err, rdma.ErrRejected, "no proven client waits for a UCX endpoint")

	handClient(t, l.Addr().String(), ModeUCX, Caps{UCX: true}, true) // holds the UCX listener open
	require.Eventually(t, l.expectsUCX, handTimeout, time.Millisecond)
	ep, err := dialUCX()
	require.NoError(t, err)
	defer ep.Close()
	_, err = ep.Write(append([]byte(upgradeMagic), w.Token[:]...))
	require.NoError(t, err)
	require.NoError(t, unproven.Close()) // the handshake fails: no proof came
	require.NoError(t, ep.SetReadDeadline(time.Now().Add(handTimeout)))
	b, _ := io.ReadAll(ep)
	require.Equal(t, []byte{0}, b, "a refusal, then the end; never an ack")
	require.Empty(t, SessionsTo(id.ID()))
}

// TestUpgradeRetriesUntilProven: a client's UCX dial that overtakes its
// proof, turned away by the listener, is made again until the server has
// checked the proof, and then gets its endpoint.
func TestUpgradeRetriesUntilProven(t *testing.T) {
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX))
	require.NoError(t, err)
	defer l.Close()
	var turnedAway atomic.Int32
	l.ucx.SetFilter(func(net.Addr) bool {
		ok := l.expectsUCX()
		if !ok {
			turnedAway.Add(1)
		}
		return ok
	})
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	pu := l.expect(newToken())
	defer l.abandon(pu)
	type result struct {
		ep  *rdma.Endpoint
		err error
	}
	done := make(chan result, 1)
	go func() {
		ep, err := upgradeUCX(ctx, rc, l.UCXAddr().String(), pu.token)
		done <- result{ep, err}
	}()
	require.Eventually(t, func() bool { return turnedAway.Load() > 0 }, handTimeout, time.Millisecond)
	l.prove(pu)
	r := <-done
	require.NoError(t, r.err)
	defer r.ep.Close()
	select {
	case <-pu.ready: // the listener handed the endpoint to the handshake
	case <-ctx.Done():
		t.Fatal("the endpoint did not reach its handshake")
	}
}

// bareUCXListener returns a UCX context, a plain UCX listener of it (no
// gdrpc listener's filter or slots: the test plays that part) and a context
// of handTimeout; both end when the test does.
func bareUCXListener(t *testing.T) (*rdma.Context, *rdma.Listener, context.Context) {
	t.Helper()
	rc := internalUCX(t)
	ul, err := rc.Worker().Listen("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ul.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	t.Cleanup(cancel)
	return rc, ul, ctx
}

// TestShedEndpointDialedAgain: an endpoint the listener closes or aborts
// before it answers, as it sheds one it took past its slots, is dialed
// again; the token goes on the next endpoint, whose ack completes the
// upgrade.
func TestShedEndpointDialedAgain(t *testing.T) {
	rc, ul, ctx := bareUCXListener(t)
	token := newToken()
	served := make(chan error, 1)
	go func() {
		for _, shed := range []func(*rdma.Endpoint) error{(*rdma.Endpoint).Close, (*rdma.Endpoint).Abort} {
			ep, err := ul.Accept(ctx)
			if err != nil {
				served <- err
				return
			}
			_ = shed(ep) // unanswered, unread
		}
		ep, err := ul.Accept(ctx)
		if err != nil {
			served <- err
			return
		}
		defer ep.Close()
		msg := make([]byte, len(upgradeMagic)+len(token))
		if _, err := io.ReadFull(ep, msg); err != nil {
			served <- err
			return
		}
		if string(msg) != upgradeMagic+string(token[:]) {
			served <- fmt.Errorf("token %q", msg)
			return
		}
		_, err = ep.Write([]byte{upgradeAckOK})
		served <- err
	}()
	ep, err := upgradeUCX(ctx, rc, ul.Addr().String(), token)
	require.NoError(t, err, "the shed endpoints are dialed again")
	require.NoError(t, <-served)
	require.NoError(t, ep.Close())
}

// TestShedEndpointsBounded: a listener that sheds every endpoint gets
// maxSheds more of them, then the client's upgrade fails with the end it
// saw, long before its context ends.
func TestShedEndpointsBounded(t *testing.T) {
	rc, ul, ctx := bareUCXListener(t)
	var accepted atomic.Int32
	var shedding sync.WaitGroup
	shedding.Go(func() {
		for {
			ep, err := ul.Accept(ctx)
			if err != nil {
				return
			}
			accepted.Add(1)
			_ = ep.Close()
		}
	})
	_, err := upgradeUCX(ctx, rc, ul.Addr().String(), newToken())
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, ctx.Err(), "given up before the context ended")
	require.Equal(t, int32(maxSheds+1), accepted.Load())
	require.NoError(t, ul.Close())
	shedding.Wait()
}

// TestLaneSlotForgottenWithGRPCStream: a proven client that announced lanes
// and opens its gRPC stream but never its control and bulk lanes does not
// keep its session's lane slot (which holds the UCX listener open to
// everyone) for the session's life: it goes once the gRPC stream is there,
// and a lane that comes later is refused.
func TestLaneSlotForgottenWithGRPCStream(t *testing.T) {
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP))
	require.NoError(t, err)
	defer l.Close()
	accepted := acceptOne(l)
	_, w, id := handClient(t, l.Addr().String(), ModeTCP, Caps{Lanes: true}, true)
	require.True(t, w.Caps.Lanes)
	lane := func(role byte) byte { return tcpLane(t, l.Addr().String(), w.Token, role) }
	require.Equal(t, byte(upgradeAckOK), lane(roleGRPC))
	s := acceptedSession(t, accepted)
	require.Equal(t, []*Session{s}, SessionsTo(id.ID()))
	require.Eventually(t, func() bool {
		laneWaiting.Lock()
		defer laneWaiting.Unlock()
		return laneWaiting.m[w.Token] == nil
	}, handTimeout, time.Millisecond, "the slot goes with the gRPC stream")
	requireLive(t, s)
	require.Zero(t, lane(roleControl), "no lane once the gRPC stream is there")
}

// TestUpgradeRejectedFallsBack: while every endpoint slot of the UCX
// listener is taken (endpoints that never send their token), a client whose
// server allows it falls back to a TCP session within its handshake
// timeout, rather than spend the whole of it dialing again.
func TestUpgradeRejectedFallsBack(t *testing.T) {
	l, rc := heldOpenUCX(t, ModeAuto, WithTrustPeers(true))
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	slots := l.ucxSlots
	for range slots {
		ep, err := rc.Worker().Dial(ctx, l.UCXAddr().String())
		require.NoError(t, err)
		defer ep.Close()
	}
	require.Eventually(t, func() bool { return l.ucxSlotsHeld() == slots }, handTimeout, time.Millisecond)

	s, err := Dial(ctx, l.Addr().String(), WithRDMAContext(rc), WithTrustPeers(true), WithHandshakeTimeout(3*time.Second))
	require.NoError(t, err, "the client falls back to TCP")
	defer s.Close()
	require.Equal(t, "tcp", s.Transport())
}

// ucxSlotsHeld is how many UCX endpoint slots l has taken.
func (l *Listener) ucxSlotsHeld() int {
	l.ucxMu.Lock()
	defer l.ucxMu.Unlock()
	return l.ucxHeld
}

// TestTCPSessionRefusesUCXLane: a process runs a TCP listener for untrusted
// peers and a UCX listener for trusted ones. While a trusted client's
// handshake holds the UCX listener open, an untrusted peer whose session on
// the other listener runs over TCP dials the UCX listener and names its own
// session's token as a lane. The lane is refused (ack 0): a TCP session
// keeps no UCX endpoint into this process, whatever window let one in.
func TestTCPSessionRefusesUCXLane(t *testing.T) {
	rc := internalUCX(t)
	trusted, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX), WithTrustPeers(true), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	defer trusted.Close()
	public, err := Listen("127.0.0.1:0", WithMode(ModeTCP))
	require.NoError(t, err)
	defer public.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := public.Accept(); err == nil {
			accepted <- c
		}
	}()

	// A trusted client's proven handshake holds the UCX listener open.
	handClient(t, trusted.Addr().String(), ModeUCX, Caps{UCX: true}, true)
	require.Eventually(t, trusted.expectsUCX, handTimeout, time.Millisecond)

	// The untrusted peer's TCP session, with lanes; its control lane over UCX.
	_, w, _ := handClient(t, public.Addr().String(), ModeTCP, Caps{Lanes: true}, true)
	require.Equal(t, "tcp", w.Transport)
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	ep, err := rc.Worker().Dial(ctx, trusted.UCXAddr().String())
	require.NoError(t, err)
	defer ep.Close()
	require.NoError(t, ep.SetDeadline(time.Now().Add(handTimeout)))
	_, err = ep.Write(append(append([]byte(laneMagic), w.Token[:]...), roleControl))
	require.NoError(t, err)
	var ack [1]byte
	_, err = io.ReadFull(ep, ack[:])
	require.NoError(t, err)
	require.Equal(t, byte(0), ack[0], "a UCX endpoint taken as a TCP session's lane")

	// Its gRPC lane over TCP opens as usual (the control lane it asked for
	// stays taken), and the session holds no endpoint.
	require.Equal(t, byte(upgradeAckOK), tcpLane(t, public.Addr().String(), w.Token, roleGRPC), "the gRPC lane over TCP")
	s := acceptedSession(t, accepted)
	require.Equal(t, "tcp", s.Transport())
	s.laneMu.Lock()
	defer s.laneMu.Unlock()
	for _, c := range s.lanes {
		require.False(t, isEndpoint(c), "a UCX endpoint among the TCP session's lanes")
	}
}

// TestUCXEndpointSpeakingEarlyAborted: a client that sent its hello and no
// proof has a token; while another client holds the UCX listener open it
// dials an endpoint, presents the token, as an upgrade or as a lane (or a
// lane with a token nobody gave), and then floods the endpoint instead of
// waiting for the ack. UCX's stream has no flow control: what the listener
// does not read would pile up in this process until the handshake timeout,
// or for the linger of a close. The listener aborts the endpoint at its
// first byte (or at once, refusing the token), and the flood's writes fail
// within a small part of what the client meant to send.
func TestUCXEndpointSpeakingEarlyAborted(t *testing.T) {
	for _, tc := range []struct {
		name  string
		first func(token ID) []byte
	}{
		{"upgrade", func(token ID) []byte { return append([]byte(upgradeMagic), token[:]...) }},
		{"lane", func(token ID) []byte { return append(append([]byte(laneMagic), token[:]...), roleControl) }},
		{"lane-unknown-token", func(ID) []byte {
			token := newToken()
			return append(append([]byte(laneMagic), token[:]...), roleControl)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := internalUCX(t)
			l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX), WithHandshakeTimeout(time.Minute))
			require.NoError(t, err)
			defer l.Close()
			_, w, _ := handClient(t, l.Addr().String(), ModeUCX, Caps{UCX: true, Lanes: true}, false)
			handClient(t, l.Addr().String(), ModeUCX, Caps{UCX: true}, true) // holds the UCX listener open
			require.Eventually(t, l.expectsUCX, handTimeout, time.Millisecond)

			ep := attackerEndpoint(t, l)
			_, err = ep.Write(tc.first(w.Token))
			require.NoError(t, err)
			floodAborted(t, ep)
		})
	}
}

// tcpLane opens a lane of role for the session of token on the listener at
// addr, by hand over TCP, and returns the server's ack (0 when none came).
// The connection closes when the test ends.
func tcpLane(t *testing.T, addr string, token ID, role byte) byte {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(handTimeout)))
	_, err = c.Write(append(append([]byte(laneMagic), token[:]...), role))
	require.NoError(t, err)
	var ack [1]byte
	_, _ = io.ReadFull(c, ack[:])
	return ack[0]
}

// acceptedSession returns the session of the conn a listener's Accept
// passes on accepted, closed when the test ends.
func acceptedSession(t *testing.T, accepted <-chan net.Conn) *Session {
	t.Helper()
	select {
	case sc := <-accepted:
		t.Cleanup(func() { _ = sc.Close() })
		return SessionOf(sc)
	case <-time.After(handTimeout):
		t.Fatal("no session accepted")
	}
	return nil
}

// TestLaneOfAnotherListenerRefused: a client dials its lanes where it
// dialed its handshake. A lane that names the token of another listener's
// handshake (here: one whose client never proves its id, on listener b,
// while the lane reaches a) is refused at once, instead of waiting on a's
// side for b's session, past a's Close.
func TestLaneOfAnotherListenerRefused(t *testing.T) {
	a, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	defer a.Close()
	b, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	defer b.Close()
	_, w, _ := handClient(t, b.Addr().String(), ModeTCP, Caps{Lanes: true}, false)
	require.True(t, w.Caps.Lanes)
	c, err := net.Dial("tcp", a.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(handTimeout)))
	_, err = c.Write(append(append([]byte(laneMagic), w.Token[:]...), roleControl))
	require.NoError(t, err)
	var ack [1]byte
	_, err = io.ReadFull(c, ack[:])
	require.NoError(t, err, "no answer: the lane waits for another listener's session")
	require.Equal(t, byte(0), ack[0], "the lane refused")
}

// TestUCXEndpointFloodAfterAck: a client that proved its id, presented its
// token and got the ack, then floods its endpoint instead of sending its
// choice of UCX on the bootstrap connection. Nothing else reads the
// endpoint until the handshake reads that choice, and UCX's stream has no
// flow control: the listener reads what comes meanwhile and aborts the
// endpoint once it passes what an honest session's start sends (maxEarly),
// and the flood's writes fail within a small part of what the client meant
// to send.
func TestUCXEndpointFloodAfterAck(t *testing.T) {
	rc := internalUCX(t)
	l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX), WithHandshakeTimeout(time.Minute))
	require.NoError(t, err)
	defer l.Close()
	_, w, _ := handClient(t, l.Addr().String(), ModeUCX, Caps{UCX: true}, true) // never sends its choice
	require.Eventually(t, l.expectsUCX, handTimeout, time.Millisecond)

	ep := attackerEndpoint(t, l)
	_, err = ep.Write(append([]byte(upgradeMagic), w.Token[:]...))
	require.NoError(t, err)
	var ack [1]byte
	require.NoError(t, ep.SetReadDeadline(time.Now().Add(handTimeout)))
	_, err = io.ReadFull(ep, ack[:])
	require.NoError(t, err)
	require.Equal(t, byte(upgradeAckOK), ack[0])

	floodAborted(t, ep)
}

// attackerEndpoint dials l's UCX listener from a context and worker of its
// own (no in-process pairing with the listener's endpoint); they end with
// the test.
func attackerEndpoint(t *testing.T, l *Listener) *rdma.Endpoint {
	t.Helper()
	// A context of the attacker's own, which sends no zero-copy messages:
	// Debian's UCX 1.13 asserts (and aborts the process, the test's) in a
	// zero-copy send's completion when the endpoint it went on is aborted
	// under it ("comp->count > 0" in uct_iface.h, its tcp transport). It is
	// the sender that UCX takes down, the attacker here, never the listener.
	ac, err := rdma.NewContext(rdma.WithTransports("tcp"), rdma.WithConfig("ZCOPY_THRESH", "inf"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = ac.Close() })
	aw, err := ac.NewWorker()
	require.NoError(t, err)
	t.Cleanup(func() { _ = aw.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	ep, err := aw.Dial(ctx, l.UCXAddr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = ep.Close() })
	return ep
}

// floodAborted writes up to 1 GiB on ep, which the listener must abort
// well before: the writes fail (not stall) within a quarter of it, and ep
// ends.
func floodAborted(t *testing.T, ep *rdma.Endpoint) {
	t.Helper()
	chunk := make([]byte, 1<<20)
	const total = 1 << 30
	require.NoError(t, ep.SetWriteDeadline(time.Now().Add(30*time.Second)))
	written := 0
	var err error
	for written < total && err == nil {
		var n int
		n, err = ep.Write(chunk)
		written += n
	}
	require.Error(t, err, "the listener took %d MiB", written>>20)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the writes stalled instead of failing")
	t.Logf("the writes failed after %d MiB", written>>20)
	require.Less(t, written, total/4, "the listener took %d MiB before it let go of the endpoint", written>>20)
	select {
	case <-ep.Done():
	case <-time.After(handTimeout):
		t.Fatal("the attacker's endpoint outlived the abort")
	}
}

// TestUCXEndpointSilentAborted: an endpoint that sends part of its token,
// or none, by the handshake timeout is aborted, not closed: a close would
// wait for the peer's answer to its end while UCX queued whatever the peer
// still sent, which nobody reads. The peer sees its endpoint fail, not end.
func TestUCXEndpointSilentAborted(t *testing.T) {
	for _, sent := range [][]byte{nil, []byte(upgradeMagic[:2])} {
		t.Run(fmt.Sprintf("sent=%d", len(sent)), func(t *testing.T) {
			rc := internalUCX(t)
			l, err := Listen("127.0.0.1:0", WithRDMAContext(rc), WithMode(ModeUCX), WithHandshakeTimeout(300*time.Millisecond))
			require.NoError(t, err)
			defer l.Close()
			handClient(t, l.Addr().String(), ModeUCX, Caps{UCX: true}, true) // holds the UCX listener open
			require.Eventually(t, l.expectsUCX, handTimeout, time.Millisecond)
			ep := attackerEndpoint(t, l)
			if len(sent) > 0 {
				_, err = ep.Write(sent)
				require.NoError(t, err)
			}
			require.NoError(t, ep.SetReadDeadline(time.Now().Add(handTimeout)))
			_, err = ep.Read(make([]byte, 1))
			require.Error(t, err)
			require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the listener kept the endpoint")
			require.NotErrorIs(t, err, io.EOF, "the listener closed the endpoint instead of aborting it")
		})
	}
}
