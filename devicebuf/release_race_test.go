package devicebuf_test

import (
	"bytes"
	"math"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// Clear of a released CUDA buffer is refused: the pool handed its block to
// another buffer, whose bytes a memset would wipe.
func TestClearReleased(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Backing: gpu, Classes: []int{4096}, RegionBytes: 4096, IdleTimeout: -1})
	require.NoError(t, err)
	defer p.Close()
	a, err := p.Alloc(4096)
	require.NoError(t, err)
	require.NoError(t, a.Release())
	b, err := p.Alloc(4096)
	require.NoError(t, err)
	defer b.Release()
	require.Equal(t, a.Ptr(), b.Ptr(), "the pool reuses the block")
	want := bytes.Repeat([]byte{0xab}, 4096)
	require.NoError(t, g.Poke(b.Ptr(), want))
	require.ErrorIs(t, devicebuf.Clear(a), devicebuf.ErrReleased)
	got, err := g.Peek(b.Ptr(), 4096)
	require.NoError(t, err)
	require.Equal(t, want, got, "the block's new owner kept its bytes")
}

// racingRelease runs op on a fresh view of a buffer while another goroutine
// drops that view's only reference, rounds times; what op returns runs once
// that Release returned.
func racingRelease(t *testing.T, rounds int, view func() *devicebuf.Buffer, op func(v *devicebuf.Buffer) func()) {
	var cur atomic.Pointer[devicebuf.Buffer]
	start, done, stop := make(chan struct{}), make(chan struct{}), make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-start:
			case <-stop:
				return
			}
			_ = cur.Load().Release()
			done <- struct{}{}
		}
	}()
	for range rounds {
		cur.Store(view())
		start <- struct{}{}
		after := op(cur.Load())
		<-done
		if after != nil {
			after()
		}
	}
}

// A Slice racing its buffer's last Release either fails with ErrReleased
// or makes a view that keeps the memory: the block never goes back to the
// pool while the view holds it (which a second free, at the view's Release,
// would make the pool hand out twice).
func TestSliceRacingLastRelease(t *testing.T) {
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Classes: []int{4096}, RegionBytes: 4096, IdleTimeout: -1, MaxBytes: 1 << 20})
	require.NoError(t, err)
	defer p.Close()
	view := func() *devicebuf.Buffer {
		b, err := p.Alloc(4096)
		require.NoError(t, err)
		return b
	}
	racingRelease(t, 20000, view, func(b *devicebuf.Buffer) func() {
		v, err := b.Slice(0, 16)
		if err != nil {
			require.ErrorIs(t, err, devicebuf.ErrReleased)
			return nil
		}
		return func() { // b is released: the view alone holds the block
			require.Equal(t, 1, p.Stats().InUse, "the view's block went back to the pool under it")
			require.NoError(t, v.Release())
		}
	})
	require.Zero(t, p.Stats().InUse)
}

// A CopyAsync racing the last Release of its destination (GPU memory, or
// host memory, which it copies at once) fails with ErrReleased or copies
// into memory it holds until the copy is complete; it never panics.
func TestCopyAsyncRacingRelease(t *testing.T) {
	devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	defer s.Close()
	src, err := devicebuf.NewHostAllocator().Alloc(64)
	require.NoError(t, err)
	defer src.Release()
	for name, alloc := range map[string]devicebuf.Allocator{"cuda": gpu, "host": devicebuf.NewHostAllocator()} {
		t.Run(name, func(t *testing.T) {
			dst, err := alloc.Alloc(64)
			require.NoError(t, err)
			defer dst.Release()
			view := func() *devicebuf.Buffer {
				v, err := dst.Slice(0, 64)
				require.NoError(t, err)
				return v
			}
			racingRelease(t, 20000, view, func(v *devicebuf.Buffer) func() {
				if err := devicebuf.CopyAsync(s, v, src); err != nil {
					require.ErrorIs(t, err, devicebuf.ErrReleased)
				}
				return nil
			})
			require.NoError(t, s.Synchronize())
		})
	}
}

// An oversize allocation over MaxBytes is refused before its size is
// rounded, which near the largest int would overflow into a negative region.
func TestOversizeNearMaxInt(t *testing.T) {
	asked := 0
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{
		Regions: func(n int) (*devicebuf.Buffer, error) {
			asked = n
			return nil, devicebuf.ErrExhausted
		},
		Oversize: true, MaxBytes: 1 << 20,
	})
	require.NoError(t, err)
	defer p.Close()
	_, err = p.Alloc(math.MaxInt - 10)
	require.ErrorIs(t, err, devicebuf.ErrExhausted)
	require.Zero(t, asked, "the region source was asked for %d bytes", asked)
}
