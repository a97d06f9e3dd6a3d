package transport

import (
	"container/list"
	"net"
	"net/netip"
	"sync"

	"github.com/gdrpc/gdrpc/rdma"
)

// A listener shares its handshake slots (maxHandshakes) out between remote
// hosts, so that one host's connections that never finish their handshake
// cannot keep the other hosts' clients waiting: a host is served at most
// maxHandshakesPerHost connections at once, its others wait in its queue,
// and a slot that frees goes to the waiting host that holds the fewest
// (among those, the first to come to that number). The queues hold at most
// maxQueued connections in all; past that, the host with the longest queue
// (the latest to come to that length) loses its newest connection. An honest client's handshake lasts a round trip or two (a
// session's lanes take a slot each), so a burst of them from one host waits
// its turn rather than failing. Every step costs O(maxHandshakesPerHost) at
// most, however many hosts wait. Variables for tests, read by Listen.
var (
	maxHandshakesPerHost = 64
	maxQueued            = 4096
)

// hostShares is the share-out; the Listener's methods below use it.
type hostShares struct {
	perHost, maxQueued int // the bounds, as Listen found them

	mu     sync.Mutex
	hosts  map[netip.Prefix]*hostSlots // hosts being served or waiting
	ready  []*list.List                // [n]: waiting hosts served n < perHost connections, in the order they came to n
	byLen  map[int]*list.List          // [n]: hosts with n connections queued, in the order they came to n
	queued int                         // connections queued, all hosts
	most   int                         // the longest queue's length
	shut   bool                        // the listener closed: queue no more

	serve func(c net.Conn, host netip.Prefix) // tests: what serves a connection instead of serveTCP
}

func newHostShares() *hostShares {
	hs := &hostShares{
		perHost:   maxHandshakesPerHost,
		maxQueued: maxQueued,
		hosts:     map[netip.Prefix]*hostSlots{},
		byLen:     map[int]*list.List{},
	}
	for range hs.perHost {
		hs.ready = append(hs.ready, list.New())
	}
	return hs
}

// hostSlots is what a remote host holds of a listener's handshakes.
type hostSlots struct {
	host    netip.Prefix
	serving int        // its connections served before their handshake ends
	queued  []net.Conn // its connections waiting for a slot, oldest first
	inReady *list.Element
	readyAt int // the index of ready that holds inReady
	inLen   *list.Element
}

// hostOf returns the remote host of c, as the share-out counts them: an
// IPv4 address, an IPv6 /64 (a host may take any address of its /64).
func hostOf(c net.Conn) netip.Prefix { return hostOfAddr(c.RemoteAddr()) }

// hostOfAddr returns the host of a TCP or UCX address as hostOf counts them;
// addresses of other kinds, or none, count as one host.
func hostOfAddr(a net.Addr) netip.Prefix {
	var ip netip.Addr
	switch a := a.(type) {
	case *net.TCPAddr:
		if a != nil {
			ip = a.AddrPort().Addr()
		}
	case *rdma.Addr:
		if a != nil {
			ip, _ = netip.AddrFromSlice(a.IP)
		}
	}
	if !ip.IsValid() {
		return netip.Prefix{}
	}
	ip = ip.Unmap() // Prefix drops a zone
	bits := 32
	if ip.Is6() {
		bits = 64
	}
	p, _ := ip.Prefix(bits)
	return p
}

// admit serves a connection just accepted, or queues it behind its host's.
func (l *Listener) admit(c net.Conn) {
	if drop, full := l.admitLocked(c, hostOf(c)); drop != nil {
		_ = drop.Close()
		if full {
			l.log.Debug("connection closed: too many wait for a handshake slot", "remote", drop.RemoteAddr().String(), "queued", l.hosts.maxQueued)
		}
	}
}

// admitLocked is admit under the share-out's lock; it returns a connection
// to close, and whether the queues were full.
func (l *Listener) admitLocked(c net.Conn, host netip.Prefix) (drop net.Conn, full bool) {
	hs := l.hosts
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if hs.shut {
		return c, false
	}
	h := hs.hosts[host]
	if h == nil {
		h = &hostSlots{host: host}
		hs.hosts[host] = h
	}
	if len(h.queued) == 0 && h.serving < hs.perHost && l.takeSlot() {
		l.serveLocked(h, c)
		return nil, false
	}
	if hs.queued >= hs.maxQueued {
		var longest *hostSlots
		if hs.most > 0 {
			longest = hs.byLen[hs.most].Back().Value.(*hostSlots)
		}
		if longest == nil || len(longest.queued) <= len(h.queued) {
			hs.forgetIfIdle(h)
			return c, true // no queue at all, or its own is as long as any
		}
		last := len(longest.queued) - 1
		drop = longest.queued[last]
		longest.queued[last] = nil
		hs.resize(longest, longest.queued[:last])
	}
	hs.resize(h, append(h.queued, c))
	return drop, drop != nil
}

// takeSlot takes a handshake slot if one is free.
func (l *Listener) takeSlot() bool {
	select {
	case l.handshakes <- struct{}{}:
		return true
	default:
		return false
	}
}

// serveLocked serves c of h in a handshake slot taken for it.
func (l *Listener) serveLocked(h *hostSlots, c net.Conn) {
	l.hosts.setServing(h, h.serving+1)
	if l.hosts.serve != nil {
		l.hosts.serve(c, h.host)
		return
	}
	l.wg.Add(1) // by acceptTCP or a serveTCP, both in the group
	go l.serveTCP(c, h.host)
}

// release ends the service of one of host's connections before its
// handshake ended: its slot goes to the next connection of the waiting host
// that holds the fewest, or back.
func (l *Listener) release(host netip.Prefix) {
	hs := l.hosts
	hs.mu.Lock()
	defer hs.mu.Unlock()
	h := hs.hosts[host]
	hs.setServing(h, h.serving-1)
	hs.forgetIfIdle(h)
	var next *hostSlots
	for _, r := range hs.ready {
		if e := r.Front(); e != nil {
			next = e.Value.(*hostSlots)
			break
		}
	}
	if next == nil {
		<-l.handshakes // ours: never waits
		return
	}
	c := next.queued[0]
	l.serveLocked(next, c) // counted before resize looks whether the host is idle
	next.queued[0] = nil
	hs.resize(next, next.queued[1:])
}

// resize sets h's queue to q, one longer or shorter than it was, and keeps
// the indexes.
func (hs *hostShares) resize(h *hostSlots, q []net.Conn) {
	hs.queued += len(q) - len(h.queued)
	if h.inLen != nil {
		hs.byLen[len(h.queued)].Remove(h.inLen)
		if hs.byLen[len(h.queued)].Len() == 0 {
			delete(hs.byLen, len(h.queued))
		}
		h.inLen = nil
	}
	if len(q) == 0 {
		q = nil
	}
	h.queued = q
	if n := len(q); n > 0 {
		if hs.byLen[n] == nil {
			hs.byLen[n] = list.New()
		}
		h.inLen = hs.byLen[n].PushBack(h)
		hs.most = max(hs.most, n)
	}
	for hs.most > 0 && hs.byLen[hs.most] == nil {
		hs.most--
	}
	hs.relink(h)
	hs.forgetIfIdle(h)
}

// setServing sets how many connections h is served, and keeps the indexes.
func (hs *hostShares) setServing(h *hostSlots, n int) {
	h.serving = n
	hs.relink(h)
}

// relink files h in ready by what it is served, if it waits and may be
// served more.
func (hs *hostShares) relink(h *hostSlots) {
	want := -1
	if len(h.queued) > 0 && h.serving < hs.perHost {
		want = h.serving
	}
	if h.inReady != nil && h.readyAt == want {
		return
	}
	if h.inReady != nil {
		hs.ready[h.readyAt].Remove(h.inReady)
		h.inReady = nil
	}
	if want >= 0 {
		h.inReady, h.readyAt = hs.ready[want].PushBack(h), want
	}
}

func (hs *hostShares) forgetIfIdle(h *hostSlots) {
	if h.serving == 0 && len(h.queued) == 0 {
		delete(hs.hosts, h.host)
	}
}

// shutHosts closes the queued connections; no more are queued.
func (l *Listener) shutHosts() {
	hs := l.hosts
	hs.mu.Lock()
	var drop []net.Conn
	hs.shut = true
	for _, h := range hs.hosts {
		drop = append(drop, h.queued...)
		hs.resize(h, nil)
	}
	hs.mu.Unlock()
	for _, c := range drop {
		_ = c.Close()
	}
}

// hostConns counts the connections a listener keeps from each remote host
// (WithHostSessions): sessions from their handshake until released, plain
// gRPC connections until closed.
type hostConns struct {
	max int
	mu  sync.Mutex
	n   map[netip.Prefix]int
}

// take counts one more connection of host, or reports that host holds max.
func (hc *hostConns) take(host netip.Prefix) bool {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	if hc.n[host] >= hc.max {
		return false
	}
	if hc.n == nil {
		hc.n = map[netip.Prefix]int{}
	}
	hc.n[host]++
	return true
}

// give uncounts a connection of host that take counted.
func (hc *hostConns) give(host netip.Prefix) {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	if hc.n[host]--; hc.n[host] <= 0 {
		delete(hc.n, host)
	}
}

// held returns the connections counted for host.
func (hc *hostConns) held(host netip.Prefix) int {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	return hc.n[host]
}

// countedConn is a plain client's connection counted for its host until
// its first Close.
type countedConn struct {
	*replayConn
	once sync.Once
	give func()
}

func (c *countedConn) Close() error {
	c.once.Do(c.give)
	return c.replayConn.Close()
}
