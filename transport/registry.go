package transport

import (
	"crypto/sha256"
	"sync"
)

// The process-wide registry: peer process id -> live sessions. A session
// enters when its handshake completes and leaves when it closes, for any
// reason, before its Done channel is closed.
//
// It also counts the live sessions by handshake digest. Both ends of a
// session to this very process hold the same digest, and no two other
// sessions do: each side's nonce in it is fresh (identity.go). So a digest
// held twice names a session whose peer is this process (PeerInProcess).
var registry = struct {
	sync.Mutex
	m          map[ID][]*Session
	handshakes map[[sha256.Size]byte]int
}{m: map[ID][]*Session{}, handshakes: map[[sha256.Size]byte]int{}}

func registryAdd(s *Session) {
	registry.Lock()
	defer registry.Unlock()
	registry.m[s.peer.ID] = append(registry.m[s.peer.ID], s)
	registry.handshakes[s.handshake]++
}

func registryRemove(s *Session) {
	registry.Lock()
	defer registry.Unlock()
	if n := registry.handshakes[s.handshake]; n > 1 {
		registry.handshakes[s.handshake] = n - 1
	} else {
		delete(registry.handshakes, s.handshake)
	}
	l := registry.m[s.peer.ID]
	for i, x := range l {
		if x == s {
			l = append(l[:i:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(registry.m, s.peer.ID)
	} else {
		registry.m[s.peer.ID] = l
	}
}

// PeerInProcess reports whether s's peer is this very process: the other end
// of s is a session of this process, whatever identity each end has. Each end
// enters the registry before it sends or reads anything over the session, so
// what arrives over s finds the answer settled; once true it stays true. A
// peer in another process can make it true by no message: the digest holds a
// nonce of this process's, fresh for s.
func (s *Session) PeerInProcess() bool {
	if s.inProcess.Load() {
		return true
	}
	registry.Lock()
	in := registry.handshakes[s.handshake] > 1
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
