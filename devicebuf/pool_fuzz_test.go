package devicebuf_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
)

// FuzzPoolOps drives a small pool with a sequence of allocations and releases decoded from
// the input and checks after each step that live blocks never overlap, lie inside their
// registered region, keep their bytes, and that the counters add up; at the end everything
// is released and deregistered.
func FuzzPoolOps(f *testing.F) {
	f.Add([]byte{1, 2, 3, 200, 0, 7, 130, 255, 4, 4, 4, 4, 128, 129})
	f.Add([]byte{250, 250, 250, 250, 250, 250, 250, 250, 131, 132, 250, 250})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{255, 254, 253, 252, 128, 128, 128, 128, 64, 32, 16, 8})
	f.Fuzz(func(t *testing.T, ops []byte) {
		base := devicebuf.Live()
		reg := newRegistrar()
		p, err := devicebuf.NewPool(devicebuf.PoolConfig{
			Classes: []int{64, 256, 4096, 16384}, RegionBytes: 16384, MaxBytes: 96 << 10,
			Oversize: true, Registrar: reg,
		})
		require.NoError(t, err)
		type liveBuf struct {
			b   *devicebuf.Buffer
			tag byte
		}
		var bufs []liveBuf
		for i, op := range ops {
			if op >= 128 && len(bufs) > 0 { // release one
				k := int(op-128) % len(bufs)
				lb := bufs[k]
				hb, err := lb.b.HostBytes()
				require.NoError(t, err)
				require.Equal(t, lb.tag, hb[0], "first byte kept")
				require.Equal(t, lb.tag, hb[len(hb)-1], "last byte kept")
				require.NoError(t, lb.b.Release())
				bufs = append(bufs[:k], bufs[k+1:]...)
				continue
			}
			n := 1 + int(op)*int(op)*2 // 1 B .. 32 KiB: every class and oversize
			b, err := p.Alloc(n)
			if err != nil {
				require.ErrorIs(t, err, devicebuf.ErrExhausted)
				continue
			}
			require.Equal(t, n, b.Len())
			root, off := b.Root()
			require.GreaterOrEqual(t, off, 0)
			require.LessOrEqual(t, off+n, root.Len(), "inside the region")
			r, ok := b.Registration().(*testReg)
			require.True(t, ok)
			require.Equal(t, root.Ptr(), r.ptr, "the region's registration")
			for _, o := range bufs {
				require.True(t, b.Ptr()+uintptr(n) <= o.b.Ptr() || o.b.Ptr()+uintptr(o.b.Len()) <= b.Ptr(),
					"block [%#x+%d] overlaps [%#x+%d]", b.Ptr(), n, o.b.Ptr(), o.b.Len())
			}
			hb, err := b.HostBytes()
			require.NoError(t, err)
			tag := byte(i + 1)
			hb[0], hb[n-1] = tag, tag
			bufs = append(bufs, liveBuf{b, tag})
			st := p.Stats()
			require.Equal(t, len(bufs), st.InUse)
			require.LessOrEqual(t, st.RegionBytes, int64(96<<10))
			live, made := reg.counts()
			require.Equal(t, st.Regions, live)
			require.Equal(t, st.Registrations, int64(made))
		}
		for _, lb := range bufs {
			require.NoError(t, lb.b.Release())
		}
		require.NoError(t, p.Close())
		live, _ := reg.counts()
		require.Zero(t, live)
		requireLive(t, base)
	})
}
