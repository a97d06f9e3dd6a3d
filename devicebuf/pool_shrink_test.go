package devicebuf_test

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// squat allocates one block of each size and releases it, as a receiver does for transfers
// that were refused: the regions made for them have no block handed out afterwards.
func squat(tb testing.TB, p *devicebuf.Pool, sizes ...int) {
	tb.Helper()
	for _, n := range sizes {
		b, err := p.Alloc(n)
		require.NoError(tb, err)
		require.NoError(tb, b.Release())
	}
}

// Regions left with no block handed out (refused or aborted transfers) are freed once idle
// for IdleTimeout, and at once when another class needs their room; a region with a block
// out stays.
func TestPoolShrinks(t *testing.T) {
	base := devicebuf.Live()
	clock := devicebuftest.NewClock()
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: reg, MaxBytes: 64 << 20, IdleTimeout: 30 * time.Second, Clock: clock})
	require.NoError(t, err)
	squatted := []int{32 << 20, 16 << 20, 8 << 20, 4 << 20, 2 << 20} // regions of 32+16+8+4+4 MiB
	squat(t, p, squatted...)
	st := p.Stats()
	require.Equal(t, 5, st.Regions)
	require.Equal(t, int64(64<<20), st.RegionBytes, "the squatter filled MaxBytes")

	// Idle for less than IdleTimeout: kept for reuse.
	clock.Advance(29 * time.Second)
	require.Equal(t, 5, p.Stats().Regions)
	squat(t, p, 2<<20) // reuses its region, which is idle again from now
	clock.Advance(time.Second)
	st = p.Stats()
	require.Equal(t, 1, st.Regions, "only the region used a second ago stays")
	require.Equal(t, int64(4<<20), st.RegionBytes)
	require.Equal(t, int64(4), st.Freed)
	clock.Advance(29 * time.Second)
	st = p.Stats()
	require.Zero(t, st.Regions)
	require.Zero(t, st.RegionBytes)
	require.Equal(t, int64(5), st.Freed)
	live, made := reg.counts()
	require.Zero(t, live, "every freed region deregistered")
	require.Equal(t, 5, made)
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base), "freed regions leave no live memory")

	// Squatted again, the pool serves a later call of another class at once by freeing the
	// idle regions.
	squat(t, p, squatted...)
	big, err := p.Alloc(64 << 20)
	require.NoError(t, err)
	st = p.Stats()
	require.Equal(t, 1, st.Regions)
	require.Equal(t, int64(64<<20), st.RegionBytes)
	require.Equal(t, int64(10), st.Freed)
	require.Zero(t, st.Exhausted)
	require.NoError(t, big.Release())

	// A block out keeps its region however long; released, the region goes in time.
	held, err := p.Alloc(1 << 20) // no room for a 1 MiB class region: the free 64 MiB block
	require.NoError(t, err)
	clock.Advance(time.Hour)
	st = p.Stats()
	require.Equal(t, 1, st.Regions, "the region with a block out stays")
	require.NoError(t, held.Release())
	clock.Advance(30 * time.Second)
	require.Zero(t, p.Stats().Regions)
	require.NoError(t, p.Close())
	live, _ = reg.counts()
	require.Zero(t, live)
	requireLive(t, base)
}

// Making room for another class frees the regions idle longest, and only as many as needed.
func TestPoolReclaimsLongestIdleFirst(t *testing.T) {
	base := devicebuf.Live()
	clock := devicebuftest.NewClock()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 12 << 20, Clock: clock})
	require.NoError(t, err)
	for _, n := range []int{4 << 20, 2 << 20, 1 << 20} { // a 4 MiB region each, a second apart
		squat(t, p, n)
		clock.Advance(time.Second)
	}
	b, err := p.Alloc(8 << 20) // needs 8 MiB: the 4 MiB and 2 MiB classes' regions go
	require.NoError(t, err)
	st := p.Stats()
	require.Equal(t, 2, st.Regions)
	require.Equal(t, int64(12<<20), st.RegionBytes)
	require.Equal(t, int64(2), st.Freed)
	c, err := p.Alloc(1 << 20) // the youngest region stayed
	require.NoError(t, err)
	require.Equal(t, int64(1), p.Stats().Hits)
	require.Equal(t, int64(4), p.Stats().Misses)
	require.NoError(t, c.Release())
	require.NoError(t, b.Release())
	require.NoError(t, p.Close())
	requireLive(t, base)
}

// A burst of concurrent allocations grows the pool by what it asks for: each class grows one
// region at a time and the callers waiting for it take its blocks, so none is refused while
// MaxBytes leaves room, and exactly the calls beyond it are.
func TestPoolBurst(t *testing.T) {
	const callers = 64 // of 1 MiB each: four to a 4 MiB region
	for _, tt := range []struct {
		name     string
		maxBytes int64
		regions  int
		refused  int
	}{
		{name: "room for all", maxBytes: 64 << 20, regions: 16, refused: 0},
		{name: "room for three quarters", maxBytes: 48 << 20, regions: 12, refused: 16},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base := devicebuf.Live()
			host := devicebuf.NewHostAllocator()
			var making atomic.Int64 // callers inside the region source
			gate := make(chan struct{})
			p, err := devicebuf.NewPool(devicebuf.PoolConfig{
				MaxBytes: tt.maxBytes,
				Regions: func(n int) (*devicebuf.Buffer, error) {
					making.Add(1)
					<-gate
					return host.Alloc(n)
				},
			})
			require.NoError(t, err)
			var refused atomic.Int64
			bufs := make(chan *devicebuf.Buffer, callers)
			errs := make(chan error, callers)
			var wg sync.WaitGroup
			for range callers {
				wg.Go(func() {
					b, err := p.Alloc(1 << 20)
					switch {
					case errors.Is(err, devicebuf.ErrExhausted):
						refused.Add(1)
					case err != nil:
						errs <- err
					default:
						bufs <- b
					}
				})
			}
			// Hold the first region back until every caller is either making a region,
			// waiting for one, or refused: the burst is all in at once.
			require.Eventually(t, func() bool {
				return making.Load()+p.Stats().Waits+refused.Load() == callers
			}, 10*time.Second, time.Millisecond)
			close(gate)
			wg.Wait()
			close(bufs)
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			st := p.Stats()
			require.Equal(t, int64(tt.refused), refused.Load(), "refused")
			require.Equal(t, callers-tt.refused, st.InUse)
			require.Equal(t, tt.regions, st.Regions)
			require.Equal(t, int64(tt.regions)<<22, st.RegionBytes, "regions bounded by demand")
			require.Equal(t, int64(tt.regions), st.Misses)
			require.Equal(t, int64(callers-tt.refused-tt.regions), st.Hits)
			require.Equal(t, int64(tt.refused), st.Exhausted)
			for b := range bufs {
				require.NoError(t, b.Release())
			}
			require.NoError(t, p.Close())
			requireLive(t, base)
		})
	}
}
