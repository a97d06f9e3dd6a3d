package devicebuf_test

// Arguments that must be refused before they reach the driver or the pool's
// bound arithmetic: pins of a nil or wrapping host range, nil events and
// streams handed to stream calls, ranges that run past the end of the address
// space, and pool bounds near the largest int64.

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// PinHost refuses a nil pointer and a range whose end does not fit the address
// space before it asks the driver to page-lock anything.
func TestPinHostRefusesBadRange(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	for _, tt := range []struct {
		name string
		ptr  uintptr
		n    int
	}{
		{"nil pointer", 0, 4096},
		{"range past the address space", ^uintptr(0) - 4095, 8192},
	} {
		t.Run(tt.name, func(t *testing.T) {
			unpin, err := devicebuf.PinHost(tt.ptr, tt.n)
			if err == nil {
				_ = unpin()
			}
			require.Error(t, err, "PinHost(%#x, %d)", tt.ptr, tt.n)
		})
	}
	require.Zero(t, g.HostRegistrations())
	requireLive(t, base)
}

// Stream calls that take an event, and WaitOn of a Pending buffer, refuse a
// nil event or stream with an error, as CopyAsync refuses a nil stream.
func TestStreamCallsRefuseNil(t *testing.T) {
	devicebuftest.Install(t, 1)
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	defer s.Close()
	for name, call := range map[string]func() error{
		"Record":        func() error { return s.Record(nil) },
		"Wait":          func() error { return s.Wait(nil) },
		"SynchronizeBy": func() error { return s.SynchronizeBy(nil) },
	} {
		t.Run(name, func(t *testing.T) {
			var err error
			require.NotPanics(t, func() { err = call() })
			require.Error(t, err)
		})
	}

	t.Run("WaitOn", func(t *testing.T) {
		// A buffer whose arrival event is recorded behind a copy nothing has run
		// yet (the fake starts no work for a look at an interprocess event).
		recv, h, err := devicebuf.NewIPCEvent(0)
		require.NoError(t, err)
		defer recv.Close()
		send, err := devicebuf.OpenIPCEvent(h, 0)
		require.NoError(t, err)
		defer send.Close()
		src := cudaKind(0).alloc(t, 4096)
		defer src.Release()
		dst := cudaKind(0).alloc(t, 4096)
		defer dst.Release()
		require.NoError(t, devicebuf.CopyAsync(s, dst, src))
		require.NoError(t, s.Record(send))
		b := devicebuf.WrapArriving(dst.Ptr(), 4096, 0, nil, recv, 0)
		defer b.Release()
		require.True(t, b.Pending())
		require.NotPanics(t, func() { err = b.WaitOn(nil) })
		require.Error(t, err)
		require.NoError(t, s.Synchronize())
	})
}

// Wrap refuses a range whose end does not fit the address space: a Slice of
// it would lie below the wrapped pointer, outside the memory the caller
// vouched for.
func TestWrapRangePastAddressSpace(t *testing.T) {
	devicebuftest.Install(t, 1)
	require.Panics(t, func() {
		b := devicebuf.Wrap(^uintptr(0)-4095, 8192, devicebuf.CUDA, 0, nil)
		defer b.Release()
		v, err := b.Slice(4096, 16)
		require.NoError(t, err)
		defer v.Release()
		t.Errorf("Wrap accepted [%#x+%d]; its Slice at 4096 lies at %#x", b.Ptr(), b.Len(), v.Ptr())
	})
}

// A pool bounded at the largest int64 (no bound in practice) still checks a
// new region against what is left of the bound: the sum of the bytes held and
// a region near the largest int would wrap negative and pass the check, and
// the pool would ask its source for more than its bound allows.
func TestPoolBoundNearMaxInt64(t *testing.T) {
	for _, tt := range []struct {
		name    string
		classes []int
		n       int
	}{
		{"class region", []int{4096, math.MaxInt - 100}, math.MaxInt - 100},
		{"oversize region", []int{4096}, math.MaxInt - 4096},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base := devicebuf.Live()
			host := devicebuf.NewHostAllocator()
			var asked []int
			p, err := devicebuf.NewPool(devicebuf.PoolConfig{
				Regions: func(n int) (*devicebuf.Buffer, error) {
					asked = append(asked, n)
					if n > 1<<20 {
						return nil, devicebuf.ErrExhausted
					}
					return host.Alloc(n)
				},
				Classes:     tt.classes,
				RegionBytes: 4096,
				MaxBytes:    math.MaxInt64,
				Oversize:    true,
				IdleTimeout: -1,
			})
			require.NoError(t, err)
			small, err := p.Alloc(4096)
			require.NoError(t, err)
			_, err = p.Alloc(tt.n)
			require.ErrorIs(t, err, devicebuf.ErrExhausted, "Alloc(%d)", tt.n)
			require.Equal(t, []int{4096}, asked, "the region source was asked past the bound")
			require.Equal(t, int64(4096), p.Stats().RegionBytes)
			require.NoError(t, small.Release())
			require.NoError(t, p.Close())
			requireLive(t, base)
		})
	}
}
