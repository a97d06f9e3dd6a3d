package transport

import "sync"

// The process-wide registry: peer process id -> live sessions. A session
// enters when its handshake completes and leaves when it closes, for any
// reason, before its Done channel is closed.
var registry = struct {
	sync.Mutex
	m map[ID][]*Session
}{m: map[ID][]*Session{}}

func registryAdd(s *Session) {
	registry.Lock()
	defer registry.Unlock()
	registry.m[s.peer.ID] = append(registry.m[s.peer.ID], s)
}

func registryRemove(s *Session) {
	registry.Lock()
	defer registry.Unlock()
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
