package transport

import (
	"net"
	"net/netip"
	"slices"
	"sync"
)

// A listener shares its handshake slots (maxHandshakes) out between remote
// hosts, so that one host's connections that never finish their handshake
// cannot keep the other hosts' clients waiting: a host is served at most
// maxHandshakesPerHost connections at once, its others wait in its queue,
// and a slot that frees goes to the waiting host that holds the fewest. The
// queues hold at most maxQueued connections in all; past that, the host
// with the longest queue loses its newest connection. An honest client's
// handshake lasts a round trip or two (a session's lanes take a slot each),
// so a burst of them from one host waits its turn rather than failing.
// Variables for tests.
var (
	maxHandshakesPerHost = 64
	maxQueued            = 4096
)

// hostShares is the share-out; the Listener's methods below use it.
type hostShares struct {
	mu      sync.Mutex
	hosts   map[netip.Prefix]*hostSlots // hosts being served or waiting
	waiting []netip.Prefix              // hosts with connections queued, in the order their queues began
	queued  int                         // connections queued, all hosts
	shut    bool                        // the listener closed: queue no more
}

// hostSlots is what a remote host holds of a listener's handshakes.
type hostSlots struct {
	serving int        // its connections served before their handshake ends
	queued  []net.Conn // its connections waiting for a slot, oldest first
}

// hostOf returns the remote host of c, as the share-out counts them: an
// IPv4 address, an IPv6 /64 (a host may take any address of its /64).
func hostOf(c net.Conn) netip.Prefix {
	ta, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return netip.Prefix{}
	}
	ip := ta.AddrPort().Addr().Unmap().WithZone("")
	bits := 32
	if ip.Is6() {
		bits = 64
	}
	p, _ := ip.Prefix(bits)
	return p
}

// admit serves a connection just accepted, or queues it behind its host's.
func (l *Listener) admit(c net.Conn) {
	host := hostOf(c)
	if drop, full := l.admitLocked(c, host); drop != nil {
		_ = drop.Close()
		if full {
			l.log.Debug("connection closed: too many wait for a handshake slot", "remote", drop.RemoteAddr().String(), "queued", maxQueued)
		}
	}
}

// admitLocked is admit under the share-out's lock; it returns a connection
// to close, and whether the queues were full.
func (l *Listener) admitLocked(c net.Conn, host netip.Prefix) (drop net.Conn, full bool) {
	hs := &l.hosts
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if hs.shut {
		return c, false
	}
	h := hs.hosts[host]
	if h == nil {
		h = &hostSlots{}
		hs.hosts[host] = h
	}
	if len(h.queued) == 0 && h.serving < maxHandshakesPerHost && l.takeSlot() {
		l.serveLocked(h, c, host)
		return nil, false
	}
	if hs.queued >= maxQueued {
		longest := host
		for _, w := range hs.waiting {
			if len(hs.hosts[w].queued) > len(hs.hosts[longest].queued) {
				longest = w
			}
		}
		if longest == host {
			hs.forgetIfIdle(host, h)
			return c, true
		}
		lh := hs.hosts[longest]
		drop = lh.queued[len(lh.queued)-1]
		lh.queued = lh.queued[:len(lh.queued)-1]
		hs.dequeued(longest, lh)
	}
	if len(h.queued) == 0 {
		hs.waiting = append(hs.waiting, host)
	}
	h.queued = append(h.queued, c)
	hs.queued++
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

// serveLocked serves c of host h in a handshake slot taken for it.
func (l *Listener) serveLocked(h *hostSlots, c net.Conn, host netip.Prefix) {
	h.serving++
	l.wg.Add(1) // by acceptTCP or a serveTCP, both in the group
	go l.serveTCP(c, host)
}

// release ends the service of one of host's connections before its
// handshake ended: its slot goes to the next connection of the waiting host
// that holds the fewest, or back.
func (l *Listener) release(host netip.Prefix) {
	hs := &l.hosts
	hs.mu.Lock()
	defer hs.mu.Unlock()
	h := hs.hosts[host]
	h.serving--
	hs.forgetIfIdle(host, h)
	next := -1
	for i, w := range hs.waiting {
		if wh := hs.hosts[w]; wh.serving < maxHandshakesPerHost && (next < 0 || wh.serving < hs.hosts[hs.waiting[next]].serving) {
			next = i
		}
	}
	if next < 0 || hs.shut {
		<-l.handshakes // ours: never waits
		return
	}
	nh := hs.waiting[next]
	w := hs.hosts[nh]
	c := w.queued[0]
	w.queued[0] = nil
	w.queued = w.queued[1:]
	l.serveLocked(w, c, nh) // counted before dequeued looks whether the host is idle
	hs.dequeued(nh, w)
}

// dequeued notes that one of host's queued connections left the queue.
func (hs *hostShares) dequeued(host netip.Prefix, h *hostSlots) {
	hs.queued--
	if len(h.queued) == 0 {
		h.queued = nil
		if i := slices.Index(hs.waiting, host); i >= 0 {
			hs.waiting = slices.Delete(hs.waiting, i, i+1)
		}
		hs.forgetIfIdle(host, h)
	}
}

func (hs *hostShares) forgetIfIdle(host netip.Prefix, h *hostSlots) {
	if h.serving == 0 && len(h.queued) == 0 {
		delete(hs.hosts, host)
	}
}

// shutHosts closes the queued connections; no more are queued.
func (l *Listener) shutHosts() {
	hs := &l.hosts
	hs.mu.Lock()
	var drop []net.Conn
	hs.shut = true
	for _, host := range hs.waiting {
		h := hs.hosts[host]
		drop = append(drop, h.queued...)
		h.queued = nil
		hs.forgetIfIdle(host, h)
	}
	hs.waiting, hs.queued = nil, 0
	hs.mu.Unlock()
	for _, c := range drop {
		_ = c.Close()
	}
}
