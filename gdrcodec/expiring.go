package gdrcodec

import (
	"sync"
	"sync/atomic"
	"time"
)

// expiring maps messages to what the codec noted about them until a later
// hook takes it. Entries nobody takes (the hook never ran for that message)
// are dropped once older than maxAge, by a sweep that a put runs at most once
// a minute, and given to expired, if set, as are entries a put replaces.
type expiring[V any] struct {
	maxAge  time.Duration
	expired func(V)      // what to do with an entry nobody took; nil: nothing
	n       atomic.Int64 // len(m), read without mu
	mu      sync.Mutex
	m       map[any]expiringEntry[V]
	swept   time.Time
}

type expiringEntry[V any] struct {
	v  V
	at time.Time
}

func newExpiring[V any](maxAge time.Duration) *expiring[V] {
	return &expiring[V]{maxAge: maxAge, m: map[any]expiringEntry[V]{}}
}

// put notes v for k.
func (e *expiring[V]) put(k any, v V) { e.store(k, v, true) }

// putNew notes v for k unless something is noted for k already (the same
// message sent on two calls at once: the first keeps its note), and reports
// whether it did.
func (e *expiring[V]) putNew(k any, v V) bool { return e.store(k, v, false) }

func (e *expiring[V]) store(k any, v V, replace bool) bool {
	now := time.Now()
	var old []V
	defer func() {
		for _, v := range old {
			e.expired(v)
		}
	}()
	e.mu.Lock()
	defer e.mu.Unlock()
	if en, ok := e.m[k]; ok {
		if !replace && now.Sub(en.at) <= e.maxAge {
			return false
		}
		if e.expired != nil {
			old = append(old, en.v) // replaced: nobody takes it now
		}
	}
	e.m[k] = expiringEntry[V]{v: v, at: now}
	defer func() { e.n.Store(int64(len(e.m))) }()
	if now.Sub(e.swept) < time.Minute {
		return true
	}
	e.swept = now
	for key, en := range e.m {
		if now.Sub(en.at) > e.maxAge {
			delete(e.m, key)
			if e.expired != nil {
				old = append(old, en.v)
			}
		}
	}
	return true
}

// take removes and returns what was noted for k.
func (e *expiring[V]) take(k any) (V, bool) { return e.takeUnless(k, nil) }

// takeUnless returns what was noted for k, and removes it unless keep (if
// not nil) says to leave it for later takes.
func (e *expiring[V]) takeUnless(k any, keep func(V) bool) (V, bool) {
	var zero V
	if e.n.Load() == 0 {
		return zero, false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	en, ok := e.m[k]
	if !ok {
		return zero, false
	}
	if keep == nil || !keep(en.v) {
		delete(e.m, k)
		e.n.Store(int64(len(e.m)))
	}
	return en.v, true
}
