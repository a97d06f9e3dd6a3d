package transport

import (
	"crypto/sha256"
	"sync"
)

// The process-wide registry: peer process id -> live sessions. A session
// enters when its handshake completes and leaves when it closes, for any
// reason, before its Done channel is closed.
//
// It also files the live sessions by handshake digest, for PeerInProcess.
var registry = struct {
	sync.Mutex
	m          map[ID][]*Session
	handshakes map[[sha256.Size]byte][]*Session
}{m: map[ID][]*Session{}, handshakes: map[[sha256.Size]byte][]*Session{}}

func registryAdd(s *Session) {
	registry.Lock()
	defer registry.Unlock()
	registry.m[s.peer.ID] = append(registry.m[s.peer.ID], s)
	registry.handshakes[s.handshake] = append(registry.handshakes[s.handshake], s)
}

func registryRemove(s *Session) {
	registry.Lock()
	defer registry.Unlock()
	if l := removeSession(registry.handshakes[s.handshake], s); len(l) == 0 {
		delete(registry.handshakes, s.handshake)
	} else {
		registry.handshakes[s.handshake] = l
	}
	if l := removeSession(registry.m[s.peer.ID], s); len(l) == 0 {
		delete(registry.m, s.peer.ID)
	} else {
		registry.m[s.peer.ID] = l
	}
}

// removeSession returns l without s, in a new array (l stays as it was).
func removeSession(l []*Session, s *Session) []*Session {
	for i, x := range l {
		if x == s {
			return append(l[:i:i], l[i+1:]...)
		}
	}
	return l
}

// PeerInProcess reports whether s's peer is this very process: the other end
// of s is a live session of this process, whatever identity each end has.
// That end holds the same handshake digest, which carries a fresh nonce of
// each side, and ran its handshake over the same connection: each end's
// local address is the other's remote one. A peer that relays this process's
// own handshake to its own listener gives two sessions one digest, over two
// connections that do not mirror each other. Each end enters the registry
// before the engine sends or reads a control message over it, so what
// arrives over s finds the answer settled; once true it stays true.
func (s *Session) PeerInProcess() bool {
	if s.inProcess.Load() {
		return true
	}
	registry.Lock()
	in := false
	for _, o := range registry.handshakes[s.handshake] {
		if o != s && o.client != s.client && o.boot == [2]string{s.boot[1], s.boot[0]} {
			in = true
		}
	}
	registry.Unlock()
	if in {
		s.inProcess.Store(true)
	}
	return in
}

// SessionsTo returns the live sessions to the peer process id, oldest first.
// Sessions over UCX come before the others.
func SessionsTo(id ID) []*Session {
	registry.Lock()
	l := registry.m[id]
	out := make([]*Session, 0, len(l))
	for _, s := range l {
		if s.ep != nil {
			out = append(out, s)
		}
	}
	for _, s := range l {
		if s.ep == nil {
			out = append(out, s)
		}
	}
	registry.Unlock()
	return out
}

// Stats is a snapshot of this process's sessions, for diagnostics and leak
// checks.
type Stats struct {
	Sessions int // live sessions, in the registry
}

// ReadStats returns the current Stats.
func ReadStats() Stats { return Stats{Sessions: numSessions()} }

func numSessions() int {
	registry.Lock()
	defer registry.Unlock()
	n := 0
	for _, l := range registry.m {
		n += len(l)
	}
	return n
}
