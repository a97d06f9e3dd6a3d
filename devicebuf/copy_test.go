package devicebuf_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// memKind is one kind of memory a copy test moves bytes between; fill and read move bytes in
// and out without going through the copy under test where the fake makes that possible.
type memKind struct {
	name  string
	alloc func(tb testing.TB, n int) *devicebuf.Buffer
}

func hostKinds() []memKind {
	return []memKind{
		{"host", func(tb testing.TB, n int) *devicebuf.Buffer {
			b, err := devicebuf.NewHostAllocator().Alloc(n)
			require.NoError(tb, err)
			return b
		}},
		{"pinned", func(tb testing.TB, n int) *devicebuf.Buffer {
			b, err := devicebuf.NewHostAllocator(devicebuf.Pinned()).Alloc(n)
			require.NoError(tb, err)
			return b
		}},
		{"gomem", func(tb testing.TB, n int) *devicebuf.Buffer {
			return devicebuf.HostFromBytes(make([]byte, n))
		}},
	}
}

func cudaKind(dev int) memKind {
	return memKind{fmt.Sprintf("cuda%d", dev), func(tb testing.TB, n int) *devicebuf.Buffer {
		a, err := devicebuf.NewCUDAAllocator(dev)
		require.NoError(tb, err)
		b, err := a.Alloc(n)
		require.NoError(tb, err)
		return b
	}}
}

// access moves test bytes into and out of a buffer of any kind.
type access interface {
	fill(tb testing.TB, b *devicebuf.Buffer, p []byte)
	read(tb testing.TB, b *devicebuf.Buffer) []byte
}

// fakeAccess reaches fake device memory through the fake's alias, independent of Copy; read
// returns a view of the memory itself.
type fakeAccess struct{ g *devicebuftest.GPU }

func (f fakeAccess) fill(tb testing.TB, b *devicebuf.Buffer, p []byte) {
	tb.Helper()
	if b.Kind() == devicebuf.Host {
		hb, err := b.HostBytes()
		require.NoError(tb, err)
		copy(hb, p)
		return
	}
	require.NoError(tb, f.g.Poke(b.Ptr(), p))
}

func (f fakeAccess) read(tb testing.TB, b *devicebuf.Buffer) []byte {
	tb.Helper()
	if b.Kind() == devicebuf.Host {
		hb, err := b.HostBytes()
		require.NoError(tb, err)
		return hb
	}
	p, err := f.g.View(b.Ptr(), b.Len())
	require.NoError(tb, err)
	return p
}

// copyAccess reaches device memory through Copy and a host buffer (for the real GPU).
type copyAccess struct{}

func (copyAccess) fill(tb testing.TB, b *devicebuf.Buffer, p []byte) {
	tb.Helper()
	h := devicebuf.HostFromBytes(p)
	defer h.Release()
	require.NoError(tb, devicebuf.Copy(b, h))
}

func (copyAccess) read(tb testing.TB, b *devicebuf.Buffer) []byte {
	tb.Helper()
	p := make([]byte, b.Len())
	h := devicebuf.HostFromBytes(p)
	defer h.Release()
	require.NoError(tb, devicebuf.Copy(h, b))
	return p
}

// testCopyPairs copies between every pair of kinds at every size, synchronously and on a
// stream (the stream on device dev), checking the bytes and that nothing leaks.
func testCopyPairs(t *testing.T, acc access, kinds []memKind, sizes []int, streamDev int) {
	base := devicebuf.Live()
	seed := uint64(10)
	for _, n := range sizes {
		for _, sk := range kinds {
			for _, dk := range kinds {
				seed++
				t.Run(fmt.Sprintf("size=%s/%s-to-%s", sizeName(n), sk.name, dk.name), func(t *testing.T) {
					want := pattern(seed, n)
					src, dst := sk.alloc(t, n), dk.alloc(t, n)
					acc.fill(t, src, want)
					require.NoError(t, devicebuf.Copy(dst, src))
					requireBytes(t, want, acc.read(t, dst), "sync copy")
					requireBytes(t, want, acc.read(t, src), "source unchanged")

					// The same on a stream, into a view at an offset of a fresh destination.
					want2 := pattern(seed+1000, n)
					acc.fill(t, src, want2)
					big := dk.alloc(t, n+64)
					view, err := big.Slice(64, n)
					require.NoError(t, err)
					require.NoError(t, big.Release())
					s, err := devicebuf.NewStream(streamDev)
					require.NoError(t, err)
					require.NoError(t, devicebuf.CopyAsync(s, view, src))
					// The stream holds the buffers until the copy is known complete.
					require.NoError(t, src.Release())
					require.NoError(t, s.Synchronize())
					requireBytes(t, want2, acc.read(t, view), "async copy")
					require.NoError(t, s.Close())
					require.NoError(t, s.Close(), "Close is idempotent")
					require.NoError(t, view.Release())
					require.NoError(t, dst.Release())
				})
			}
		}
	}
	requireLive(t, base)
}

func TestCopyEveryPairFake(t *testing.T) {
	g := devicebuftest.Install(t, 2)
	kinds := append(hostKinds(), cudaKind(0), cudaKind(1))
	testCopyPairs(t, fakeAccess{g}, kinds, []int{1, 3, 4096, 65537, 1<<20 + 3}, 0)
	require.Zero(t, g.Allocations())
	require.Zero(t, g.HostRegistrations())
}

// TestCopyLargeFake moves 256 MiB through every direction once.
func TestCopyLargeFake(t *testing.T) {
	if testing.Short() {
		t.Skip("large copies skipped in -short")
	}
	g := devicebuftest.Install(t, 2)
	testCopyLarge(t, fakeAccess{g}, 1, []int{256 << 20})
}

// testCopyLarge moves each size through every direction once: host to device, device to
// device on one device and to the last device, device to pinned host.
func testCopyLarge(t *testing.T, acc access, lastDev int, sizes []int) {
	base := devicebuf.Live()
	for _, n := range sizes {
		t.Run("size="+sizeName(n), func(t *testing.T) {
			want := pattern(uint64(n), n)
			h := hostKinds()[0].alloc(t, n)
			acc.fill(t, h, want)
			d0, d0b, d1 := cudaKind(0).alloc(t, n), cudaKind(0).alloc(t, n), cudaKind(lastDev).alloc(t, n)
			back := hostKinds()[1].alloc(t, n)
			steps := []struct {
				name     string
				dst, src *devicebuf.Buffer
			}{
				{"host-to-cuda0", d0, h}, {"cuda0-to-cuda0", d0b, d0},
				{fmt.Sprintf("cuda0-to-cuda%d", lastDev), d1, d0b}, {fmt.Sprintf("cuda%d-to-pinned", lastDev), back, d1},
			}
			for _, st := range steps {
				require.NoError(t, devicebuf.Copy(st.dst, st.src), st.name)
				requireBytes(t, want, acc.read(t, st.dst), st.name)
			}
			for _, b := range []*devicebuf.Buffer{h, d0, d0b, d1, back} {
				require.NoError(t, b.Release())
			}
		})
	}
	requireLive(t, base)
}

func TestCopyAsyncOrdering(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	n := 1 << 16
	host := hostKinds()[0].alloc(t, n)
	dev := cudaKind(0).alloc(t, n)
	hb, _ := host.HostBytes()
	copy(hb, pattern(7, n))
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	require.NoError(t, devicebuf.CopyAsync(s, dev, host))
	// The fake runs queued copies only at Synchronize: nothing has landed yet.
	early, err := g.Peek(dev.Ptr(), n)
	require.NoError(t, err)
	require.Equal(t, make([]byte, n), early)
	require.Equal(t, int64(1), devicebuf.Live().Sub(base).Streams)
	require.NoError(t, s.Synchronize())
	late, err := g.Peek(dev.Ptr(), n)
	require.NoError(t, err)
	requireBytes(t, hb, late, "after Synchronize")
	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Synchronize(), errClosed)
	require.ErrorIs(t, devicebuf.CopyAsync(s, dev, host), errClosed)
	require.NoError(t, host.Release())
	require.NoError(t, dev.Release())
	requireLive(t, base)
}

func TestCopyErrors(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	a := hostKinds()[0].alloc(t, 100)
	b := hostKinds()[0].alloc(t, 101)
	d := cudaKind(0).alloc(t, 100)
	require.ErrorContains(t, devicebuf.Copy(a, b), "sizes must match")
	require.ErrorContains(t, devicebuf.Copy(d, b), "sizes must match")
	require.Error(t, devicebuf.Copy(nil, a))

	hs, err := devicebuf.NewStream(-1)
	require.NoError(t, err)
	require.Equal(t, -1, hs.Device())
	require.ErrorContains(t, devicebuf.CopyAsync(hs, d, a), "host-only stream")
	require.NoError(t, hs.Close())
	_, err = devicebuf.NewStream(5)
	require.Error(t, err)

	require.NoError(t, b.Release())
	require.ErrorIs(t, devicebuf.Copy(a, b), devicebuf.ErrReleased)
	require.NoError(t, a.Release())
	require.NoError(t, d.Release())
	requireLive(t, base)
}

func TestCopyZeroLength(t *testing.T) {
	base := devicebuf.Live()
	a, b := devicebuf.HostFromBytes(nil), devicebuf.HostFromBytes([]byte{})
	require.NoError(t, devicebuf.Copy(a, b))
	require.NoError(t, a.Release())
	require.NoError(t, b.Release())
	requireLive(t, base)
}

// testConcurrentCopies runs round trips host -> device -> device -> host from several
// goroutines at once, each on its own buffers, half of them on streams: the CUDA context
// must be current on whatever thread runs each call.
func testConcurrentCopies(t *testing.T, dev int) {
	base := devicebuf.Live()
	const workers, rounds, n = 8, 20, 256<<10 + 7
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func() {
			errs <- func() error {
				a, err := devicebuf.NewCUDAAllocator(dev)
				if err != nil {
					return err
				}
				d1, err := a.Alloc(n)
				if err != nil {
					return err
				}
				defer d1.Release()
				d2, err := a.Alloc(n)
				if err != nil {
					return err
				}
				defer d2.Release()
				var s *devicebuf.Stream
				if w%2 == 1 {
					if s, err = devicebuf.NewStream(dev); err != nil {
						return err
					}
					defer s.Close()
				}
				for r := 0; r < rounds; r++ {
					want := pattern(uint64(w*1000+r), n)
					in, out := devicebuf.HostFromBytes(want), devicebuf.HostFromBytes(make([]byte, n))
					if s == nil {
						err = errors.Join(devicebuf.Copy(d1, in), devicebuf.Copy(d2, d1), devicebuf.Copy(out, d2))
					} else {
						err = errors.Join(devicebuf.CopyAsync(s, d1, in), devicebuf.CopyAsync(s, d2, d1),
							devicebuf.CopyAsync(s, out, d2), s.Synchronize())
					}
					got, _ := out.HostBytes()
					if err == nil && !bytes.Equal(want, got) {
						err = fmt.Errorf("worker %d round %d: bytes differ", w, r)
					}
					in.Release()
					out.Release()
					if err != nil {
						return err
					}
				}
				return nil
			}()
		}()
	}
	for w := 0; w < workers; w++ {
		require.NoError(t, <-errs)
	}
	requireLive(t, base)
}

func TestConcurrentCopiesFake(t *testing.T) {
	devicebuftest.Install(t, 1)
	testConcurrentCopies(t, 0)
}

// Clear zeroes device memory on the device (the fake GPU's memory faults on a CPU touch)
// and host memory in place, exactly the buffer's bytes.
func TestClear(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	whole, err := gpu.Alloc(4096)
	require.NoError(t, err)
	defer whole.Release()
	require.NoError(t, g.Poke(whole.Ptr(), bytes.Repeat([]byte{0xab}, 4096)))
	mid, err := whole.Slice(1000, 2000)
	require.NoError(t, err)
	require.NoError(t, devicebuf.Clear(mid))
	mid.Release()
	got, err := g.Peek(whole.Ptr(), 4096)
	require.NoError(t, err)
	require.Equal(t, bytes.Repeat([]byte{0xab}, 1000), got[:1000])
	require.Equal(t, make([]byte, 2000), got[1000:3000])
	require.Equal(t, bytes.Repeat([]byte{0xab}, 1096), got[3000:])

	host, err := devicebuf.NewHostAllocator().Alloc(64)
	require.NoError(t, err)
	defer host.Release()
	hb, err := host.HostBytes()
	require.NoError(t, err)
	copy(hb, bytes.Repeat([]byte{1}, 64))
	require.NoError(t, devicebuf.Clear(host))
	require.Equal(t, make([]byte, 64), hb)
}

// OwnIPC tells a handle this process exported (a peer echoing one back) from any other, and
// forgets it once the allocation is gone.
func TestOwnIPC(t *testing.T) {
	devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	b, err := gpu.Alloc(4096)
	require.NoError(t, err)
	h, _, err := devicebuf.ExportIPC(b)
	require.NoError(t, err)
	require.True(t, devicebuf.OwnIPC(h))
	var other devicebuf.IPCHandle
	other[0] = 1
	require.False(t, devicebuf.OwnIPC(other))
	require.NoError(t, b.Release())
	require.False(t, devicebuf.OwnIPC(h), "a freed allocation's handle")
}

// A failed wait of a stream lets go of none of the buffers of the copies
// queued on it: a failure that is not sticky leaves them going, and a buffer
// given back could be freed, or handed to another transfer, under the copy.
// They go once a later wait succeeded; a stream closed by a failed wait
// keeps them for good.
func TestFailedSyncKeepsBuffers(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	const n = 4096
	queue := func(t *testing.T) (*devicebuf.Stream, *devicebuf.Buffer, []byte) {
		src := hostKinds()[2].alloc(t, n)
		hb, _ := src.HostBytes()
		copy(hb, pattern(3, n))
		dst := cudaKind(0).alloc(t, n)
		s, err := devicebuf.NewStream(0)
		require.NoError(t, err)
		require.NoError(t, devicebuf.CopyAsync(s, dst, src))
		require.NoError(t, src.Release()) // the stream's reference is left
		return s, dst, bytes.Clone(hb)
	}

	t.Run("a later wait", func(t *testing.T) {
		s, dst, want := queue(t)
		require.NoError(t, g.FailSyncs(s.Handle(), 1))
		require.Error(t, s.Synchronize())
		require.Equal(t, int64(1), devicebuf.Live().Sub(base).HostBuffers, "the source went back under its copy")
		require.NoError(t, s.Synchronize())
		require.Zero(t, devicebuf.Live().Sub(base).HostBuffers)
		got, err := g.Peek(dst.Ptr(), n)
		require.NoError(t, err)
		requireBytes(t, want, got, "after the wait that succeeded")
		require.NoError(t, dst.Release())
		require.NoError(t, s.Close())
	})

	t.Run("by event", func(t *testing.T) {
		s, dst, _ := queue(t)
		ev, err := devicebuf.NewEvent(0)
		require.NoError(t, err)
		require.NoError(t, g.FailSyncs(s.Handle(), 1))
		require.NoError(t, ev.Close()) // the event fails, and then the stream's wait
		require.Error(t, s.SynchronizeBy(ev))
		require.Equal(t, int64(1), devicebuf.Live().Sub(base).HostBuffers)
		require.NoError(t, dst.Release())
		require.Equal(t, int64(1), devicebuf.Live().Sub(base).CUDABuffers, "the destination went back under its copy")
		require.NoError(t, s.Close())
		require.True(t, devicebuf.Live().Sub(base).IsZero(), "%+v", devicebuf.Live().Sub(base))
	})

	t.Run("closed", func(t *testing.T) {
		s, dst, _ := queue(t)
		require.NoError(t, dst.Release())
		require.NoError(t, g.FailSyncs(s.Handle(), 1))
		require.Error(t, s.Close())
		require.Equal(t, int64(1), devicebuf.Live().Sub(base).CUDABuffers, "the destination went back under its copy")
		require.Equal(t, 1, g.Allocations())
		require.Equal(t, 1, devicebuf.ReleaseStranded())
		require.True(t, devicebuf.Live().Sub(base).IsZero(), "%+v", devicebuf.Live().Sub(base))
	})
}

// A synchronous copy or clear whose wait failed after its work was queued
// (the driver's ErrUnsettled) holds its buffers for good: the caller's
// references go as usual, and the memory is not freed under the work.
func TestUnsettledCopyStrandsBuffers(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	const n = 4096
	src := hostKinds()[2].alloc(t, n)
	hb, _ := src.HostBytes()
	copy(hb, pattern(5, n))
	dst := cudaKind(0).alloc(t, n)
	g.FailWaits(2)
	require.ErrorIs(t, devicebuf.Copy(dst, src), devicebuf.ErrUnsettled)
	require.ErrorIs(t, devicebuf.Clear(dst), devicebuf.ErrUnsettled)
	require.NoError(t, src.Release())
	require.NoError(t, dst.Release())
	require.Equal(t, devicebuf.Counters{HostBuffers: 1, CUDABuffers: 1, CUDABytes: n},
		devicebuf.Live().Sub(base), "buffers went back under their work")
	require.Equal(t, 1, g.Allocations())
	require.Equal(t, 2, g.RunStrays()) // the work lands in memory still held
	require.Equal(t, 2, devicebuf.ReleaseStranded())
	require.True(t, devicebuf.Live().Sub(base).IsZero(), "%+v", devicebuf.Live().Sub(base))
}
