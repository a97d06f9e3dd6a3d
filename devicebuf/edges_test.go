package devicebuf_test

// Edges of the package's contract: pool bounds below the region size,
// registrars without a release, unpins and IPC exports made twice, the order of host copies
// on a device stream, overlapping device copies.

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// A pool whose MaxBytes is below its region size (RegionBytes, 4 MiB by default) still
// hands out blocks that fit the bound: its regions shrink to MaxBytes. NewPayloadPool says
// to size maxBytes for the payloads in flight at once, so a 1 MiB bound for 64 KiB payloads
// is a valid configuration.
func TestPoolBoundBelowRegionSize(t *testing.T) {
	base := devicebuf.Live()
	for _, tt := range []struct {
		name string
		make func() (*devicebuf.Pool, error)
		n    int
	}{
		{"payload pool of 1 MiB, 64 KiB payload", func() (*devicebuf.Pool, error) {
			return devicebuf.NewPayloadPool(devicebuf.NewHostAllocator(), 1<<20)
		}, 64 << 10},
		{"default classes, MaxBytes 1 MiB, 4 KiB block", func() (*devicebuf.Pool, error) {
			return devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 1 << 20})
		}, 4 << 10},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := tt.make()
			require.NoError(t, err)
			defer p.Close()
			b, err := p.Alloc(tt.n)
			require.NoError(t, err, "a %d-byte block in an empty pool bounded at 1 MiB", tt.n)
			require.NoError(t, b.Release())
		})
	}
	requireLive(t, base)
}

// nilReleaseRegistrar registers regions with nothing to undo: it returns no release
// function, which the pool tolerates (freeRegion checks r.release != nil).
type nilReleaseRegistrar struct{}

func (nilReleaseRegistrar) Register(ptr uintptr, n int, kind devicebuf.Kind, device int) (any, func() error, error) {
	return "registered", nil, nil
}

// A Registrar may return no release function: the registration it made is counted and
// uncounted all the same, so leak checks above devicebuf see nothing left.
func TestRegistrarWithoutRelease(t *testing.T) {
	base := devicebuf.Live()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Registrar: nilReleaseRegistrar{}, RegionBytes: 64 << 10, MaxBytes: 1 << 20})
	require.NoError(t, err)
	b, err := p.Alloc(100)
	require.NoError(t, err)
	require.Equal(t, "registered", b.Registration())
	require.NoError(t, b.Release())
	require.NoError(t, p.Close())
	require.Zero(t, p.Stats().Regions)
	requireLive(t, base)
}

// The function PinHost returns unpins once: called again it fails and leaves the driver
// alone, so Live().PinnedRegions stays at its base and a pin of the same pages made in
// between (another PinHost, a pinned allocator) keeps its registration.
func TestPinHostUnpinTwice(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	mem, err := devicebuf.NewHostAllocator().Alloc(8192)
	require.NoError(t, err)
	defer mem.Release()

	t.Run("counter", func(t *testing.T) {
		base := devicebuf.Live()
		unpin, err := devicebuf.PinHost(mem.Ptr(), 8192)
		require.NoError(t, err)
		require.NoError(t, unpin())
		require.Error(t, unpin(), "the range is not pinned any more")
		require.Equal(t, int64(0), devicebuf.Live().Sub(base).PinnedRegions, "pinned ranges after pin, unpin, unpin")
	})
	t.Run("stale unpin after a re-pin", func(t *testing.T) {
		unpin1, err := devicebuf.PinHost(mem.Ptr(), 8192)
		require.NoError(t, err)
		require.NoError(t, unpin1())
		unpin2, err := devicebuf.PinHost(mem.Ptr(), 8192) // a second owner pins the same range
		require.NoError(t, err)
		stale := unpin1() // the first owner's registration is gone already
		regs := g.HostRegistrations()
		if regs == 0 {
			t.Errorf("a stale unpin (returned %v) took away the second owner's registration", stale)
		} else {
			_ = unpin2()
		}
	})
}

// Two Buffers over the same driver allocation (a buffer and a Wrap or WrapArriving of its
// pointer, as a receiver makes for a payload still arriving) export the same handle; once
// either is released, the other is still this process's own: OwnIPC says so, and OpenIPC
// of the handle gives the allocation itself (real CUDA refuses to open a process's own
// handles).
func TestExportIPCSharedAllocation(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	const n = 1 << 16
	dst := cudaKind(0).alloc(t, n)
	h1, _, err := devicebuf.ExportIPC(dst)
	require.NoError(t, err)
	w := devicebuf.Wrap(dst.Ptr(), n, devicebuf.CUDA, 0, nil) // e.g. WrapArriving of the same memory
	h2, _, err := devicebuf.ExportIPC(w)
	require.NoError(t, err)
	require.Equal(t, h1, h2, "one driver allocation, one handle")
	require.NoError(t, w.Release())

	own := devicebuf.OwnIPC(h1)
	m, err := devicebuf.OpenIPC(h1, 0)
	require.NoError(t, err)
	sameMemory := m.Ptr() == dst.Ptr()
	require.NoError(t, m.Release())
	require.NoError(t, dst.Release())
	require.True(t, own, "OwnIPC of the handle of a live allocation this process exported")
	require.True(t, sameMemory, "OpenIPC of this process's own live handle gives the allocation itself, not a driver mapping")
	requireLive(t, base)
}

// A host-to-host CopyAsync on a device stream keeps the stream's order, in both shapes of
// a staged copy (device -> bounce -> final, or a bounce reused for the next chunk):
//   - read after write: a host copy out of a host buffer that a queued device-to-host copy
//     fills reads that copy's bytes;
//   - write after read: a host copy into a host buffer that a queued host-to-device copy
//     reads does not overwrite them before the device copy took them.
func TestCopyAsyncHostCopyInStreamOrder(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	const n = 1 << 16
	want := pattern(21, n)

	t.Run("read after write", func(t *testing.T) {
		dev := cudaKind(0).alloc(t, n)
		defer dev.Release()
		require.NoError(t, g.Poke(dev.Ptr(), want))
		bounce, final := hostKinds()[1].alloc(t, n), hostKinds()[0].alloc(t, n)
		defer bounce.Release()
		defer final.Release()
		s, err := devicebuf.NewStream(0)
		require.NoError(t, err)
		defer s.Close()
		require.NoError(t, devicebuf.CopyAsync(s, bounce, dev))   // device -> bounce, queued
		require.NoError(t, devicebuf.CopyAsync(s, final, bounce)) // bounce -> final, after it
		require.NoError(t, s.Synchronize())
		got, err := final.HostBytes()
		require.NoError(t, err)
		requireBytes(t, want, got, "final after device -> bounce -> final on one stream")
	})
	t.Run("write after read", func(t *testing.T) {
		dev := cudaKind(0).alloc(t, n)
		defer dev.Release()
		bounce := hostKinds()[1].alloc(t, n)
		defer bounce.Release()
		hb, err := bounce.HostBytes()
		require.NoError(t, err)
		copy(hb, want)
		next := devicebuf.HostFromBytes(pattern(22, n))
		defer next.Release()
		s, err := devicebuf.NewStream(0)
		require.NoError(t, err)
		defer s.Close()
		require.NoError(t, devicebuf.CopyAsync(s, dev, bounce))  // bounce -> device, queued
		require.NoError(t, devicebuf.CopyAsync(s, bounce, next)) // the next chunk into bounce, after it
		require.NoError(t, s.Synchronize())
		got, err := g.Peek(dev.Ptr(), n)
		require.NoError(t, err)
		requireBytes(t, want, got, "device after bounce -> device, then next -> bounce, on one stream")
	})
	requireLive(t, base)
}

// Copy and CopyAsync refuse overlapping views of one CUDA allocation, whose copy CUDA leaves
// undefined (the fake GPU copies with memmove and would not show it); disjoint views of
// the same allocation still copy.
func TestOverlappingDeviceCopyRefused(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	const n, shift = 1 << 16, 4096
	whole := cudaKind(0).alloc(t, 2*n)
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	view := func(off int) *devicebuf.Buffer {
		b, err := whole.Slice(off, n)
		require.NoError(t, err)
		return b
	}
	for _, offs := range [][2]int{{shift, 0}, {0, shift}, {0, 0}} {
		dst, src := view(offs[0]), view(offs[1])
		require.ErrorContains(t, devicebuf.Copy(dst, src), "overlap", "dst at %d, src at %d", offs[0], offs[1])
		require.ErrorContains(t, devicebuf.CopyAsync(s, dst, src), "overlap", "dst at %d, src at %d", offs[0], offs[1])
		require.NoError(t, dst.Release())
		require.NoError(t, src.Release())
	}
	dst, src := view(n), view(0)
	require.NoError(t, devicebuf.Copy(dst, src))
	require.NoError(t, dst.Release())
	require.NoError(t, src.Release())
	require.NoError(t, s.Close())
	require.NoError(t, whole.Release())
	requireLive(t, base)
}

// On a real GPU: the read-after-write shape of TestCopyAsyncHostCopyInStreamOrder with the
// real driver (a device-to-pinned-host copy queued, then a host copy out of that host buffer
// on the same stream).
func TestGPUCopyAsyncHostCopyInStreamOrder(t *testing.T) {
	requireCUDA(t)
	const n = 64 << 20
	want := pattern(41, n)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	dev, err := gpu.Alloc(n)
	require.NoError(t, err)
	defer dev.Release()
	in := devicebuf.HostFromBytes(want)
	defer in.Release()
	require.NoError(t, devicebuf.Copy(dev, in))
	bounce, err := devicebuf.NewHostAllocator(devicebuf.Pinned()).Alloc(n)
	require.NoError(t, err)
	defer bounce.Release()
	final, err := devicebuf.NewHostAllocator().Alloc(n)
	require.NoError(t, err)
	defer final.Release()
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, devicebuf.CopyAsync(s, bounce, dev))
	require.NoError(t, devicebuf.CopyAsync(s, final, bounce))
	require.NoError(t, s.Synchronize())
	got, err := final.HostBytes()
	require.NoError(t, err)
	requireBytes(t, want, got, "final after device -> bounce -> final on one stream")
}

// A pool bounded near its region size holds blocks of three classes at once (64, 128 and
// 256 KiB: under 1 MiB in flight), whatever the bound from 1 MiB up, as NewPayloadPool's
// "size it for the largest payloads in flight at once" says; a larger bound never holds
// less.
func TestBoundedPoolThreeClasses(t *testing.T) {
	for _, max := range []int64{1 << 20, 8<<20 - 1, 8 << 20, 12<<20 - 1, 12 << 20} {
		p, err := devicebuf.NewPayloadPool(devicebuf.NewHostAllocator(), max)
		require.NoError(t, err)
		var held []*devicebuf.Buffer
		for _, n := range []int{64 << 10, 128 << 10, 256 << 10} {
			b, err := p.Alloc(n)
			require.NoError(t, err, "MaxBytes %d: a %d-byte block beside %d others (stats %+v)", max, n, len(held), p.Stats())
			held = append(held, b)
		}
		for _, b := range held {
			require.NoError(t, b.Release())
		}
		require.NoError(t, p.Close())
	}
}

// A pool bounded below its smallest class, or below 8 bytes, refuses with ErrExhausted
// (no region arithmetic fails); one bounded at one block serves it.
func TestPoolTinyBounds(t *testing.T) {
	for _, max := range []int64{1, 7, 8, 64<<10 - 1} {
		p, err := devicebuf.NewPayloadPool(devicebuf.NewHostAllocator(), max)
		require.NoError(t, err)
		_, err = p.Alloc(1)
		require.ErrorIs(t, err, devicebuf.ErrExhausted, "MaxBytes %d", max)
		require.NoError(t, p.Close())
	}
	p, err := devicebuf.NewPayloadPool(devicebuf.NewHostAllocator(), 64<<10)
	require.NoError(t, err)
	defer p.Close()
	b, err := p.Alloc(1)
	require.NoError(t, err)
	_, err = p.Alloc(1)
	require.ErrorIs(t, err, devicebuf.ErrExhausted)
	require.NoError(t, b.Release())
	b, err = p.Alloc(64 << 10)
	require.NoError(t, err)
	require.NoError(t, b.Release())
}

// OpenIPC of a handle this process exported gives a Buffer covering the whole allocation,
// even where a Wrap of a part of it exported the handle first.
func TestOpenOwnIPCCoversAllocation(t *testing.T) {
	devicebuftest.Install(t, 1)
	const n = 1 << 16
	dst := cudaKind(0).alloc(t, n)
	defer dst.Release()
	w := devicebuf.Wrap(dst.Ptr(), n/2, devicebuf.CUDA, 0, nil)
	defer w.Release()
	h1, _, err := devicebuf.ExportIPC(w)
	require.NoError(t, err)
	h2, _, err := devicebuf.ExportIPC(dst)
	require.NoError(t, err)
	require.Equal(t, h1, h2)
	m, err := devicebuf.OpenIPC(h1, 0)
	require.NoError(t, err)
	defer m.Release()
	require.Equal(t, n, m.Len(), "OpenIPC of this process's own handle covers the whole allocation")
}

// Goroutines exporting the same allocation at once (slices of one pool region, as two
// receivers' destinations) leave no entry in the export table once it is freed.
func TestConcurrentExportLeavesNoEntry(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.ExportEntries()
	for range 300 {
		b := cudaKind(0).alloc(t, 1<<16)
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				_, _, err := devicebuf.ExportIPC(b)
				require.NoError(t, err)
			})
		}
		wg.Wait()
		require.NoError(t, b.Release())
	}
	require.Equal(t, base, devicebuf.ExportEntries(), "export table entries left after every exported allocation was freed")
}

// Clear and CopyAsync refuse nil arguments with an error, as Copy does.
func TestNilArguments(t *testing.T) {
	devicebuftest.Install(t, 1)
	b := devicebuf.HostFromBytes(make([]byte, 16))
	defer b.Release()
	require.Error(t, devicebuf.Clear(nil))
	require.Error(t, devicebuf.CopyAsync(nil, b, b))
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	defer s.Close()
	require.Error(t, devicebuf.CopyAsync(s, nil, b))
	require.Error(t, devicebuf.Copy(b, nil))
}
