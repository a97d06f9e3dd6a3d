package devicebuf

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// Allocator hands out Buffers of one kind on one device.
type Allocator interface {
	// Alloc returns a Buffer of n bytes with one reference.
	Alloc(n int) (*Buffer, error)
	Kind() Kind
	// Device is the CUDA ordinal, -1 for host.
	Device() int
}

// HostOption configures NewHostAllocator.
type HostOption func(*hostAllocator)

// Pinned page-locks each allocation with CUDA (cuMemHostRegister) when a CUDA driver is
// present, so that copies to and from the GPU run at full speed and asynchronously. Without
// a driver it has no effect.
func Pinned() HostOption { return func(h *hostAllocator) { h.pinned = true } }

type hostAllocator struct {
	pinned bool
}

// NewHostAllocator returns an allocator of page-aligned host memory mapped outside the Go
// heap (anonymous mmap), suitable for registration with RDMA.
func NewHostAllocator(opts ...HostOption) Allocator {
	h := &hostAllocator{}
	for _, o := range opts {
		o(h)
	}
	return h
}

func (h *hostAllocator) Kind() Kind  { return Host }
func (h *hostAllocator) Device() int { return -1 }

var pageSize = os.Getpagesize()

func roundPage(n int) int { return (n + pageSize - 1) &^ (pageSize - 1) }

// Alloc maps n bytes (rounded up to whole pages; Len() is n), zeroed.
func (h *hostAllocator) Alloc(n int) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("devicebuf: alloc of %d bytes", n)
	}
	size := roundPage(n)
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("devicebuf: mmap %d bytes: %w", size, err)
	}
	base := sliceAddr(mem)
	var d driver.Driver
	if h.pinned {
		if cd, err := cudaDriver(); err == nil {
			if err := cd.MemHostRegister(base, size); err != nil {
				_ = unix.Munmap(mem)
				return nil, fmt.Errorf("devicebuf: cuMemHostRegister %d bytes: %w", size, err)
			}
			d = cd
			live.pinned.Add(1)
		}
	}
	live.bytes[Host].Add(int64(size))
	a := newAllocation(Host, -1, func() {
		if d != nil {
			_ = d.MemHostUnregister(base)
			live.pinned.Add(-1)
		}
		_ = unix.Munmap(mem)
		live.bytes[Host].Add(-int64(size))
	})
	a.base = base
	a.host = mem
	return a.newRoot(base, n), nil
}
