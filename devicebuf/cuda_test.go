package devicebuf_test

import (
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/internal/testenv"
)

func TestFakeDevices(t *testing.T) {
	g := devicebuftest.Install(t, 2)
	require.NoError(t, devicebuf.CUDAAvailable())
	n, err := devicebuf.DeviceCount()
	require.NoError(t, err)
	require.Equal(t, 2, n)
	v, err := devicebuf.DriverVersion()
	require.NoError(t, err)
	require.Positive(t, v)
	u, err := devicebuf.DeviceUUIDOf(1)
	require.NoError(t, err)
	require.Equal(t, g.UUID(1), u)
	require.Regexp(t, `^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`, u)
	require.NotEqual(t, g.UUID(0), g.UUID(1))

	_, err = devicebuf.NewCUDAAllocator(2)
	require.ErrorContains(t, err, "out of range")
	_, err = devicebuf.NewCUDAAllocator(-1)
	require.Error(t, err)
	_, err = devicebuf.Attributes(7)
	require.Error(t, err)

	a, err := devicebuf.NewCUDAAllocator(1)
	require.NoError(t, err)
	require.Equal(t, devicebuf.CUDA, a.Kind())
	require.Equal(t, 1, a.Device())
	_, err = a.Alloc(0)
	require.Error(t, err)
	g.SetMemory(1, 1<<20)
	_, err = a.Alloc(2 << 20)
	require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
}

func TestAttributesAndFlush(t *testing.T) {
	g := devicebuftest.Install(t, 2)
	at, err := devicebuf.Attributes(0)
	require.NoError(t, err)
	require.Equal(t, devicebuf.DeviceAttrs{GPUDirectRDMASupported: true, FlushWritesOptions: devicebuf.FlushWritesOptionHost,
		WritesOrdering: devicebuf.WritesOrderingOwner}, at)

	// Writes ordered for the owner: no flush call.
	need, err := devicebuf.NeedsRDMAFlush(0)
	require.NoError(t, err)
	require.False(t, need)
	require.NoError(t, devicebuf.FlushRDMAWrites(0))
	require.Zero(t, g.Flushes(0))

	// Pre-Hopper style: no ordering, host flush offered: the flush is called (and a change
	// of the fake's attributes after a first read is seen).
	need, err = devicebuf.NeedsRDMAFlush(1)
	require.NoError(t, err)
	require.False(t, need)
	g.SetAttrs(1, devicebuf.DeviceAttrs{GPUDirectRDMASupported: true, FlushWritesOptions: devicebuf.FlushWritesOptionHost})
	need, err = devicebuf.NeedsRDMAFlush(1)
	require.NoError(t, err)
	require.True(t, need)
	require.NoError(t, devicebuf.FlushRDMAWrites(1))
	require.NoError(t, devicebuf.FlushRDMAWrites(1))
	require.Equal(t, 2, g.Flushes(1))
	require.Zero(t, g.Flushes(0))
}

func TestFlushWithoutOption(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	g.SetAttrs(0, devicebuf.DeviceAttrs{})
	err := devicebuf.FlushRDMAWrites(0)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	require.Zero(t, g.Flushes(0))
}

func TestIPCInProcessFake(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	testIPCInProcess(t, fakeAccess{g})
	require.Zero(t, g.Allocations())

	// A pool block exports its region's handle and its offset in the region.
	a, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{Backing: a, Classes: []int{4096}, RegionBytes: 64 << 10})
	require.NoError(t, err)
	b1, err := p.Alloc(100)
	require.NoError(t, err)
	b2, err := p.Alloc(100)
	require.NoError(t, err)
	h1, off1, err := devicebuf.ExportIPC(b1)
	require.NoError(t, err)
	h2, off2, err := devicebuf.ExportIPC(b2)
	require.NoError(t, err)
	require.Equal(t, h1, h2, "one handle per region")
	root, off := b2.Root()
	require.Equal(t, off, off2)
	require.NotEqual(t, off1, off2)
	m, err := devicebuf.OpenIPC(h2, 0)
	require.NoError(t, err)
	require.Equal(t, root.Ptr(), m.Ptr())
	require.NoError(t, m.Release())
	require.NoError(t, b1.Release())
	require.NoError(t, b2.Release())
	require.NoError(t, p.Close())
	require.Zero(t, g.Allocations())

	host, err := devicebuf.NewHostAllocator().Alloc(10)
	require.NoError(t, err)
	_, _, err = devicebuf.ExportIPC(host)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	require.NoError(t, host.Release())
	var bad devicebuf.IPCHandle
	_, err = devicebuf.OpenIPC(bad, 0)
	require.Error(t, err)
}

// testIPCInProcess opens a handle this process exported: OpenIPC gives the exporting
// allocation itself (the CUDA driver refuses a process's own handles), which it keeps alive.
func testIPCInProcess(t *testing.T, acc access) {
	base := devicebuf.Live()
	a, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	alloc, err := a.Alloc(3 << 20)
	require.NoError(t, err)
	b, err := alloc.Slice(1<<20, 1<<20)
	require.NoError(t, err)
	h, off, err := devicebuf.ExportIPC(b)
	require.NoError(t, err)
	require.Equal(t, 1<<20, off)
	h2, off2, err := devicebuf.ExportIPC(alloc)
	require.NoError(t, err)
	require.Equal(t, h, h2, "one handle per allocation")
	require.Zero(t, off2)

	m1, err := devicebuf.OpenIPC(h, 0)
	require.NoError(t, err)
	m2, err := devicebuf.OpenIPC(h, 0)
	require.NoError(t, err)
	require.Equal(t, alloc.Ptr(), m1.Ptr(), "the exporter's own memory")
	require.Equal(t, alloc.Ptr(), m2.Ptr())
	require.Equal(t, 3<<20, m1.Len())
	require.Equal(t, 0, m1.Device())
	require.Zero(t, devicebuf.Live().Sub(base).IPCMappings, "no driver mapping")

	// Bytes written through the opened buffer land in the exporter's allocation, also after
	// the exporter released it.
	v, err := m1.Slice(off, 1<<20)
	require.NoError(t, err)
	want := pattern(9, 1<<20)
	src := devicebuf.HostFromBytes(want)
	require.NoError(t, devicebuf.Copy(v, src))
	requireBytes(t, want, acc.read(t, b), "through the opened handle")
	require.NoError(t, b.Release())
	require.NoError(t, alloc.Release())
	want2 := pattern(10, 1<<20)
	acc.fill(t, src, want2)
	require.NoError(t, devicebuf.Copy(v, src))
	requireBytes(t, want2, acc.read(t, v), "after the exporter let go")

	require.NoError(t, m1.Release())
	require.NoError(t, v.Release())
	require.NoError(t, m2.Release())
	require.NoError(t, src.Release())
	requireLive(t, base)

	// Once the memory is gone the handle is no longer this process's: the driver is asked,
	// and refuses.
	_, err = devicebuf.OpenIPC(h, 0)
	require.Error(t, err)
}

func TestIPCAcrossProcessesFake(t *testing.T) {
	devicebuftest.Install(t, 1)
	testIPCAcrossProcesses(t, "fake", 1<<20+5)
}

func TestPinnedHostFake(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	b, err := devicebuf.NewHostAllocator(devicebuf.Pinned()).Alloc(5000)
	require.NoError(t, err)
	require.Equal(t, 1, g.HostRegistrations())
	require.Equal(t, int64(1), devicebuf.Live().Sub(base).PinnedRegions)
	require.NoError(t, b.Release())
	require.Zero(t, g.HostRegistrations())
	requireLive(t, base)
}

func TestInventoryFake(t *testing.T) {
	g := devicebuftest.Install(t, 3)
	gpus, err := devicebuf.Inventory()
	require.NoError(t, err)
	require.Len(t, gpus, 3)
	for i, gpu := range gpus {
		require.Equal(t, i, gpu.Index)
		require.Equal(t, g.UUID(i), gpu.UUID)
		require.NotEmpty(t, gpu.Name)
		require.NotEmpty(t, gpu.PCIBusID)
		require.Equal(t, uint64(devicebuftest.DefaultMemory), gpu.MemoryBytes)
	}
}

func TestNotSupportedFake(t *testing.T) {
	devicebuftest.InstallAbsent(t, "no libcuda.so.1 here")
	err := devicebuf.CUDAAvailable()
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	require.ErrorContains(t, err, "no libcuda.so.1 here")
	_, err = devicebuf.DeviceCount()
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	_, err = devicebuf.NewCUDAAllocator(0)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	_, err = devicebuf.NewStream(0)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	_, err = devicebuf.Attributes(0)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	require.ErrorIs(t, devicebuf.FlushRDMAWrites(0), devicebuf.ErrNotSupported)
	_, err = devicebuf.OpenIPC(devicebuf.IPCHandle{}, 0)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	_, err = devicebuf.Inventory()
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)

	// Host memory still works; Pinned quietly does nothing without a driver.
	base := devicebuf.Live()
	b, err := devicebuf.NewHostAllocator(devicebuf.Pinned()).Alloc(100)
	require.NoError(t, err)
	require.Zero(t, devicebuf.Live().Sub(base).PinnedRegions)
	s, err := devicebuf.NewStream(-1)
	require.NoError(t, err)
	c := devicebuf.HostFromBytes(make([]byte, 100))
	require.NoError(t, devicebuf.CopyAsync(s, c, b))
	require.NoError(t, s.Close())
	require.NoError(t, b.Release())
	require.NoError(t, c.Release())
	requireLive(t, base)
}

// TestRealDriverAbsent checks the real loader's answer on a host without a GPU driver: an
// error wrapping ErrNotSupported that carries the loader's message.
func TestRealDriverAbsent(t *testing.T) {
	err := devicebuf.CUDAAvailable()
	if err == nil {
		t.Skip("a CUDA driver is present")
	}
	if testenv.Required("cuda") {
		t.Fatalf("GDRPC_REQUIRE=cuda but CUDA is not available: %v", err)
	}
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	if _, statErr := os.Stat("/dev/nvidiactl"); statErr != nil {
		require.Regexp(t, `libcuda\.so\.1|without cgo`, err.Error())
	}
	_, err = devicebuf.NewCUDAAllocator(0)
	require.ErrorIs(t, err, devicebuf.ErrNotSupported)
	_, err = devicebuf.Inventory()
	if err != nil {
		require.ErrorIs(t, err, devicebuf.ErrNotSupported)
		require.Regexp(t, `libnvidia-ml\.so\.1|NVML`, err.Error())
	}
	var ce *devicebuf.CUDAError
	require.False(t, errors.As(err, &ce))
}

// TestIPCOpenOwnRacesRelease opens a process's own handle from several goroutines while the
// exporter releases the allocation: each open either gets a live buffer (that keeps the
// memory) or, once the memory is gone, an error; nothing is freed twice or leaked.
func TestIPCOpenOwnRacesRelease(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	a, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	for round := 0; round < 20; round++ {
		alloc, err := a.Alloc(4096)
		require.NoError(t, err)
		h, _, err := devicebuf.ExportIPC(alloc)
		require.NoError(t, err)
		errs := make(chan error, 4)
		for w := 0; w < 4; w++ {
			go func() {
				for i := 0; i < 50; i++ {
					m, err := devicebuf.OpenIPC(h, 0)
					if err != nil {
						break // the memory went
					}
					if m.Len() != 4096 {
						errs <- errors.New("opened another allocation")
						return
					}
					if err := m.Release(); err != nil {
						errs <- err
						return
					}
				}
				errs <- nil
			}()
		}
		require.NoError(t, alloc.Release())
		for w := 0; w < 4; w++ {
			require.NoError(t, <-errs)
		}
	}
	requireLive(t, base)
}

// A device's UUID reads as NVML and nvidia-smi print it.
func TestFormatUUID(t *testing.T) {
	u := [16]byte{0xde, 0xad, 0xbe, 0xef, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0xff}
	require.Equal(t, "GPU-deadbeef-0102-0304-0506-0708090a0bff", devicebuf.FormatUUID(u))
	require.Equal(t, "GPU-00000000-0000-0000-0000-000000000000", devicebuf.FormatUUID([16]byte{}))
}
