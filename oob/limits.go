package oob

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"runtime/trace"
	"slices"
	"sync"
	"time"

	"github.com/gdrpc/gdrpc/transport"
)

// Limits bound what one peer's session may hold of this process: the
// destinations reserved for pulls from it, the pushes it has asked for, and
// the goroutines serving it. A peer that completed a handshake is not
// trusted: it must not be able to pin memory or goroutines beyond these,
// whatever it sends.
type Limits struct {
	// PullBytes bounds the destination bytes reserved at once for pulls
	// through one session, pulls whose caller gave up included until their
	// destination is released. A pull of a third party's payload, named in a
	// message that came over another session (a peer forwarding what it
	// received), counts against the session the message came over, not the
	// one to the owner: a peer spends its own budget, never another's. A
	// pull waits, before its destination is allocated, until the session
	// has room for it; it fails with a TransferExhausted error when it is
	// larger than PullBytes on its own, or when its context ends first.
	// PullBytes also bounds what a session's requests park (Park) while
	// the server has not handed them on. If zero, 4 GiB.
	PullBytes int64
	// TotalPullBytes bounds the destination bytes reserved at once for pulls
	// through all sessions together: a peer can open many sessions, under as
	// many identities (they cost it nothing), so PullBytes alone does not
	// bound what peers make this process allocate. Pulls wait and fail as for
	// PullBytes. If zero, twice PullBytes.
	TotalPullBytes int64
	// Pulls bounds the RTRs in flight on one session (sent and not yet
	// settled); further pulls wait as for PullBytes. A third party's pulls
	// count against the session they came over, as for PullBytes, and take
	// at most half of the Pulls of the session to the owner. If zero, 1024.
	Pulls int
	// Pushes bounds the pushes one session runs at once; its further RTRs
	// wait in a queue. If zero, 16; at most transport.MaxControlHandlers/2.
	Pushes int
	// PushQueue bounds the RTRs of one session waiting for a push. An RTR
	// beyond it is refused at once with a busy FIN (the receiver sees a
	// TransferExhausted error). If zero, 1024.
	PushQueue int
	// Abandoned bounds how long a destination stays reserved after its pull
	// gave up (the caller's context ended) with no answer from the owner. A
	// destination only the stream path could reach is released as soon as no
	// read into it is under way; one the owner could write by RDMA or CUDA IPC
	// is released when the owner answers or the session ends, and the session
	// is ended when the owner has not answered within Abandoned. An honest
	// owner answers an RTR within its own transfer timeout, so the default
	// ends only sessions whose owner does not. If zero, the transfer timeout.
	Abandoned time.Duration
	// SpaceBytes bounds the receive space this process advertises to its
	// peers, all sessions together (TransferConfig.ReceiveSpace and
	// ReceiveSpaceLimit bound one session's): a space that would go over it
	// is not advertised, and the payloads it would have held take the
	// rendezvous. Spaces are set aside for trusted peers only, but a peer can
	// open many sessions. If zero, DefaultSpaceBytes, or the engine's
	// TransferConfig.ReceiveSpace or ReceiveSpaceLimit where that is larger.
	SpaceBytes int64
	// UnpulledBytes bounds what one call's messages (a server stream's
	// responses) leave in this process's outbox for the peer to pull: a
	// stream whose client reads slowly, or not at all, would otherwise run
	// ahead and pin its payloads until their lease ends (DefaultLease). The
	// call's next message waits, before it is sent, for the peer's pulls,
	// within the call's context and its session (as gRPC's flow control
	// holds a stream's sender to a client that does not read it); a message
	// larger than UnpulledBytes on its own goes once nothing of its call
	// waits unpulled. Each call counts alone, so one the client leaves
	// unread holds back none of its other calls. A client stream's messages
	// (whose payloads gRPC cannot replay) are bound likewise, from the other
	// side: the next waits while the earlier ones left more than
	// UnpulledBytes unpulled (Flow.Wait), for a server that reads a stream
	// and never pulls would otherwise pin its payloads in the client.
	// Payloads written into the peer's receive space do not count. If zero,
	// DefaultUnpulledBytes.
	UnpulledBytes int64
	// PeerUnpulledBytes bounds what this process's outbox holds sent toward
	// one peer (one identity: a process may open sessions under many, so it
	// bounds a peer, not the outbox) and not pulled, all its calls together: a
	// client that takes responses and never pulls their payloads would
	// otherwise pin them, call after call, until their leases end. A message
	// that would go over it waits, before it is sent, for the peer's pulls of
	// any call's payloads, within its call's context, its session and its
	// payloads' lease (DefaultLease); a message larger than the bound on its
	// own goes once nothing sent toward the peer waits unpulled. An honest
	// client pulls what it decodes and withdraws what its ended calls left
	// (CALL-ENDED), so its calls wait here only while it leaves that much of
	// its streams unread. Payloads written into the peer's receive space do
	// not count. If zero, DefaultPeerUnpulledBytes.
	PeerUnpulledBytes int64
	// TotalUnpulledBytes bounds what this process's outbox holds sent toward
	// all peers together and not pulled: identities cost a peer nothing, so
	// PeerUnpulledBytes alone does not bound what peers that take responses
	// and never pull them pin. A message that would go over it waits, as for
	// PeerUnpulledBytes, once it is its peer's turn, for pulls of any peer's
	// payloads (or their leases ending); such messages go in the order they
	// came, and a message larger than the bound on its own goes once nothing
	// waits unpulled. Peers that fill it hold every peer's out-of-band
	// responses back until their payloads' leases end: the price of a bound
	// on memory, as for TotalPullBytes. If zero, twice PeerUnpulledBytes.
	TotalUnpulledBytes int64
	// PeerLingeringSessions bounds the sessions to one peer that linger at
	// once after gRPC closed their connections (see LingerIdle): a peer that
	// keeps each busy, or holds it, while it rotates connections would
	// otherwise keep every old session up for the transfer timeout, its
	// sockets and goroutines with it. A session that starts lingering past
	// the bound ends the linger of the oldest that no call of this side's own
	// keeps up (the application bounds those), whose peer may then fail to
	// pull what it had not yet pulled. A server whose clients each close
	// more connections at once, with unread messages on each, raises it. If
	// zero, DefaultPeerLingeringSessions.
	PeerLingeringSessions int
	// HostLingeringSessions bounds likewise the sessions that linger at
	// once to the peers of one remote host (Session.RemoteHost): a peer id
	// is the peer's to choose anew at each handshake, and a peer that takes
	// a new identity with each connection would have each of its sessions
	// counted apart under PeerLingeringSessions. A server whose clients
	// share an address (behind a NAT) shares this bound among them. If
	// zero, DefaultHostLingeringSessions.
	HostLingeringSessions int
}

// Defaults of Limits.
const (
	DefaultPullBytes = 4 << 30
	DefaultPulls     = 1024
	DefaultPushes    = 16
	DefaultPushQueue = 1024
	// DefaultUnpulledBytes is Limits.UnpulledBytes unless set.
	DefaultUnpulledBytes = 1 << 30
	// DefaultPeerUnpulledBytes is Limits.PeerUnpulledBytes unless set: four
	// calls' worth of DefaultUnpulledBytes.
	DefaultPeerUnpulledBytes = 4 * DefaultUnpulledBytes
	// DefaultSpaceBytes is Limits.SpaceBytes unless set: four sessions'
	// spaces grown to DefaultReceiveSpaceLimit.
	DefaultSpaceBytes = 4 * DefaultReceiveSpaceLimit
	// DefaultPeerLingeringSessions is Limits.PeerLingeringSessions unless
	// set.
	DefaultPeerLingeringSessions = 64
	// DefaultHostLingeringSessions is Limits.HostLingeringSessions unless
	// set: four peers' worth of DefaultPeerLingeringSessions.
	DefaultHostLingeringSessions = 4 * DefaultPeerLingeringSessions
)

func (l Limits) withDefaults(timeout time.Duration) Limits {
	if l.PullBytes <= 0 {
		l.PullBytes = DefaultPullBytes
	}
	if l.TotalPullBytes <= 0 {
		l.TotalPullBytes = 2 * min(l.PullBytes, math.MaxInt64/2)
	}
	if l.Pulls <= 0 {
		l.Pulls = DefaultPulls
	}
	if l.Pushes <= 0 {
		l.Pushes = DefaultPushes
	}
	// Pushers run on control handlers' goroutines: leave half of those to
	// the session's other control messages.
	l.Pushes = min(l.Pushes, transport.MaxControlHandlers/2)
	if l.PushQueue <= 0 {
		l.PushQueue = DefaultPushQueue
	}
	if l.Abandoned <= 0 {
		l.Abandoned = timeout
	}
	if l.UnpulledBytes <= 0 {
		l.UnpulledBytes = DefaultUnpulledBytes
	}
	if l.PeerUnpulledBytes <= 0 {
		l.PeerUnpulledBytes = DefaultPeerUnpulledBytes
	}
	if l.TotalUnpulledBytes <= 0 {
		l.TotalUnpulledBytes = 2 * min(l.PeerUnpulledBytes, math.MaxInt64/2) // a bound lifted stays lifted
	}
	if l.PeerLingeringSessions <= 0 {
		l.PeerLingeringSessions = DefaultPeerLingeringSessions
	}
	if l.HostLingeringSessions <= 0 {
		l.HostLingeringSessions = DefaultHostLingeringSessions
	}
	return l
}

// sessionBounds is a session's share of the out-of-band engine: the budget of
// its pulls, the queue of its pushes and the goroutines serving them, which
// Close joins. The zero value is ready to use.
type sessionBounds struct {
	mu        sync.Mutex
	pullBytes int64         // reserved for pulls through the session
	pulls     int           // pulls through the session not yet settled
	relayed   int           // of them, third parties' pulls charged to other sessions
	room      chan struct{} // closed when a reservation is given back; nil when nobody waits
	// parked is what requests that came over the session, whose handlers
	// do not have them yet, pull or pulled (Park); parkedRoom is closed
	// when some of it is taken off, nil when nobody waits.
	parked     int64
	parkedRoom chan struct{}
	parkQueue  []*parkTurn // the requests waiting in Park, in turn
	queue      []*rtr
	pushers    int  // goroutines running pushLoop
	closing    bool // Close is joining: no goroutine may start
	ctx        context.Context
	cancel     context.CancelFunc
	wg         sync.WaitGroup
}

// spawn runs fn on a goroutine that the session's Close joins. It reports
// false, without running fn, when the session is closing. fn must return once
// the session is done.
func (b *sessionBounds) spawn(fn func()) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closing {
		return false
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		fn()
	}()
	return true
}

// join waits for the goroutines spawn started; later spawns fail. The session
// is done by then, so they are returning.
func (b *sessionBounds) join() {
	b.mu.Lock()
	b.closing = true
	b.mu.Unlock()
	b.wg.Wait()
}

// endBounds runs when s closes: its context ends and its queued RTRs go.
func endBounds(a *attached) {
	b := &a.bounds
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cancel != nil {
		b.cancel()
	}
	b.queue = nil
}

// exhausted is the error of a pull refused by a limit.
func exhausted(t Token, format string, args ...any) error {
	return &TransferError{Token: t, Kind: TransferExhausted, Err: fmt.Errorf(format, args...)}
}

// reservePull reserves room for one pull of n bytes through via, charged to
// payer's bounds (via's own, or those of the session whose message named a
// third party's payload), waiting for it while ctx, payer and via live, and
// returns the function that gives it back (once). A third party's pull also
// takes one of via's RTRs in flight (Limits.Pulls bounds what an owner is
// asked at once, which its push queue is sized for), and such pulls hold at
// most half of them: the owner's own messages keep the rest.
func reservePull(ctx context.Context, payer, via *transport.Session, t Token, n uint64) (func(), error) {
	s := payer
	lim := cfgOf(s).Limits
	if n > uint64(lim.PullBytes) {
		return nil, exhausted(t, "a %d-byte payload is over the limit of %d bytes in flight per session (Limits.PullBytes)", n, lim.PullBytes)
	}
	if n > uint64(lim.TotalPullBytes) {
		return nil, exhausted(t, "a %d-byte payload is over the limit of %d bytes in flight in all (Limits.TotalPullBytes)", n, lim.TotalPullBytes)
	}
	b := &stateOf(s).bounds
	var v *sessionBounds // via's, for a third party's pull
	viaPulls, relayMax := 0, 0
	if via != payer {
		// Both live, or no pull: the bounds of sessions the engine no
		// longer serves are one shared value, which the lock order by
		// session id below would take twice, or in either order.
		pa, ok := sessions.Load(payer)
		if !ok {
			return nil, sessionError(t, payer, ctx, closedErr(payer))
		}
		va, ok := sessions.Load(via)
		if !ok {
			return nil, sessionError(t, via, ctx, closedErr(via))
		}
		b, v = &pa.(*attached).bounds, &va.(*attached).bounds
		viaPulls = cfgOf(via).Limits.Pulls
		relayMax = max(viaPulls/2, 1)
	}
	// Lock order: two sessions' bounds by session id, then the process's.
	first, second := b, v
	if v != nil && via.ID() < payer.ID() {
		first, second = v, b
	}
	lock := func() {
		first.mu.Lock()
		if second != nil {
			second.mu.Lock()
		}
		pullTotal.mu.Lock()
	}
	unlock := func() {
		pullTotal.mu.Unlock()
		if second != nil {
			second.mu.Unlock()
		}
		first.mu.Unlock()
	}
	for {
		lock()
		// Sums, not differences: pullTotal is the process's, and an engine
		// with a smaller TotalPullBytes than another's may see it over its
		// own limit.
		ok := b.pulls < lim.Pulls && uint64(b.pullBytes)+n <= uint64(lim.PullBytes) && uint64(pullTotal.bytes)+n <= uint64(lim.TotalPullBytes)
		if v != nil {
			ok = ok && v.pulls < viaPulls && v.relayed < relayMax
		}
		if ok {
			b.pulls++
			b.pullBytes += int64(n)
			pullTotal.bytes += int64(n)
			if v != nil {
				v.pulls++
				v.relayed++
			}
			unlock()
			break
		}
		var viaRoom chan struct{} // nil: never ready
		if v != nil {
			if v.room == nil {
				v.room = make(chan struct{})
			}
			viaRoom = v.room
		}
		if b.room == nil {
			b.room = make(chan struct{})
		}
		if pullTotal.room == nil {
			pullTotal.room = make(chan struct{})
		}
		room, totalRoom, pulls, inflight, total := b.room, pullTotal.room, b.pulls, b.pullBytes, pullTotal.bytes
		unlock()
		select {
		case <-room:
		case <-viaRoom:
		case <-totalRoom:
		case <-ctx.Done():
			return nil, exhausted(t, "no room for a %d-byte payload charged to session %d: %d pulls of %d bytes in flight, %d bytes in all (Limits.Pulls %d, Limits.PullBytes %d, Limits.TotalPullBytes %d; a third party's pulls hold at most half the Pulls of the session to its owner): %w",
				n, s.ID(), pulls, inflight, total, lim.Pulls, lim.PullBytes, lim.TotalPullBytes, ctx.Err())
		case <-s.Done():
			return nil, sessionError(t, s, ctx, s.Err())
		case <-via.Done():
			return nil, sessionError(t, via, ctx, via.Err())
		}
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			lock()
			b.pulls--
			b.pullBytes -= int64(n)
			pullTotal.bytes -= int64(n)
			rooms := []*chan struct{}{&b.room, &pullTotal.room}
			if v != nil {
				v.pulls--
				v.relayed--
				rooms = append(rooms, &v.room)
			}
			for _, r := range rooms {
				if *r != nil {
					close(*r)
					*r = nil
				}
			}
			unlock()
		})
	}, nil
}

// Park parks n bytes on s, the session a server's request came over, until
// the returned function runs (once): payloads pulled for a request whose
// handler does not have it yet. A gRPC server decodes a unary or
// server-streaming call's request, and its payloads are pulled, before the
// client has ended its side of the stream, and gRPC waits for that end
// before the handler runs: a client that never ended its side would
// otherwise have each such call keep its payloads, with no handler to use
// or release them, beyond every bound. Park first waits, within ctx (the
// call's), until what other requests parked on s leaves room for n within
// s's Limits.PullBytes, or nothing is parked there, and what the sessions
// of s's remote host (Session.RemoteHost) parked leaves room for n within
// Limits.TotalPullBytes, or nothing is parked there: a session's requests
// park at most PullBytes, or one request's payloads, and a host's at most
// TotalPullBytes, however many connections it opens; only the same
// session's, or host's, later requests wait for them. A request parks all
// its payloads at once, before it pulls any, so that no two requests wait
// for each other. Requests that wait park in the order they came: a
// session's in turn, and those of a host's sessions that wait for the
// host's room in turn.
func Park(ctx context.Context, s *transport.Session, n uint64) (unpark func(), err error) {
	a, ok := sessions.Load(s)
	if !ok {
		return nil, sessionError(Token{}, s, ctx, closedErr(s))
	}
	lim := cfgOf(s).Limits
	b, host := &a.(*attached).bounds, s.RemoteHost()
	limit, hostLimit := uint64(lim.PullBytes), uint64(lim.TotalPullBytes)
	// Lock order: the session's bounds, then parkedHosts. A request that
	// must wait takes its turn in the session's queue, and, once it is the
	// session's first and fits the session's room, in its host's: only the
	// first of each may park, so that later requests, of the session or of
	// the host's other sessions, do not pass it.
	var turn *parkTurn // this request's place in the queues, once queued
	inHost := false    // turn is in parkedHosts.queue[host]
	for {
		b.mu.Lock()
		parkedHosts.Lock()
		hostParked, hostQueue := parkedHosts.bytes[host], parkedHosts.queue[host]
		first := len(b.parkQueue) == 0 || b.parkQueue[0] == turn
		fits := b.parked == 0 || uint64(b.parked)+n <= limit
		hostFirst := len(hostQueue) == 0 || hostQueue[0] == turn
		if first && fits && hostFirst && (hostParked == 0 || uint64(hostParked)+n <= hostLimit) {
			b.parked += int64(n)
			parkedHosts.bytes[host] += int64(n)
			b.leaveParkTurn(host, turn, inHost) // the next may fit too
			parkedHosts.Unlock()
			b.mu.Unlock()
			break
		}
		if turn == nil {
			turn = new(parkTurn)
			b.parkQueue = append(b.parkQueue, turn)
		}
		if first && fits && !inHost {
			// Its session has room: it waits for its host's, in turn.
			parkedHosts.queue[host] = append(hostQueue, turn)
			inHost = true
		}
		if b.parkedRoom == nil {
			b.parkedRoom = make(chan struct{})
		}
		hostRoom := parkedHosts.room[host]
		if hostRoom == nil {
			hostRoom = make(chan struct{})
			parkedHosts.room[host] = hostRoom
		}
		parkedHosts.Unlock()
		room, parked := b.parkedRoom, b.parked
		b.mu.Unlock()
		var err error
		select {
		case <-room:
		case <-hostRoom:
		case <-ctx.Done():
			err = &TransferError{Kind: TransferExhausted, Err: fmt.Errorf("no room for a request's %d bytes of payloads through session %d: requests parked there hold %d bytes (Limits.PullBytes %d), and those of its host %v %d bytes (Limits.TotalPullBytes %d), or earlier requests wait for room: %w",
				n, s.ID(), parked, limit, host, hostParked, hostLimit, ctx.Err())}
		case <-s.Done():
			err = sessionError(Token{}, s, ctx, s.Err())
		}
		if err != nil {
			b.mu.Lock()
			parkedHosts.Lock()
			b.leaveParkTurn(host, turn, inHost)
			parkedHosts.Unlock()
			b.mu.Unlock()
			return nil, err
		}
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			b.parked -= int64(n)
			b.wakeParked()
			parkedHosts.Lock()
			if parkedHosts.bytes[host] -= int64(n); parkedHosts.bytes[host] == 0 {
				delete(parkedHosts.bytes, host)
			}
			parkedHosts.wake(host)
			parkedHosts.Unlock()
			b.mu.Unlock()
		})
	}, nil
}

// parkTurn is a request's place in a session's Park queue: not zero-sized,
// so that each has an address of its own.
type parkTurn struct{ _ byte }

// leaveParkTurn takes turn, if any, out of b's Park queue and, where
// inHost, out of host's; each queue it led wakes its waiters. b.mu and
// parkedHosts are held.
func (b *sessionBounds) leaveParkTurn(host netip.Prefix, turn *parkTurn, inHost bool) {
	if turn == nil {
		return
	}
	if inHost {
		parkedHosts.leaveQueue(host, turn)
	}
	b.leaveParkQueue(turn)
}

// leaveParkQueue takes turn out of b's Park queue and, where it was the
// first, wakes the others: the next may park now. b.mu is held.
func (b *sessionBounds) leaveParkQueue(turn *parkTurn) {
	i := slices.Index(b.parkQueue, turn)
	if i < 0 {
		return
	}
	b.parkQueue = slices.Delete(b.parkQueue, i, i+1)
	if i == 0 {
		b.wakeParked()
	}
}

// wakeParked wakes the requests waiting for room to park on b. b.mu is
// held.
func (b *sessionBounds) wakeParked() {
	if b.parkedRoom != nil {
		close(b.parkedRoom)
		b.parkedRoom = nil
	}
}

// parkedHosts are the bytes the sessions of each remote host parked (Park);
// for each host some request waits on, a channel closed when some go or the
// first in line leaves; and the requests waiting for their host's room, in
// turn.
var parkedHosts = hostParking{
	bytes: map[netip.Prefix]int64{},
	room:  map[netip.Prefix]chan struct{}{},
	queue: map[netip.Prefix][]*parkTurn{},
}

type hostParking struct {
	sync.Mutex
	bytes map[netip.Prefix]int64
	room  map[netip.Prefix]chan struct{}
	queue map[netip.Prefix][]*parkTurn
}

// leaveQueue takes turn out of host's queue and, where it was the first,
// wakes the host's waiters: the next may park now. The lock is held.
func (h *hostParking) leaveQueue(host netip.Prefix, turn *parkTurn) {
	q := h.queue[host]
	i := slices.Index(q, turn)
	if i < 0 {
		return
	}
	if q = slices.Delete(q, i, i+1); len(q) == 0 {
		delete(h.queue, host)
	} else {
		h.queue[host] = q
	}
	if i == 0 {
		h.wake(host)
	}
}

// wake wakes the requests waiting for host's room. The lock is held.
func (h *hostParking) wake(host netip.Prefix) {
	if r := h.room[host]; r != nil {
		close(r)
		delete(h.room, host)
	}
}

// pullTotal is what all sessions' pulls reserve together (Limits.TotalPullBytes).
var pullTotal struct {
	mu    sync.Mutex
	bytes int64
	room  chan struct{} // closed when bytes go back; nil while nobody waits
}

// ---- receiver: destinations of pulls that gave up ------------------------------

// exposed reports whether the owner may write into p's destination (or its
// staging) on its own, by RDMA or CUDA IPC, until it answers: then releasing
// the destination before FIN could let a late write land in memory that went
// on to someone else. A destination only the stream path reaches is written
// by this process's own readers, which stop once the pull is settled.
func (p *pull) exposed() bool {
	return !p.answered && p.offers&(PathRDMA|PathCUDAIPC|PathStaged) != 0
}

// errOwnerSilent ends a session whose owner did not answer an abandoned pull
// in time.
var errOwnerSilent = errors.New("gdrpc: the owner did not answer a pull it could still write into")

// errOwnerStalled ends a session whose owner answered a pull into the
// caller's memory while bytes it began to send kept coming past the pull's
// time.
var errOwnerStalled = errors.New("gdrpc: the owner answered a pull while its bytes kept coming")

// settleLater settles a pull whose caller gave up. A destination that is not
// exposed is released as soon as no read into it is under way. An exposed one
// stays reserved until the owner answers or the session dies; when the owner
// stays silent past Limits.Abandoned, the session is ended, which stops
// everything the owner could still do through it.
func (p *pull) settleLater() {
	if !p.exposed() {
		p.settled()
		return
	}
	t := time.NewTimer(cfgOf(p.s).Limits.Abandoned)
	defer t.Stop()
	select {
	case <-p.fin:
	case <-p.s.Done():
	case <-t.C:
		abort(p.s, fmt.Errorf("%w: %w", transport.ErrPeerGone, errOwnerSilent))
	}
	p.settled()
}

// abandon hands a pull whose caller gave up to a goroutine of its session.
func (p *pull) abandon() {
	if !stateOf(p.s).bounds.spawn(p.settleLater) {
		p.settled() // the session is closing: the owner can no longer write
	}
}

// ---- owner: the push queue -----------------------------------------------------

// queueRTR takes an RTR off the control stream: it queues it for one of the
// session's pushers, becoming one itself when fewer than Limits.Pushes run,
// or refuses it when the queue is full.
func queueRTR(s *transport.Session, payload []byte) {
	trace.Log(context.Background(), "gdrpc", "rtr-received")
	m, err := parseRTR(payload)
	if err != nil {
		dropControl(s, err)
		return
	}
	a := stateOf(s)
	if a.link == nil {
		return // the session closed: nobody waits for a FIN
	}
	lim := a.eng.config().Limits
	b := &a.bounds
	b.mu.Lock()
	if len(b.queue) >= lim.PushQueue {
		b.mu.Unlock()
		refuseRTR(s, m, fmt.Sprintf("owner busy: %d transfers queued for this session", lim.PushQueue))
		return
	}
	b.queue = append(b.queue, m)
	start := b.pushers < lim.Pushes
	if start {
		b.pushers++
	}
	b.mu.Unlock()
	if start {
		// This control message's goroutine becomes the pusher: a hand-off to
		// another goroutine would cost a wake-up per transfer. The session
		// joins it like every control handler; Pushes (at most
		// transport.MaxControlHandlers/2) bounds how many are pushers.
		pushLoop(a)
	}
}

// pushLoop serves the queued RTRs of a's session until none is left.
func pushLoop(a *attached) {
	s, b := a.s, &a.bounds
	for {
		b.mu.Lock()
		if len(b.queue) == 0 {
			b.pushers--
			b.mu.Unlock()
			return
		}
		m := b.queue[0]
		b.queue[0] = nil
		b.queue = b.queue[1:]
		b.mu.Unlock()
		serveRTR(s, m, a.eng.config())
	}
}

// refuseRTR answers m with a busy FIN.
func refuseRTR(s *transport.Session, m *rtr, msg string) {
	ctx, cancel := context.WithTimeout(sessionContext(s), cfgOf(s).Timeout)
	defer cancel()
	f := &fin{Req: m.Req, Status: finBusy, Msg: msg}
	if err := sendControl(ctx, s, ctlFIN, f.marshal()); err != nil {
		cfgOf(s).Logger.Debug("FIN not sent", "session", s.ID(), "err", err)
	}
}
