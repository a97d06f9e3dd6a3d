package rdma

import "time"

// Thresholds of spinPolicy.
const (
	quickWake     = 200 * time.Microsecond // work this soon after the last is a quick one
	missLimit     = 3                      // misses in a row that make the driver yield
	probeInterval = 10 * time.Millisecond  // least time between two probes while it yields
)

// spinPolicy decides how a worker's driver polls before it parks (lock-only
// state of the worker).
//
// Polling catches a message without a thread wake-up, but only while the
// sender runs elsewhere. A driver whose peer shares its core (the kernel put
// both processes on one, as it does beside a busy process on a small host)
// keeps the peer from running for as long as it polls: the message comes
// only once the driver parks, and every message costs a whole poll time. So
// the driver watches what its polling catches:
//   - a miss: it polled the whole poll time in vain, parked, and the work came
//     within about a poll time after that (the time a peer polling on the same
//     core takes to give it up);
//   - a catch: polling found data, so the sender ran meanwhile; a quick one
//     came within quickWake of the last work.
//
// After missLimit misses with no catch between them the driver yields its
// core to the kernel between polling rounds (sched_yield), which runs a peer
// waiting on that core at once. Yielding is no good where the core's other
// thread is an unrelated busy one (it takes the core for a whole time
// slice), so every probeInterval the driver probes: it polls without
// yielding for at most quickWake (or the poll time, if shorter) after the
// next work, and a quick catch ends the yielding.
type spinPolicy struct {
	max       time.Duration // the configured poll time
	yield     bool          // yield between polling rounds
	misses    int           // misses in a row
	probe     bool          // the spin after the last work is a probe
	lastProbe time.Time
}

// yielding reports whether a polling round that comes idle after the last
// work yields the core; it ends a probe that has run its time.
func (p *spinPolicy) yielding(idle time.Duration) bool {
	if p.probe && idle >= min(quickWake, p.max) {
		p.probe = false
	}
	return p.yield && !p.probe
}

// parking notes a park: a probe still running has caught nothing.
func (p *spinPolicy) parking() { p.probe = false }

// worked notes work at now: the next spin may be a probe.
func (p *spinPolicy) worked(now time.Time) {
	if p.yield && !p.probe && now.Sub(p.lastProbe) >= probeInterval {
		p.probe, p.lastProbe = true, now
	}
}

// caught notes data found by a polling round that did not yield, the given
// time after the last work. Any such data shows the sender running while the
// driver polled: the misses start again. A quick catch also ends yielding.
func (p *spinPolicy) caught(after time.Duration) {
	if p.yield && !p.probe {
		return // polling that yields catches what it lets run
	}
	p.misses = 0
	if after < quickWake {
		p.yield, p.probe = false, false
	}
}

// woke notes work that came waited after the driver parked, after it had
// polled the whole poll time in vain.
func (p *spinPolicy) woke(waited time.Duration, now time.Time) {
	if p.yield || p.max == 0 {
		return // no poll time: it only polls for requests in flight
	}
	if waited >= p.max+quickWake {
		p.misses = 0
		return
	}
	p.misses++
	if p.misses >= missLimit {
		p.yield, p.probe, p.lastProbe = true, false, now
	}
}
