package devicebuf_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/internal/testenv"
)

// Tests on a real GPU: they skip without a CUDA driver unless GDRPC_REQUIRE contains cuda.

func requireCUDA(tb testing.TB) int {
	tb.Helper()
	testenv.Need(tb, "cuda", devicebuf.CUDAAvailable())
	n, err := devicebuf.DeviceCount()
	require.NoError(tb, err)
	require.Positive(tb, n, "CUDA without devices")
	return n
}

func gpuKinds(n int) []memKind {
	k := append(hostKinds(), cudaKind(0))
	if n > 1 {
		k = append(k, cudaKind(n-1))
	}
	return k
}

func TestGPUCopyEveryPair(t *testing.T) {
	n := requireCUDA(t)
	testCopyPairs(t, copyAccess{}, gpuKinds(n), []int{1, 3, 4096, 65537, 1<<20 + 3}, 0)
}

func TestGPUCopyLarge(t *testing.T) {
	n := requireCUDA(t)
	sizes := []int{64 << 20}
	if !testing.Short() {
		sizes = append(sizes, 256<<20)
	}
	testCopyLarge(t, copyAccess{}, n-1, sizes)
}

func TestGPUAttributes(t *testing.T) {
	n := requireCUDA(t)
	v, err := devicebuf.DriverVersion()
	require.NoError(t, err)
	t.Logf("CUDA driver version %d.%d", v/1000, v%1000/10)
	for dev := 0; dev < n; dev++ {
		info, err := devicebuf.Describe(dev)
		require.NoError(t, err)
		t.Logf("device %d: %+v", dev, info)
		require.Regexp(t, `^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`, info.UUID)
		require.NotEmpty(t, info.Name)
		require.Positive(t, info.MemoryBytes)
		a, err := devicebuf.Attributes(dev)
		require.NoError(t, err)
		require.Equal(t, info.Attrs, a)
		require.Contains(t, []int{devicebuf.WritesOrderingNone, devicebuf.WritesOrderingOwner, devicebuf.WritesOrderingAllDevices}, a.WritesOrdering)
		require.Zero(t, a.FlushWritesOptions&^3, "only the host and memops bits are defined")
		need, err := devicebuf.NeedsRDMAFlush(dev)
		require.NoError(t, err)
		require.Equal(t, a.WritesOrdering < devicebuf.WritesOrderingOwner, need)
		if err := devicebuf.FlushRDMAWrites(dev); err != nil {
			require.ErrorIs(t, err, devicebuf.ErrNotSupported)
			require.True(t, need)
			require.Zero(t, a.FlushWritesOptions&devicebuf.FlushWritesOptionHost)
		}
	}
}

func TestGPUInventoryAgrees(t *testing.T) {
	n := requireCUDA(t)
	gpus, err := devicebuf.Inventory()
	if err != nil && !testenv.Required("cuda") {
		t.Skipf("no NVML: %v", err)
	}
	require.NoError(t, err)
	t.Logf("NVML: %+v", gpus)
	require.GreaterOrEqual(t, len(gpus), n)
	for dev := 0; dev < n; dev++ {
		info, err := devicebuf.Describe(dev)
		require.NoError(t, err)
		g := gpus[dev]
		require.Equal(t, dev, g.Index, "CUDA devices come first, in ordinal order")
		require.Equal(t, info.UUID, g.UUID)
		require.Equal(t, info.Name, g.Name)
		require.True(t, strings.EqualFold(info.PCIBusID, g.PCIBusID), "PCI bus id: CUDA %s, NVML %s", info.PCIBusID, g.PCIBusID)
		// NVML counts memory the driver reserves for itself; CUDA does not (0.4% on an H200).
		require.InEpsilon(t, float64(info.MemoryBytes), float64(g.MemoryBytes), 0.02)
	}
	for _, g := range gpus[n:] {
		require.Equal(t, -1, g.Index)
	}
}

func TestGPUIPCAcrossProcesses(t *testing.T) {
	requireCUDA(t)
	testIPCAcrossProcesses(t, "cuda", 4<<20+5)
}

func TestGPUIPCInProcess(t *testing.T) {
	requireCUDA(t)
	testIPCInProcess(t, copyAccess{})
}

func TestGPUPoolReuse(t *testing.T) {
	n := requireCUDA(t)
	base := devicebuf.Live()
	a, err := devicebuf.NewCUDAAllocator(n - 1)
	require.NoError(t, err)
	reg := newRegistrar()
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Backing: a, Registrar: reg, MaxBytes: 256 << 20})
	require.NoError(t, err)
	var ptr uintptr
	for i := 0; i < 50; i++ {
		b, err := p.Alloc(1 << 20)
		require.NoError(t, err)
		require.Equal(t, devicebuf.CUDA, b.Kind())
		if i == 0 {
			ptr = b.Ptr()
		}
		require.Equal(t, ptr, b.Ptr(), "the block is reused")
		want := pattern(uint64(i), 1<<20)
		copyAccess{}.fill(t, b, want)
		requireBytes(t, want, copyAccess{}.read(t, b), fmt.Sprintf("round %d", i))
		require.NoError(t, b.Release())
	}
	st := p.Stats()
	require.Equal(t, int64(1), st.Registrations, "registered once")
	require.Equal(t, int64(49), st.Hits)
	require.Equal(t, []devicebuf.Kind{devicebuf.CUDA}, reg.kinds)
	require.NoError(t, p.Close())
	live, made := reg.counts()
	require.Zero(t, live)
	require.Equal(t, 1, made)
	requireLive(t, base)
}

// BenchmarkCopy measures copy bandwidth on the GPU: host to device and device to host from
// pinned and pageable memory, and device to device, at 1 MiB to 1 GiB; with -short, the
// latency of 4 KiB and 64 KiB copies instead.
func BenchmarkCopy(b *testing.B) {
	requireCUDA(b)
	pageable := devicebuf.NewHostAllocator()
	pinned := devicebuf.NewHostAllocator(devicebuf.Pinned())
	dev, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(b, err)
	cases := []struct {
		name     string
		dst, src devicebuf.Allocator
	}{
		{"dir=H2D/mem=pinned", dev, pinned},
		{"dir=H2D/mem=pageable", dev, pageable},
		{"dir=D2H/mem=pinned", pinned, dev},
		{"dir=D2H/mem=pageable", pageable, dev},
		{"dir=D2D/mem=device", dev, dev},
	}
	sizes := []int{1 << 20, 16 << 20, 256 << 20, 1 << 30}
	if testing.Short() {
		sizes = []int{4 << 10, 64 << 10} // latency of the small copies eager transfers make
	}
	for _, c := range cases {
		for _, n := range sizes {
			b.Run(c.name+"/size="+sizeName(n), func(b *testing.B) {
				dst, err := c.dst.Alloc(n)
				require.NoError(b, err)
				defer dst.Release()
				src, err := c.src.Alloc(n)
				require.NoError(b, err)
				defer src.Release()
				require.NoError(b, devicebuf.Copy(dst, src)) // warm up: page in, map
				b.SetBytes(int64(n))
				b.ReportAllocs()
				for b.Loop() {
					if err := devicebuf.Copy(dst, src); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkCopySubmit is what queueing a device-to-device copy and recording
// an interprocess event after it costs the submitting goroutine (what writing
// a payload into a peer's receive space adds to a marshal), in µs per
// submission (median), for payloads of 1, 64 and 256 MiB: back to back
// ("busy"), and by a goroutine that was parked for at least 200 µs before
// each (a timer; on a virtual machine it may take a millisecond), as a
// handler between calls ("after-idle"): its thread and core went idle
// meanwhile. A submission that takes about as long as the copy itself
// (copy-µs, the submission and the wait for the copy) does not overlap the
// copy with the response.
func BenchmarkCopySubmit(b *testing.B) {
	requireCUDA(b)
	dev, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(b, err)
	s, err := devicebuf.NewCopyStream(0)
	require.NoError(b, err)
	defer s.Close()
	ev, _, err := devicebuf.NewIPCEvent(0)
	require.NoError(b, err)
	defer ev.Close()
	for _, n := range []int{1 << 20, 64 << 20, 256 << 20} {
		dst, err := dev.Alloc(n)
		require.NoError(b, err)
		defer dst.Release()
		src, err := dev.Alloc(n)
		require.NoError(b, err)
		defer src.Release()
		for _, idle := range []time.Duration{0, 200 * time.Microsecond} {
			name := "busy"
			if idle > 0 {
				name = "after-idle"
			}
			b.Run(fmt.Sprintf("size=%dMiB/%s", n>>20, name), func(b *testing.B) {
				var took, whole []float64
				for b.Loop() {
					if idle > 0 {
						<-time.After(idle) // the goroutine parks, as between calls
					}
					start := time.Now()
					if err := devicebuf.CopyAsync(s, dst, src); err != nil {
						b.Fatal(err)
					}
					if err := s.Record(ev); err != nil {
						b.Fatal(err)
					}
					took = append(took, float64(time.Since(start).Nanoseconds())/1e3)
					if err := s.Synchronize(); err != nil {
						b.Fatal(err)
					}
					whole = append(whole, float64(time.Since(start).Nanoseconds())/1e3)
				}
				slices.Sort(took)
				slices.Sort(whole)
				b.ReportMetric(took[len(took)/2], "submit-µs")
				b.ReportMetric(whole[len(whole)/2], "copy-µs")
			})
		}
	}
}

func TestGPUConcurrentCopies(t *testing.T) {
	n := requireCUDA(t)
	testConcurrentCopies(t, n-1)
}

// BenchmarkClear is what clearing a GPU destination costs (a device memset
// and the wait for it).
func BenchmarkClear(b *testing.B) {
	requireCUDA(b)
	dev, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(b, err)
	for _, n := range []int{1 << 20, 64 << 20} {
		b.Run("size="+sizeName(n), func(b *testing.B) {
			buf, err := dev.Alloc(n)
			require.NoError(b, err)
			defer buf.Release()
			require.NoError(b, devicebuf.Clear(buf))
			b.SetBytes(int64(n))
			for b.Loop() {
				if err := devicebuf.Clear(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
