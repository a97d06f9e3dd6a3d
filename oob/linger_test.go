package oob

import (
	"bytes"
	"maps"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// lingerAsync runs a's linger and then closes its session, as the
// transport does once the gRPC conn closed, and returns a channel closed
// when the linger returned: a transfer that outlives the linger fails.
func lingerAsync(a *attached) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		lingerForTransfers(a)
		a.s.Close()
	}()
	return done
}

// requireReturns waits, bounded, for a linger to return.
func requireReturns(t *testing.T, done <-chan struct{}, who string) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(10 * time.Second): // far under the default transfer timeout
		t.Fatalf("the %s's linger did not return", who)
	}
}

// requireLingers checks, past the idle time that ends a linger with nothing
// open, that a linger still runs and its session is up.
func requireLingers(t *testing.T, done <-chan struct{}, s *transport.Session, why string) {
	t.Helper()
	time.Sleep(2 * LingerIdle)
	select {
	case <-done:
		t.Fatalf("the linger returned: %s", why)
	default:
	}
	requireLive(t, s)
}

// shortPair is a pair of sessions whose engines have a transfer timeout of d.
func shortPair(t *testing.T, d time.Duration) (client, server *transport.Session) {
	side := func() []transport.Option {
		return []transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(TransferConfig{Timeout: d}))}
	}
	return transporttest.PairWith(t, side(), side())
}

// Nothing open on either side: each side's linger ends once it saw no
// transfer for LingerIdle, long before the transfer timeout.
func TestLingerEndsIdle(t *testing.T) {
	c, s := pipePair(t)
	start := time.Now()
	cd, sd := lingerAsync(stateOf(c)), lingerAsync(stateOf(s))
	requireReturns(t, cd, "client")
	requireReturns(t, sd, "server")
	require.GreaterOrEqual(t, time.Since(start), LingerIdle, "a linger ended before its session was idle for LingerIdle")
}

// A client call still open when the conn closed (a server stream's last
// messages unread) holds the session at both ends: the owner's payload can
// still be pulled after a stall longer than LingerIdle, and once the call
// ended both lingers return.
func TestLingerHeldForOpenCall(t *testing.T) {
	c, s := pipePair(t)
	payload := bytes.Repeat([]byte("unread message's payload "), 1<<12)
	d := Offer(Source{Bytes: payload}, OfferOptions{})
	defer Withdraw(d.Token)
	d.Owner = c.Peer().ID
	SentToward(s, []Token{d.Token})

	Receiving(c)
	// The owner lingers once the hold reached it: a client slower than
	// LingerIdle to ask loses the session, which is not what this tests.
	cd := lingerAsync(stateOf(c))
	require.Eventually(t, stateOf(s).peerHolds, 10*time.Second, time.Millisecond, "the client's hold")
	sd := lingerAsync(stateOf(s))
	requireLingers(t, sd, s, "the owner closed a session held for an open call")
	got := make([]byte, len(payload))
	_, err := FetchBytes(testContext(t), d, got)
	require.NoError(t, err)
	require.Equal(t, payload, got)
	requireLingers(t, cd, c, "the client closed a session with an open call")

	Received(c)
	requireReturns(t, cd, "client")
	requireReturns(t, sd, "server")
	require.Zero(t, stateOf(c).openCalls.Load())
}

// A peer that holds a session and never releases it (or keeps a call open
// forever) keeps it up no longer than the transfer timeout. A malformed
// hold, a release without a hold, and a hold handled after the release that
// followed it change nothing.
func TestLingerBoundedByHostilePeer(t *testing.T) {
	const timeout = 1500 * time.Millisecond
	t.Run("hold never released", func(t *testing.T) {
		c, s := shortPair(t, timeout)
		require.NoError(t, sendControl(testContext(t), c, ctlHold, lingerMsg(1)))
		require.Eventually(t, stateOf(s).peerHolds, 10*time.Second, time.Millisecond)
		start := time.Now()
		requireReturns(t, lingerAsync(stateOf(s)), "server")
		require.GreaterOrEqual(t, time.Since(start), timeout)
	})
	t.Run("call never ended", func(t *testing.T) {
		c, _ := shortPair(t, timeout)
		Receiving(c)
		defer Received(c)
		start := time.Now()
		requireReturns(t, lingerAsync(stateOf(c)), "client")
		require.GreaterOrEqual(t, time.Since(start), timeout)
	})
	for _, tc := range []struct {
		name string
		msgs []func(c *transport.Session) error
	}{
		{"malformed hold", []func(*transport.Session) error{
			func(c *transport.Session) error {
				return sendControl(testContext(t), c, ctlHold, []byte("not a number"))
			},
			func(c *transport.Session) error { return sendControl(testContext(t), c, ctlHold, lingerMsg(1<<63)) },
		}},
		{"release without hold", []func(*transport.Session) error{
			func(c *transport.Session) error { return sendControl(testContext(t), c, ctlRelease, lingerMsg(1)) },
		}},
		{"hold after its release", []func(*transport.Session) error{
			func(c *transport.Session) error { return sendControl(testContext(t), c, ctlRelease, lingerMsg(2)) },
			func(c *transport.Session) error { return sendControl(testContext(t), c, ctlHold, lingerMsg(1)) },
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			handled := countLingerHandled(t)
			c, s := shortPair(t, time.Minute)
			for _, send := range tc.msgs {
				require.NoError(t, send(c))
			}
			require.Eventually(t, func() bool { return handled.Load() == int64(len(tc.msgs)) }, 10*time.Second, time.Millisecond)
			require.False(t, stateOf(s).peerHolds())
			start := time.Now()
			requireReturns(t, lingerAsync(stateOf(s)), "server")
			require.Less(t, time.Since(start), 5*time.Second, "the linger waited for a hold it should not have")
		})
	}
}

// countLingerHandled counts the ctlHold and ctlRelease messages handled (in
// any order, malformed ones too) until the test ends.
func countLingerHandled(t *testing.T) *atomic.Int64 {
	var n atomic.Int64
	controlMu.Lock()
	saved := map[byte]func(*transport.Session, []byte){ctlHold: controlHandlers[ctlHold], ctlRelease: controlHandlers[ctlRelease]}
	for typ, fn := range saved {
		controlHandlers[typ] = func(s *transport.Session, p []byte) {
			fn(s, p)
			n.Add(1)
		}
	}
	controlMu.Unlock()
	t.Cleanup(func() {
		controlMu.Lock()
		maps.Copy(controlHandlers, saved)
		controlMu.Unlock()
	})
	return &n
}

// A server's words and RTRs for payloads the client never offered keep no
// client session up: only a client's calls hold one, and only pushes of
// payloads the outbox holds are transfers.
func TestLingerNotHeldByServer(t *testing.T) {
	c, s := shortPair(t, time.Minute)
	ctx := testContext(t)
	Receiving(c) // the client's call, over (the server's word counts only where the peer makes calls)
	Received(c)
	handled := countLingerHandled(t)
	require.NoError(t, sendControl(ctx, s, ctlHold, lingerMsg(1)))
	require.NoError(t, sendControl(ctx, s, ctlHold, lingerMsg(2)))
	require.Eventually(t, func() bool { return handled.Load() == 2 }, 10*time.Second, time.Millisecond)
	require.False(t, stateOf(c).peerHolds(), "a server's hold")

	start := time.Now()
	done := lingerAsync(stateOf(c))
	stop := make(chan struct{})
	defer close(stop)
	go func() { // RTRs for tokens never offered, faster than LingerIdle
		tick := time.NewTicker(LingerIdle / 5)
		defer tick.Stop()
		for req := uint64(1); ; req++ {
			m := &rtr{Req: req, Token: newToken(), Length: 4096, Offers: PathStream}
			if sendControl(ctx, s, ctlRTR, m.marshal()) != nil {
				return
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	requireReturns(t, done, "client")
	require.Less(t, time.Since(start), 5*time.Second, "the linger waited for the server's made-up transfers")
}

// A server's hold that came before the client's first call is dropped once
// the call is made: the hold was recorded while the side that makes the
// calls was not known yet, and the server's later release is dropped.
func TestLingerServerHoldBeforeCall(t *testing.T) {
	c, s := shortPair(t, time.Minute)
	ctx := testContext(t)
	handled := countLingerHandled(t)
	require.NoError(t, sendControl(ctx, s, ctlHold, lingerMsg(1))) // right after the handshake
	require.Eventually(t, func() bool { return handled.Load() == 1 }, 10*time.Second, time.Millisecond)
	Receiving(c) // the client's first call
	Received(c)
	require.False(t, stateOf(c).peerHolds(), "the server's hold outlived the client's first call")
	start := time.Now()
	requireReturns(t, lingerAsync(stateOf(c)), "client")
	require.Less(t, time.Since(start), 5*time.Second, "the server's hold kept the client's session lingering")
}

// At most Limits.PeerLingeringSessions sessions to one peer linger at once
// (lingerBound here; the default is larger only): a peer that
// holds each (or keeps it busy) while it rotates connections ends the linger
// of the oldest with each new one. A session that this side's own open call
// keeps up is not ended (the application bounds those calls).
func TestLingeringBoundedPerPeer(t *testing.T) {
	t.Run("held by the peer", testLingeringHeld)
	t.Run("own open calls", func(t *testing.T) {
		server := transport.NewIdentity()
		var clients []*transport.Session
		for range lingerBound + 1 {
			c, _ := transporttest.PairWith(t,
				[]transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(lingerConfig))},
				[]transport.Option{transport.WithIdentity(server), transport.WithEngine(New(lingerConfig))})
			Receiving(c)
			clients = append(clients, c)
		}
		var dones []<-chan struct{}
		for i, c := range clients {
			dones = append(dones, lingerAsync(stateOf(c)))
			require.Eventually(t, lingeringTo(server.ID(), i+1), 10*time.Second, time.Millisecond)
		}
		for i, d := range dones {
			select {
			case <-d:
				t.Fatalf("session %d stopped lingering with its call open", i)
			default:
			}
		}
		for _, c := range clients {
			Received(c)
		}
		for _, d := range dones {
			requireReturns(t, d, "client")
		}
	})
}

// lingerBound is the Limits.PeerLingeringSessions of lingerConfig, the
// engines' of TestLingeringBoundedPerPeer.
const lingerBound = 5

var lingerConfig = TransferConfig{Timeout: time.Minute, Limits: Limits{PeerLingeringSessions: lingerBound}}

// lingeringTo returns a condition: n sessions to peer linger.
func lingeringTo(peer transport.ID, n int) func() bool {
	return func() bool {
		lingerers.Lock()
		defer lingerers.Unlock()
		return len(lingerers.byPeer[peer]) == n
	}
}

func testLingeringHeld(t *testing.T) {
	client := transport.NewIdentity()
	var servers []*transport.Session
	for range lingerBound + 1 {
		c, s := transporttest.PairWith(t,
			[]transport.Option{transport.WithIdentity(client), transport.WithEngine(New(lingerConfig))},
			[]transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(lingerConfig))})
		require.NoError(t, sendControl(testContext(t), c, ctlHold, lingerMsg(1)))
		require.Eventually(t, stateOf(s).peerHolds, 10*time.Second, time.Millisecond)
		servers = append(servers, s)
	}
	var dones []<-chan struct{}
	for i, s := range servers[:lingerBound] { // in order: the first is the oldest
		dones = append(dones, lingerAsync(stateOf(s)))
		require.Eventually(t, lingeringTo(client.ID(), i+1), 10*time.Second, time.Millisecond)
	}
	last := lingerAsync(stateOf(servers[lingerBound]))
	requireReturns(t, dones[0], "oldest server session")
	for i, d := range dones[1:] {
		select {
		case <-d:
			t.Fatalf("session %d stopped lingering: only the oldest goes", i+1)
		default:
		}
	}
	for _, s := range servers {
		require.NoError(t, s.Close())
	}
	for _, d := range append(dones[1:], last) {
		requireReturns(t, d, "server")
	}
	lingerers.Lock()
	defer lingerers.Unlock()
	require.Empty(t, lingerers.byPeer[servers[0].PeerID()])
}

// At most Limits.HostLingeringSessions sessions to one remote host linger
// at once, whatever peer ids their peers took: a client that takes a new
// identity for each connection, holding each session, ends the linger of
// its host's oldest, and not another host's.
func TestLingeringBoundedPerHost(t *testing.T) {
	cfg := TransferConfig{Timeout: time.Minute, Limits: Limits{HostLingeringSessions: lingerBound}}
	held := func(from string) *transport.Session {
		c1, c2 := tcpConnFrom(t, from)
		c, s := transporttest.PairOver(t, c1, c2,
			[]transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(cfg))},
			[]transport.Option{transport.WithIdentity(transport.NewIdentity()), transport.WithEngine(New(cfg))})
		require.NoError(t, sendControl(testContext(t), c, ctlHold, lingerMsg(1)))
		require.Eventually(t, stateOf(s).peerHolds, 10*time.Second, time.Millisecond)
		return s
	}
	other := held("127.0.0.3") // the oldest lingering, of another host
	otherDone := lingerAsync(stateOf(other))
	require.Eventually(t, lingeringFrom(other.RemoteHost(), 1), 10*time.Second, time.Millisecond)

	var servers []*transport.Session
	for range lingerBound + 1 {
		servers = append(servers, held("127.0.0.2"))
	}
	host := servers[0].RemoteHost()
	require.Equal(t, "127.0.0.2/32", host.String())
	var dones []<-chan struct{}
	for i, s := range servers[:lingerBound] {
		dones = append(dones, lingerAsync(stateOf(s)))
		require.Eventually(t, lingeringFrom(host, i+1), 10*time.Second, time.Millisecond)
	}
	last := lingerAsync(stateOf(servers[lingerBound]))
	requireReturns(t, dones[0], "oldest server session of the host")
	for i, d := range append(dones[1:], otherDone) {
		select {
		case <-d:
			t.Fatalf("session %d stopped lingering: only the host's oldest goes", i+1)
		default:
		}
	}
	for _, s := range append(servers, other) {
		require.NoError(t, s.Close())
	}
	for _, d := range append(dones[1:], last, otherDone) {
		requireReturns(t, d, "server")
	}
	lingerers.Lock()
	defer lingerers.Unlock()
	require.Empty(t, lingerers.byHost)
	require.Empty(t, lingerers.byPeer)
}

// lingeringFrom returns a condition: n sessions to host linger.
func lingeringFrom(host netip.Prefix, n int) func() bool {
	return func() bool {
		lingerers.Lock()
		defer lingerers.Unlock()
		return len(lingerers.byHost[host]) == n
	}
}

// tcpConnFrom returns the two ends of a TCP connection over the loopback
// interface whose client end has the address from (any of 127/8).
func tcpConnFrom(t *testing.T, from string) (client, server net.Conn) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
	client, err = d.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	server, err = l.Accept()
	if err != nil {
		_ = client.Close()
	}
	require.NoError(t, err)
	return client, server
}

// The words of the side that makes the gRPC calls count whichever side
// dialed: a gRPC client over a conn its listener accepted holds the session
// at the end that dialed and serves it.
func TestLingerHeldByAcceptingClient(t *testing.T) {
	c, s := shortPair(t, time.Minute)
	Receiving(s) // the accepting side's call
	defer Received(s)
	require.NoError(t, sendControl(testContext(t), s, ctlHold, lingerMsg(1)))
	require.Eventually(t, stateOf(c).peerHolds, 10*time.Second, time.Millisecond, "the accepting client's hold")
}
