package devicebuf_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

func TestKindString(t *testing.T) {
	require.Equal(t, "host", devicebuf.Host.String())
	require.Equal(t, "cuda", devicebuf.CUDA.String())
	require.Equal(t, "kind(7)", devicebuf.Kind(7).String())
}

func TestHostAllocator(t *testing.T) {
	base := devicebuf.Live()
	a := devicebuf.NewHostAllocator()
	require.Equal(t, devicebuf.Host, a.Kind())
	require.Equal(t, -1, a.Device())

	b, err := a.Alloc(10000)
	require.NoError(t, err)
	require.Equal(t, 10000, b.Len())
	require.Equal(t, devicebuf.Host, b.Kind())
	require.Equal(t, -1, b.Device())
	require.Empty(t, b.DeviceUUID())
	require.False(t, b.GoMemory())
	require.Zero(t, b.Ptr()%uintptr(os.Getpagesize()), "page aligned")
	require.Equal(t, int64(12288), devicebuf.Live().Sub(base).HostBytes, "whole pages")
	require.Equal(t, int64(1), devicebuf.Live().Sub(base).HostBuffers)

	p, err := b.HostBytes()
	require.NoError(t, err)
	require.Len(t, p, 10000)
	require.Equal(t, make([]byte, 10000), p, "zeroed")
	copy(p, "hello")
	root, off := b.Root()
	require.Same(t, b, root)
	require.Zero(t, off)
	require.Nil(t, b.Registration())

	require.NoError(t, b.Release())
	require.ErrorIs(t, b.Release(), devicebuf.ErrReleased)
	_, err = b.HostBytes()
	require.ErrorIs(t, err, devicebuf.ErrReleased)
	requireLive(t, base)

	_, err = a.Alloc(0)
	require.Error(t, err)
}

func TestSliceRetainRelease(t *testing.T) {
	base := devicebuf.Live()
	b, err := devicebuf.NewHostAllocator().Alloc(4096)
	require.NoError(t, err)
	p, _ := b.HostBytes()
	for i := range p {
		p[i] = byte(i)
	}

	v, err := b.Slice(100, 50)
	require.NoError(t, err)
	require.Equal(t, b.Ptr()+100, v.Ptr())
	require.Equal(t, 50, v.Len())
	root, off := v.Root()
	require.Same(t, b, root)
	require.Equal(t, 100, off)
	vb, err := v.HostBytes()
	require.NoError(t, err)
	require.Equal(t, p[100:150], vb)
	require.Equal(t, 50, cap(vb), "a view cannot reach past its end")

	vv, err := v.Slice(10, 5)
	require.NoError(t, err)
	root, off = vv.Root()
	require.Same(t, b, root)
	require.Equal(t, 110, off)

	for _, c := range []struct {
		name   string
		off, n int
	}{{"negative offset", -1, 1}, {"negative length", 0, -1}, {"past end", 4000, 97}, {"offset past end", 4097, 0}} {
		t.Run(c.name, func(t *testing.T) {
			_, err := b.Slice(c.off, c.n)
			require.Error(t, err)
		})
	}

	// The root's last release does not free memory views still hold.
	require.Same(t, b, b.Retain())
	require.NoError(t, b.Release())
	require.NoError(t, b.Release())
	require.True(t, b.Released())
	require.Panics(t, func() { b.Retain() })
	_, err = b.Slice(0, 1)
	require.ErrorIs(t, err, devicebuf.ErrReleased)
	vb, err = v.HostBytes()
	require.NoError(t, err)
	require.Equal(t, byte(100), vb[0])
	require.Equal(t, int64(4096), devicebuf.Live().Sub(base).HostBytes)

	require.NoError(t, v.Release())
	require.NoError(t, vv.Release())
	requireLive(t, base)
}

func TestWrap(t *testing.T) {
	base := devicebuf.Live()
	host, err := devicebuf.NewHostAllocator().Alloc(8192)
	require.NoError(t, err)
	released := 0
	w := devicebuf.Wrap(host.Ptr(), 8192, devicebuf.Host, 3, func() { released++ })
	require.Equal(t, -1, w.Device(), "host memory has no device")
	wb, err := w.HostBytes()
	require.NoError(t, err)
	wb[5] = 42
	hb, _ := host.HostBytes()
	require.Equal(t, byte(42), hb[5])
	v, err := w.Slice(0, 10)
	require.NoError(t, err)
	require.NoError(t, w.Release())
	require.Zero(t, released)
	require.NoError(t, v.Release())
	require.Equal(t, 1, released)
	require.ErrorIs(t, w.Release(), devicebuf.ErrReleased)
	require.Equal(t, 1, released)

	g := devicebuftest.Install(t, 1)
	d := devicebuf.Wrap(0xdead0000, 100, devicebuf.CUDA, 0, nil)
	require.Equal(t, devicebuf.CUDA, d.Kind())
	require.Equal(t, 0, d.Device())
	require.Equal(t, g.UUID(0), d.DeviceUUID())
	_, err = d.HostBytes()
	require.ErrorIs(t, err, devicebuf.ErrNotHost)
	require.NoError(t, d.Release())
	require.NoError(t, host.Release())
	require.Panics(t, func() { devicebuf.Wrap(0x1000, 1, devicebuf.Kind(9), 0, nil) })
	require.Panics(t, func() { devicebuf.Wrap(0x1000, -1, devicebuf.Host, 0, nil) })
	requireLive(t, base)
}

func TestHostFromBytes(t *testing.T) {
	base := devicebuf.Live()
	p := []byte("some received bytes")
	b := devicebuf.HostFromBytes(p)
	require.True(t, b.GoMemory())
	require.Equal(t, len(p), b.Len())
	got, err := b.HostBytes()
	require.NoError(t, err)
	got[0] = 'S'
	require.Equal(t, byte('S'), p[0], "no copy")
	require.NoError(t, b.Release())
	requireLive(t, base)

	e := devicebuf.HostFromBytes(nil)
	require.Zero(t, e.Len())
	got, err = e.HostBytes()
	require.NoError(t, err)
	require.Empty(t, got)
	require.NoError(t, e.Release())
	requireLive(t, base)
}

// A HostView is a HostFromBytes that Live leaves out, slices of it too:
// the bytes are Go memory whatever holds them keeps, so a view nobody
// releases is no leak. It reads and releases as any host buffer.
func TestHostView(t *testing.T) {
	base := devicebuf.Live()
	p := []byte("an inline payload")
	v := devicebuf.HostView(p)
	require.True(t, v.GoMemory())
	require.Equal(t, devicebuf.Host, v.Kind())
	got, err := v.HostBytes()
	require.NoError(t, err)
	require.Equal(t, p, got)
	s, err := v.Slice(3, 6)
	require.NoError(t, err)
	got, err = s.HostBytes()
	require.NoError(t, err)
	require.Equal(t, []byte("inline"), got)
	requireLive(t, base) // neither the view nor its slice is counted
	require.NoError(t, s.Release())
	require.NoError(t, v.Release())
	require.True(t, v.Released())
	requireLive(t, base)
	_ = devicebuf.HostView(p) // dropped unreleased: nothing to give back
	requireLive(t, base)
}
