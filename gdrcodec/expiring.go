package gdrcodec

import (
	"sync"
	"sync/atomic"
	"time"
)

// expiring maps messages to what the codec noted about them until a later
// hook takes it. Entries nobody takes (the hook never ran for that message)
// are dropped once older than maxAge, by a sweep that runs every maxAge
// while the map holds any (so at most 2*maxAge after their put, with puts
// or without), and given to expired, if set, as are entries a put replaces.
// An entry may hold a decoded message and the buffers attached to it,
// which an idle process must let go of too.
type expiring[V any] struct {
	maxAge  time.Duration
	expired func(V)      // what to do with an entry nobody took; nil: nothing
	n       atomic.Int64 // len(m), read without mu
	mu      sync.Mutex
	m       map[any]expiringEntry[V]
	sweeper *time.Timer // armed while m holds entries; nil while it is empty
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
	e.mu.Lock()
	en, had := e.m[k]
	if had && !replace && now.Sub(en.at) <= e.maxAge {
		e.mu.Unlock()
		return false
	}
	e.m[k] = expiringEntry[V]{v: v, at: now}
	e.n.Store(int64(len(e.m)))
	if e.sweeper == nil {
		e.sweeper = time.AfterFunc(e.maxAge, e.sweep)
	}
	e.mu.Unlock()
	if had && e.expired != nil {
		e.expired(en.v) // replaced: nobody takes it now
	}
	return true
}

// sweep drops the entries older than maxAge, giving them to expired, and
// runs again after maxAge while entries are left.
func (e *expiring[V]) sweep() {
	now := time.Now()
	var old []V
	e.mu.Lock()
	for key, en := range e.m {
		if now.Sub(en.at) > e.maxAge {
			delete(e.m, key)
			old = append(old, en.v)
		}
	}
	e.n.Store(int64(len(e.m)))
	if len(e.m) > 0 {
		e.sweeper.Reset(e.maxAge)
	} else {
		e.sweeper = nil
	}
	e.mu.Unlock()
	if e.expired != nil {
		for _, v := range old {
			e.expired(v)
		}
	}
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
