package devicebuf_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// countingRegistrar records registrations and checks every one is released exactly once.
type countingRegistrar struct {
	mu       sync.Mutex
	live     map[uintptr]int
	made     int
	kinds    []devicebuf.Kind
	devices  []int
	failNext error
}

type testReg struct{ ptr uintptr }

func newRegistrar() *countingRegistrar { return &countingRegistrar{live: map[uintptr]int{}} }

func (r *countingRegistrar) Register(ptr uintptr, n int, kind devicebuf.Kind, device int) (any, func() error, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.failNext; err != nil {
		r.failNext = nil
		return nil, nil, err
	}
	if _, ok := r.live[ptr]; ok {
		return nil, nil, fmt.Errorf("%#x registered twice", ptr)
	}
	r.live[ptr] = n
	r.made++
	r.kinds = append(r.kinds, kind)
	r.devices = append(r.devices, device)
	return &testReg{ptr}, func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		if _, ok := r.live[ptr]; !ok {
			return fmt.Errorf("%#x deregistered twice", ptr)
		}
		delete(r.live, ptr)
		return nil
	}, nil
}

func (r *countingRegistrar) counts() (live, made int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.live), r.made
}

func TestPoolReuseWithoutReregistration(t *testing.T) {
	base := devicebuf.Live()
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: reg, RegionBytes: 64 << 10, MaxBytes: 1 << 20})
	require.NoError(t, err)
	require.Equal(t, devicebuf.Host, p.Kind())
	require.Equal(t, -1, p.Device())

	b, err := p.Alloc(5000) // class 8 KiB: one 64 KiB region of 8 blocks
	require.NoError(t, err)
	require.Equal(t, 5000, b.Len())
	root, off := b.Root()
	require.Equal(t, 64<<10, root.Len())
	require.Equal(t, b.Ptr(), root.Ptr()+uintptr(off))
	r, ok := b.Registration().(*testReg)
	require.True(t, ok)
	require.Equal(t, root.Ptr(), r.ptr)
	hb, err := b.HostBytes()
	require.NoError(t, err)
	require.Len(t, hb, 5000)
	copy(hb, "pooled")
	ptr := b.Ptr()
	require.NoError(t, b.Release())

	// The block comes back: same memory, no new region, no new registration.
	for i := 0; i < 100; i++ {
		b, err = p.Alloc(8192)
		require.NoError(t, err)
		require.Equal(t, ptr, b.Ptr())
		require.NoError(t, b.Release())
	}
	st := p.Stats()
	require.Equal(t, devicebuf.PoolStats{Regions: 1, RegionBytes: 64 << 10, Registrations: 1, Hits: 100, Misses: 1}, st)
	live, made := reg.counts()
	require.Equal(t, 1, live)
	require.Equal(t, 1, made)

	// Eight blocks fit in the region; the ninth makes a second region.
	var bs []*devicebuf.Buffer
	seen := map[uintptr]bool{}
	for i := 0; i < 9; i++ {
		b, err := p.Alloc(8000)
		require.NoError(t, err)
		require.False(t, seen[b.Ptr()], "blocks are distinct")
		seen[b.Ptr()] = true
		bs = append(bs, b)
	}
	st = p.Stats()
	require.Equal(t, 2, st.Regions)
	require.Equal(t, int64(2), st.Registrations)
	require.Equal(t, 9, st.InUse)
	require.Equal(t, int64(9*8192), st.BytesInUse)
	require.Equal(t, int64(2), devicebuf.Live().Sub(base).Registrations)
	require.Equal(t, int64(2), devicebuf.Live().Sub(base).Regions)
	for _, b := range bs {
		require.NoError(t, b.Release())
	}
	require.Zero(t, p.Stats().InUse)
	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "Close is idempotent")
	live, made = reg.counts()
	require.Zero(t, live, "every region deregistered")
	require.Equal(t, 2, made)
	_, err = p.Alloc(1)
	require.ErrorIs(t, err, errClosed)
	requireLive(t, base)
}

func TestPoolExhaustion(t *testing.T) {
	base := devicebuf.Live()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Classes: []int{4096, 16384}, RegionBytes: 16384, MaxBytes: 32768})
	require.NoError(t, err)
	a, err := p.Alloc(16384) // region 1: one 16 KiB block
	require.NoError(t, err)
	var small []*devicebuf.Buffer
	for i := 0; i < 4; i++ { // region 2: four 4 KiB blocks
		b, err := p.Alloc(100)
		require.NoError(t, err)
		small = append(small, b)
	}
	_, err = p.Alloc(100)
	require.ErrorIs(t, err, devicebuf.ErrExhausted)
	require.ErrorContains(t, err, "no free block of 100 bytes")
	_, err = p.Alloc(10000)
	require.ErrorIs(t, err, devicebuf.ErrExhausted)
	_, err = p.Alloc(16385)
	require.ErrorIs(t, err, devicebuf.ErrExhausted, "above the largest class without Oversize")
	require.Equal(t, int64(3), p.Stats().Exhausted)

	// A free block of a larger class serves a small request when the pool cannot grow, and
	// goes back to its own class.
	require.NoError(t, a.Release())
	b, err := p.Alloc(100)
	require.NoError(t, err)
	require.Equal(t, a.Ptr(), b.Ptr())
	require.NoError(t, b.Release())
	c, err := p.Alloc(16384)
	require.NoError(t, err)
	require.Equal(t, a.Ptr(), c.Ptr())
	require.NoError(t, c.Release())

	for _, b := range small {
		require.NoError(t, b.Release())
	}
	require.NoError(t, p.Close())
	requireLive(t, base)
}

func TestPoolOversize(t *testing.T) {
	base := devicebuf.Live()
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Classes: []int{4096}, MaxBytes: 1 << 20, Oversize: true, Registrar: reg})
	require.NoError(t, err)
	b, err := p.Alloc(100000)
	require.NoError(t, err)
	require.Equal(t, 100000, b.Len())
	require.NotNil(t, b.Registration())
	st := p.Stats()
	require.Equal(t, 1, st.Regions)
	require.Equal(t, int64(102400), st.RegionBytes)
	_, err = p.Alloc(1 << 20)
	require.ErrorIs(t, err, devicebuf.ErrExhausted, "oversize regions count in MaxBytes")
	require.NoError(t, b.Release())
	st = p.Stats()
	require.Zero(t, st.Regions, "an oversize region goes when its buffer goes")
	live, _ := reg.counts()
	require.Zero(t, live)
	require.NoError(t, p.Close())
	requireLive(t, base)
}

func TestPoolCloseWithOutstanding(t *testing.T) {
	base := devicebuf.Live()
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: reg})
	require.NoError(t, err)
	b, err := p.Alloc(1000)
	require.NoError(t, err)
	v, err := b.Slice(10, 10)
	require.NoError(t, err)
	require.NoError(t, b.Release())
	err = p.Close()
	require.ErrorContains(t, err, "1 buffers outstanding")
	live, _ := reg.counts()
	require.Equal(t, 1, live, "regions stay while a buffer is out")
	hb, err := v.HostBytes()
	require.NoError(t, err)
	hb[0] = 1
	require.NoError(t, v.Release())
	live, _ = reg.counts()
	require.Zero(t, live, "the last buffer's return frees the regions")
	requireLive(t, base)
}

func TestPoolConfigErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  devicebuf.PoolConfig
	}{
		{"empty classes", devicebuf.PoolConfig{Classes: []int{}}},
		{"zero class", devicebuf.PoolConfig{Classes: []int{0, 4096}}},
		{"negative max", devicebuf.PoolConfig{MaxBytes: -1}},
		{"negative region", devicebuf.PoolConfig{RegionBytes: -1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := devicebuf.NewPool(c.cfg)
			require.Error(t, err)
		})
	}
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{})
	require.NoError(t, err)
	_, err = p.Alloc(0)
	require.Error(t, err)
	require.NoError(t, p.Close())
}

func TestPoolRegistrarAndSourceErrors(t *testing.T) {
	base := devicebuf.Live()
	reg := newRegistrar()
	reg.failNext = errors.New("no NIC today")
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: reg})
	require.NoError(t, err)
	_, err = p.Alloc(10)
	require.ErrorContains(t, err, "no NIC today")
	b, err := p.Alloc(10)
	require.NoError(t, err, "the next attempt grows the pool")
	require.NoError(t, b.Release())
	require.NoError(t, p.Close())

	q, err := devicebuf.NewPool(devicebuf.PoolConfig{Regions: func(n int) (*devicebuf.Buffer, error) {
		return devicebuf.HostFromBytes(make([]byte, n)), nil
	}})
	require.NoError(t, err)
	_, err = q.Alloc(10)
	require.ErrorContains(t, err, "Go memory", "Go memory never becomes a region")
	require.NoError(t, q.Close())
	requireLive(t, base)
}

func TestPoolRegionsSource(t *testing.T) {
	g := devicebuftest.Install(t, 2)
	base := devicebuf.Live()
	alloc, err := devicebuf.NewCUDAAllocator(1)
	require.NoError(t, err)
	var made int
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{
		Regions: func(n int) (*devicebuf.Buffer, error) {
			made++
			return alloc.Alloc(n)
		},
		Registrar: reg,
	})
	require.NoError(t, err)
	b, err := p.Alloc(1 << 20)
	require.NoError(t, err)
	require.Equal(t, devicebuf.CUDA, p.Kind())
	require.Equal(t, 1, p.Device())
	require.Equal(t, devicebuf.CUDA, b.Kind())
	require.Equal(t, 1, b.Device())
	require.Equal(t, g.UUID(1), b.DeviceUUID())
	_, err = b.HostBytes()
	require.ErrorIs(t, err, devicebuf.ErrNotHost)
	require.Equal(t, []devicebuf.Kind{devicebuf.CUDA}, reg.kinds)
	require.Equal(t, []int{1}, reg.devices)
	require.Equal(t, 1, made)

	// Copies in and out of a pooled device block.
	want := pattern(3, 1<<20)
	h := devicebuf.HostFromBytes(want)
	require.NoError(t, devicebuf.Copy(b, h))
	got, err := g.View(b.Ptr(), b.Len())
	require.NoError(t, err)
	requireBytes(t, want, got, "pooled device block")
	require.NoError(t, h.Release())
	require.NoError(t, b.Release())
	require.NoError(t, p.Close())
	requireLive(t, base)
}

func TestPoolConcurrent(t *testing.T) {
	base := devicebuf.Live()
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: reg, MaxBytes: 64 << 20})
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				n := 1 + (i*7919+w*104729)%(300<<10)
				b, err := p.Alloc(n)
				if err != nil {
					errs <- err
					return
				}
				hb, _ := b.HostBytes()
				hb[0], hb[n-1] = byte(w), byte(i)
				if hb[0] != byte(w) || hb[n-1] != byte(i) {
					errs <- fmt.Errorf("block shared between workers")
				}
				if err := b.Release(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	st := p.Stats()
	require.Zero(t, st.InUse)
	require.Equal(t, int64(8*200), st.Hits+st.Misses)
	require.Equal(t, st.Misses, st.Registrations, "one registration per region, none per allocation")
	require.NoError(t, p.Close())
	requireLive(t, base)
}

// BenchmarkPoolAllocRelease measures the cost of taking a block from a warm pool and giving
// it back (the per-message cost of a registered destination).
func BenchmarkPoolAllocRelease(b *testing.B) {
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: newRegistrar()})
	require.NoError(b, err)
	defer p.Close()
	for _, n := range []int{4 << 10, 1 << 20} {
		b.Run("size="+sizeName(n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				buf, err := p.Alloc(n)
				if err != nil {
					b.Fatal(err)
				}
				_ = buf.Release()
			}
		})
	}
}

// A payload pool serves any payload size a receive may ask for from the GPU it
// is given: a class for each power of two, blocks reused, the bound enforced.
func TestPayloadPool(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	_, err = devicebuf.NewPayloadPool(nil, 1<<30)
	require.Error(t, err)
	_, err = devicebuf.NewPayloadPool(gpu, 0)
	require.Error(t, err)

	p, err := devicebuf.NewPayloadPool(gpu, 512<<20)
	require.NoError(t, err)
	for _, n := range []int{1, 64<<10 + 1, 100 << 20, 200 << 20} {
		b, err := p.Alloc(n)
		require.NoError(t, err, "%d bytes", n)
		require.Equal(t, devicebuf.CUDA, b.Kind())
		require.Equal(t, n, b.Len())
		first := b.Ptr()
		b.Release()
		b, err = p.Alloc(n)
		require.NoError(t, err)
		require.Equal(t, first, b.Ptr(), "a %d-byte block was not reused", n)
		b.Release()
	}
	// 100 MiB and 200 MiB took classes of 128 and 256 MiB: 384 MiB of 512 held
	// idle, so 256 MiB more frees idle regions to fit; 600 MiB never fits.
	b, err := p.Alloc(256 << 20)
	require.NoError(t, err)
	b.Release()
	_, err = p.Alloc(600 << 20)
	require.ErrorIs(t, err, devicebuf.ErrExhausted)
	require.NoError(t, p.Close())
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base))
}
