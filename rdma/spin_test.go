package rdma

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// miss feeds p a miss: a whole spin in vain, then work soon after the park.
func miss(p *spinPolicy, now time.Time) { p.woke(p.max/2, now) }

func TestSpinPolicyYieldsAfterMisses(t *testing.T) {
	p := spinPolicy{max: time.Millisecond}
	t0 := time.Unix(1000, 0)
	for i := range missLimit - 1 {
		miss(&p, t0)
		require.False(t, p.yielding(0), "after %d misses", i+1)
	}
	// A park that waited longer than a peer's spin is no miss: the count
	// starts again.
	p.woke(p.max+quickWake, t0)
	for range missLimit - 1 {
		miss(&p, t0)
	}
	require.False(t, p.yielding(0))
	miss(&p, t0)
	require.True(t, p.yielding(0), "after %d misses in a row", missLimit)
	require.True(t, p.yielding(p.max-1), "for the whole spin")

	// While it yields, what it catches does not end it: yielding let the
	// sender run.
	p.caught(0)
	require.True(t, p.yielding(0))
	p.woke(0, t0) // nor do misses count
	require.True(t, p.yield)
}

func TestSpinPolicyProbes(t *testing.T) {
	p := spinPolicy{max: time.Millisecond}
	t0 := time.Unix(1000, 0)
	for range missLimit {
		miss(&p, t0)
	}
	require.True(t, p.yielding(0))

	// No probe before probeInterval has passed.
	p.worked(t0.Add(probeInterval - 1))
	require.True(t, p.yielding(0))

	// Then the spin after the next work polls without yielding, for at most
	// quickWake; a probe that caught nothing ends, and yielding goes on.
	p.worked(t0.Add(probeInterval))
	require.False(t, p.yielding(0), "probe")
	require.False(t, p.yielding(quickWake-1), "probe")
	p.worked(t0.Add(probeInterval + time.Microsecond)) // more work in the probe's spin
	require.False(t, p.yielding(quickWake-1), "the probe goes on")
	require.True(t, p.yielding(quickWake), "the probe's time is up")
	p.worked(t0.Add(probeInterval + quickWake))
	require.True(t, p.yielding(0), "no second probe within probeInterval")

	// A probe that catches work ends the yielding, and the misses start
	// from nothing.
	p.worked(t0.Add(2*probeInterval + quickWake))
	require.False(t, p.yielding(0))
	p.caught(quickWake - 1)
	require.False(t, p.yield)
	require.Zero(t, p.misses)
	for range missLimit - 1 {
		miss(&p, t0)
	}
	require.False(t, p.yielding(0))
}

// Any catch starts the misses again: a peer on another core that is slow
// now and then never adds up to missLimit.
func TestSpinPolicyCatchResetsMisses(t *testing.T) {
	p := spinPolicy{max: time.Millisecond}
	t0 := time.Unix(1000, 0)
	for range 10 {
		for range missLimit - 1 {
			miss(&p, t0)
		}
		p.caught(p.max - 1)
	}
	require.False(t, p.yielding(0))
}

func TestSpinPolicySlowCatchKeepsYielding(t *testing.T) {
	p := spinPolicy{max: time.Millisecond}
	t0 := time.Unix(1000, 0)
	for range missLimit {
		miss(&p, t0)
	}
	p.worked(t0.Add(probeInterval))
	require.False(t, p.yielding(0), "probe")
	p.caught(quickWake) // the probe's catch came, but not quickly
	require.True(t, p.yield)
	p.parking()
	require.True(t, p.yielding(0))
}

// A poll time shorter than quickWake bounds a probe too, and a park ends
// one: the driver does not stay in a probe that never yields.
func TestSpinPolicyShortPollTimeProbe(t *testing.T) {
	p := spinPolicy{max: 50 * time.Microsecond}
	t0 := time.Unix(1000, 0)
	for range missLimit {
		miss(&p, t0)
	}
	require.True(t, p.yielding(0))
	p.worked(t0.Add(probeInterval))
	require.False(t, p.yielding(p.max-1), "probe")
	require.True(t, p.yielding(p.max), "the probe ends with the poll time")

	p.worked(t0.Add(2 * probeInterval))
	require.False(t, p.yielding(0), "probe")
	p.parking() // no catch before the park
	require.True(t, p.yielding(0))
}

// Without a poll time the driver polls only for requests in flight: no
// miss counts.
func TestSpinPolicyNoPollTime(t *testing.T) {
	p := spinPolicy{}
	for range 2 * missLimit {
		p.woke(0, time.Unix(1000, 0))
	}
	require.False(t, p.yielding(0))
}
