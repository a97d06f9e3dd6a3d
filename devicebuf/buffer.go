package devicebuf

import (
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// Kind says where a Buffer's memory lies.
type Kind uint8

// Kinds of memory.
const (
	// Host is CPU memory; only Host memory may be read or written by the CPU.
	Host Kind = iota
	// CUDA is device memory of a CUDA GPU; the CPU never touches it.
	CUDA
)

// String returns "host" or "cuda".
func (k Kind) String() string {
	switch k {
	case Host:
		return "host"
	case CUDA:
		return "cuda"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Buffer is a region of memory somewhere: a pointer, a length, a kind and a device. Its
// memory is never dereferenced by the CPU unless Kind() == Host.
//
// A Buffer is reference counted: it starts with one reference; Retain adds one, Release
// drops one, and the last Release of the last handle onto an allocation gives the memory
// back (to its pool, or freed). A view made by Slice is a handle of its own, released
// separately, that keeps the allocation alive. Methods are safe for concurrent use.
type Buffer struct {
	ptr  uintptr
	n    int
	refs atomic.Int32
	a    *allocation
}

// allocation is what one or more Buffer handles point into; its free runs when the last
// handle goes.
type allocation struct {
	kind    Kind
	dev     int
	uuid    string
	base    uintptr // start of host (CPU view) for Host memory
	host    []byte  // CPU view of the whole allocation (Host only); for Go memory it keeps it reachable
	goMem   bool
	drv     driver.Driver // the driver that made or maps CUDA memory
	region  *Buffer       // what Root reports: the buffer this allocation lies in (itself if none)
	reg     any
	handles atomic.Int64
	free    func()
	export  atomic.Pointer[exportEntry] // the IPC handle exported for this allocation
	freed   bool                        // set under exports' lock once export was set and the memory went
	arrival atomic.Pointer[Event]       // while not nil, the bytes are in place once it completes (WrapArriving)
	within  time.Duration               // how long a wait for arrival may take (0: no bound)
	// uncounted: the live counters leave out its handles (HostView).
	uncounted bool
}

func newAllocation(kind Kind, dev int, free func()) *allocation {
	if kind == Host {
		dev = -1
	}
	return &allocation{kind: kind, dev: dev, free: free}
}

// newHandle makes a Buffer with one reference onto a.
func (a *allocation) newHandle(ptr uintptr, n int) *Buffer {
	b := &Buffer{ptr: ptr, n: n, a: a}
	b.refs.Store(1)
	a.handles.Add(1)
	if !a.uncounted {
		live.buffers[a.kind].Add(1)
	}
	return b
}

// tryNewHandle is newHandle for an allocation that may be going: it fails (nil) once the
// last handle is gone.
func (a *allocation) tryNewHandle(ptr uintptr, n int) *Buffer {
	for {
		h := a.handles.Load()
		if h <= 0 {
			return nil
		}
		if a.handles.CompareAndSwap(h, h+1) {
			b := &Buffer{ptr: ptr, n: n, a: a}
			b.refs.Store(1)
			if !a.uncounted {
				live.buffers[a.kind].Add(1)
			}
			return b
		}
	}
}

// newRoot makes the first handle of a and makes it a's region.
func (a *allocation) newRoot(ptr uintptr, n int) *Buffer {
	b := a.newHandle(ptr, n)
	if a.region == nil {
		a.region = b
	}
	return b
}

// dropHandle drops one handle of a, freeing a with its last. The handle
// leaves Live's count only after that, so a count Live reports as zero
// means the memory is back too: leak checks wait on it.
func (a *allocation) dropHandle() {
	if a.handles.Add(-1) == 0 {
		if a.export.Load() != nil {
			unexport(a)
		}
		if a.free != nil {
			a.free()
		}
	}
	if !a.uncounted {
		live.buffers[a.kind].Add(-1)
	}
}

// Ptr returns the address of the first byte (a device pointer for CUDA memory).
func (b *Buffer) Ptr() uintptr { return b.ptr }

// Len returns the length in bytes.
func (b *Buffer) Len() int { return b.n }

// Kind returns where the memory lies.
func (b *Buffer) Kind() Kind { return b.a.kind }

// Device returns the CUDA device ordinal, or -1 for host memory.
func (b *Buffer) Device() int { return b.a.dev }

// DeviceUUID returns the device's UUID ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx") for CUDA
// memory, "" for host memory or when the driver could not tell.
func (b *Buffer) DeviceUUID() string { return b.a.uuid }

// GoMemory reports whether the memory is Go memory (HostFromBytes): it may be read by C
// only for the duration of one call, and must not be registered for RDMA.
func (b *Buffer) GoMemory() bool { return b.a.goMem }

// Released reports whether the last reference to this handle has been released.
func (b *Buffer) Released() bool { return b.refs.Load() <= 0 }

// Slice returns a view of n bytes at offset off. The view holds its own reference onto the
// allocation: release it separately.
func (b *Buffer) Slice(off, n int) (*Buffer, error) {
	if off < 0 || n < 0 || off > b.n || n > b.n-off {
		return nil, fmt.Errorf("devicebuf: slice [%d:+%d] out of range of %d bytes", off, n, b.n)
	}
	// b's own reference, held while the view is made: a last Release racing
	// the Slice frees the memory before or after, never under the view.
	if !b.tryRetain() {
		return nil, ErrReleased
	}
	defer b.Release()
	return b.a.newHandle(b.ptr+uintptr(off), n), nil
}

// Retain adds a reference and returns b. Retaining a released Buffer is a bug and panics.
func (b *Buffer) Retain() *Buffer {
	if !b.tryRetain() {
		panic("devicebuf: Retain of a released Buffer")
	}
	return b
}

// tryRetain adds a reference unless the last one is gone, and reports whether it did.
func (b *Buffer) tryRetain() bool {
	for {
		r := b.refs.Load()
		if r <= 0 {
			return false
		}
		if b.refs.CompareAndSwap(r, r+1) {
			return true
		}
	}
}

// retainAll takes a reference on each of bufs for an operation on their memory, so that
// a last Release racing it frees the memory only after it (releaseAll drops them). It
// fails, taking none, when one of them was released.
func retainAll(bufs ...*Buffer) bool {
	for i, b := range bufs {
		if !b.tryRetain() {
			releaseAll(bufs[:i]...)
			return false
		}
	}
	return true
}

// releaseAll drops a reference on each of bufs.
func releaseAll(bufs ...*Buffer) {
	for _, b := range bufs {
		_ = b.Release()
	}
}

// Release drops a reference. At zero the handle is gone; when the last handle onto the
// allocation goes, the memory goes back to its pool or is freed. A Release after the last
// returns ErrReleased.
func (b *Buffer) Release() error {
	for {
		r := b.refs.Load()
		if r <= 0 {
			return ErrReleased
		}
		if b.refs.CompareAndSwap(r, r-1) {
			if r == 1 {
				b.a.dropHandle()
			}
			return nil
		}
	}
}

// HostBytes returns the memory as a byte slice. Host memory only, else ErrNotHost; after the
// last Release, ErrReleased. The slice is valid until the last Release.
func (b *Buffer) HostBytes() ([]byte, error) {
	if b.a.kind != Host {
		return nil, ErrNotHost
	}
	if b.Released() {
		return nil, ErrReleased
	}
	if b.n == 0 {
		return []byte{}, nil
	}
	off := int(b.ptr - b.a.base)
	return b.a.host[off : off+b.n : off+b.n], nil
}

// Root returns the allocation (or pool region) this buffer lies in and b's offset in it. It
// does not add a reference: use it for the address, length and registration only.
func (b *Buffer) Root() (root *Buffer, off int) {
	r := b.a.region
	return r, int(b.ptr - r.ptr)
}

// Registration returns what a Pool's Registrar returned for the region this buffer lies in,
// or nil if none.
func (b *Buffer) Registration() any { return b.a.reg }

// String describes the buffer for logs.
func (b *Buffer) String() string {
	if b.a.kind == CUDA {
		return fmt.Sprintf("cuda:%d[%#x+%d]", b.a.dev, b.ptr, b.n)
	}
	return fmt.Sprintf("host[%#x+%d]", b.ptr, b.n)
}

// Wrap makes a Buffer of foreign memory: n bytes at ptr, of the given kind (device is the
// CUDA ordinal; ignored for Host). release, if not nil, runs once when the last reference
// goes. For Host memory the caller guarantees that ptr..ptr+n is mapped CPU memory for the
// Buffer's life; it must not be Go memory (use HostFromBytes for that). An unknown kind, a
// negative length or a range whose end lies past the end of the address space is a bug
// and panics.
func Wrap(ptr uintptr, n int, kind Kind, device int, release func()) *Buffer {
	if kind != Host && kind != CUDA || n < 0 {
		panic(fmt.Sprintf("devicebuf: Wrap of %d bytes of %s memory", n, kind))
	}
	if uintptr(n) > ^uintptr(0)-ptr {
		// Its end, and the addresses of views near it, would wrap around to low addresses.
		panic(fmt.Sprintf("devicebuf: Wrap of %d bytes of %s memory at %#x: past the end of the address space", n, kind, ptr))
	}
	a := newAllocation(kind, device, release)
	if kind == Host {
		a.base = ptr
		if n > 0 {
			a.host = unsafe.Slice((*byte)(uintptrToPointer(ptr)), n)
		}
	} else {
		a.drv = driver.Current()
		a.uuid = deviceUUID(a.drv, device)
	}
	return a.newRoot(ptr, n)
}

// HostFromBytes makes a Host Buffer of p without copying. p may be Go memory: the Buffer
// keeps it reachable until the last Release, reports GoMemory() == true, and such memory
// may be copied from and to (Copy, CopyAsync) but must never be registered for RDMA or
// kept by C (the Go runtime may reuse its pages once unreachable, which a registration
// would not see). Use it for data the caller owns, such as received bytes; use a host
// allocator or a Pool for memory that RDMA will touch. Release does not free p.
func HostFromBytes(p []byte) *Buffer { return hostFromBytes(p, false) }

// HostView is HostFromBytes for bytes that whatever holds them keeps and the
// garbage collector frees with it (a received message's inline payload): Live
// does not count its handles, so a view nobody releases is no leak. Release
// it all the same where the code knows it is done.
func HostView(p []byte) *Buffer { return hostFromBytes(p, true) }

func hostFromBytes(p []byte, uncounted bool) *Buffer {
	a := newAllocation(Host, -1, nil)
	a.uncounted = uncounted
	a.goMem = true
	a.host = p[:len(p):len(p)]
	if len(p) > 0 {
		a.base = uintptr(unsafe.Pointer(&p[0]))
	}
	return a.newRoot(a.base, len(p))
}

// uintptrToPointer converts an address of memory outside the Go heap (or kept reachable by
// its allocation) to a pointer.
func uintptrToPointer(p uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&p))
}

// Counters are the live objects devicebuf accounts for; tests of every layer check that
// they return to their starting values.
type Counters struct {
	HostBuffers   int64 // live Buffer handles onto host memory (views included)
	CUDABuffers   int64 // live Buffer handles onto CUDA memory (views included)
	HostBytes     int64 // host memory allocated by devicebuf allocators and not yet freed
	CUDABytes     int64 // device memory allocated by devicebuf allocators and not yet freed
	PinnedRegions int64 // host ranges page-locked with CUDA and not yet unregistered
	Regions       int64 // pool regions alive
	Registrations int64 // Registrar registrations alive
	IPCMappings   int64 // CUDA IPC handles opened and not yet closed
	Streams       int64 // streams not yet closed
	Events        int64 // events made or opened and not yet closed
}

// Sub returns c - o, field by field.
func (c Counters) Sub(o Counters) Counters {
	return Counters{
		HostBuffers: c.HostBuffers - o.HostBuffers, CUDABuffers: c.CUDABuffers - o.CUDABuffers,
		HostBytes: c.HostBytes - o.HostBytes, CUDABytes: c.CUDABytes - o.CUDABytes,
		PinnedRegions: c.PinnedRegions - o.PinnedRegions, Regions: c.Regions - o.Regions,
		Registrations: c.Registrations - o.Registrations, IPCMappings: c.IPCMappings - o.IPCMappings,
		Streams: c.Streams - o.Streams, Events: c.Events - o.Events,
	}
}

// IsZero reports whether every counter is zero.
func (c Counters) IsZero() bool { return c == Counters{} }

var live struct {
	buffers       [2]atomic.Int64
	bytes         [2]atomic.Int64
	pinned        atomic.Int64
	regions       atomic.Int64
	registrations atomic.Int64
	ipc           atomic.Int64
	streams       atomic.Int64
	events        atomic.Int64
}

// Live returns the live-object counters of this process.
func Live() Counters {
	return Counters{
		HostBuffers:   live.buffers[Host].Load(),
		CUDABuffers:   live.buffers[CUDA].Load(),
		HostBytes:     live.bytes[Host].Load(),
		CUDABytes:     live.bytes[CUDA].Load(),
		PinnedRegions: live.pinned.Load(),
		Regions:       live.regions.Load(),
		Registrations: live.registrations.Load(),
		IPCMappings:   live.ipc.Load(),
		Streams:       live.streams.Load(),
		Events:        live.events.Load(),
	}
}

// sliceAddr returns the address of p's first byte (p not empty).
func sliceAddr(p []byte) uintptr { return uintptr(unsafe.Pointer(&p[0])) }
