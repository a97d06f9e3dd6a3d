package devicebuftest

import (
	"sync"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
)

// Clock is a devicebuf.Clock that moves only when Advance is called, for tests of a pool's
// idle trimming; functions that come due run in Advance's goroutine.
type Clock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*clockTimer
}

type clockTimer struct {
	at   time.Time
	f    func()
	done bool // ran or stopped
}

var _ devicebuf.Clock = (*Clock)(nil)

// NewClock returns a Clock set at an arbitrary fixed time.
func NewClock() *Clock { return &Clock{now: time.Unix(1_000_000, 0)} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// AfterFunc arranges for f to run in the Advance call that takes the clock d past now.
func (c *Clock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &clockTimer{at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		stopped := !t.done
		t.done = true
		return stopped
	}
}

// Advance moves the clock on by d and runs the functions that came due, earliest first,
// including those they schedule within the new time.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
	for {
		c.mu.Lock()
		var due *clockTimer
		for _, t := range c.timers {
			if !t.done && !t.at.After(c.now) && (due == nil || t.at.Before(due.at)) {
				due = t
			}
		}
		if due != nil {
			due.done = true
		}
		c.timers = withoutDone(c.timers)
		c.mu.Unlock()
		if due == nil {
			return
		}
		due.f()
	}
}

func withoutDone(ts []*clockTimer) []*clockTimer {
	out := ts[:0]
	for _, t := range ts {
		if !t.done {
			out = append(out, t)
		}
	}
	clear(ts[len(out):])
	return out
}
