package devicebuftest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// DefaultMemory is the memory of each fake device unless SetMemory says otherwise. Fake
// device memory is backed lazily (memfd), so only what is written costs host memory.
const DefaultMemory = 64 << 30

// GPU is an installed fake CUDA driver and its devices. Its methods tune and inspect it.
type GPU struct {
	tb testing.TB

	mu       sync.Mutex
	devs     []*fakeDevice
	allocs   []*fakeAlloc // sorted by base
	nextID   uint64
	hostRegs map[uintptr]int
	streams  map[driver.Stream]*fakeStream
	nextS    driver.Stream
	events   map[driver.Event]*fakeEvent
	nextE    driver.Event
	absent   error
	// failWaits is how many of the next synchronous copies and memsets
	// fail their wait (FailWaits); strays is their work, run by RunStrays.
	failWaits int
	strays    []func()
}

type fakeDevice struct {
	uuid    [16]byte
	name    string
	busID   string
	memory  uint64
	used    uint64
	attrs   map[driver.Attribute]int
	flushes int
}

type fakeAlloc struct {
	id     uint64
	dev    int
	base   uintptr
	size   int
	fd     int
	devMap []byte // PROT_NONE: what the "device pointer" points at
	alias  []byte // read-write alias of the same memfd, used by the fake's copies only
	ipc    bool   // a mapping made by IpcOpenMemHandle (closed by IpcCloseMemHandle)
}

type fakeStream struct {
	dev     int
	pending []func() error
	// queued and ran count the work queued on the stream and the work done,
	// in order: an event recorded after the queued'th piece is complete once
	// ran reaches it.
	queued, ran uint64
	// progressing is set while a goroutine of the fake's runs pending, started
	// by a look at one of the stream's events (EventQuery).
	progressing bool
	// run is held while a synchronization runs the copies it took: another
	// one returns only after they ran, as on a real stream.
	run sync.Mutex
	// failSyncs is how many of the next synchronizations fail (FailSyncs).
	failSyncs int
}

// fakeEvent is an event of the fake, or one opened through an IPC handle of the same
// process: both share rec.
type fakeEvent struct {
	dev int
	ipc bool
	rec *eventRecord
}

// eventRecord is what an event (and every handle opened onto it) last captured: the stream
// it was recorded on, whose deferred copies a wait runs, and how much work was queued on it
// then (the event is complete once that much ran).
type eventRecord struct {
	id     uint64
	stream driver.Stream // 0: never recorded
	at     uint64
}

// queueLocked queues op on st (g.mu held).
func (st *fakeStream) queueLocked(op func() error) {
	st.pending = append(st.pending, op)
	st.queued++
}

// Install installs a fake CUDA driver with the given number of devices (and a matching fake
// NVML inventory) for the rest of tb; the previous driver is restored at cleanup, and the
// cleanup fails tb if device memory, streams, host registrations or IPC mappings of the fake
// are still live. Tests that Install must not run in parallel with each other.
//
// Device memory is a memfd mapped PROT_NONE at the device pointer, so any CPU access faults;
// the fake's copies move bytes through a hidden read-write alias of the same memfd. Async
// copies run when their stream is synchronized (or destroyed), so a caller that reads the
// destination without synchronizing sees stale bytes. Default attributes are those of a
// Hopper GPU: GPUDirect RDMA supported, host flush offered, writes ordered for the owner.
//
// IPC handles of the fake name the memfd by process id and descriptor: they open in the
// same process (which real CUDA refuses) and in another process of the same user that has
// installed the fake too.
func Install(tb testing.TB, devices int) *GPU {
	tb.Helper()
	if devices < 0 {
		tb.Fatalf("devicebuftest: %d devices", devices)
	}
	g := newGPU(tb, devices)
	install(tb, g)
	tb.Cleanup(g.checkLeaks)
	return g
}

// installed is the stack of fakes installed by live tests.
var installed struct {
	sync.Mutex
	by []testing.TB
}

// install makes g current for the rest of tb. A fake installed by another test that is still
// running (parallel tests) would see its driver swapped underneath it: that fails tb. Nested
// installs by the same test or its subtests are fine.
func install(tb testing.TB, g *GPU) {
	tb.Helper()
	installed.Lock()
	if n := len(installed.by); n > 0 {
		top := installed.by[n-1]
		if top != tb && !strings.HasPrefix(tb.Name(), top.Name()+"/") {
			installed.Unlock()
			tb.Fatalf("devicebuftest: %s installs a fake GPU while %s has one installed; tests that Install must not run in parallel", tb.Name(), top.Name())
		}
	}
	installed.by = append(installed.by, tb)
	installed.Unlock()
	restore := driver.Install(g, g)
	tb.Cleanup(func() {
		restore()
		installed.Lock()
		installed.by = installed.by[:len(installed.by)-1]
		installed.Unlock()
	})
}

// InstallAbsent installs a driver and inventory that report ErrNotSupported with reason, as
// on a host without libcuda.so.1 and libnvidia-ml.so.1, for the rest of tb.
func InstallAbsent(tb testing.TB, reason string) {
	tb.Helper()
	g := newGPU(tb, 0)
	g.absent = fmt.Errorf("devicebuftest: %s: %w", reason, driver.ErrNotSupported)
	install(tb, g)
}

func newGPU(tb testing.TB, devices int) *GPU {
	g := &GPU{tb: tb, hostRegs: map[uintptr]int{}, streams: map[driver.Stream]*fakeStream{}, nextS: 0x1000, events: map[driver.Event]*fakeEvent{}, nextE: 0x2000}
	for i := 0; i < devices; i++ {
		d := &fakeDevice{
			name:   "devicebuftest fake GPU",
			busID:  fmt.Sprintf("0000:%02x:00.0", 0x10+i),
			memory: DefaultMemory,
			attrs: map[driver.Attribute]int{
				driver.AttrGPUDirectRDMASupported:          1,
				driver.AttrGPUDirectRDMAFlushWritesOptions: driver.FlushWritesOptionHost,
				driver.AttrGPUDirectRDMAWritesOrdering:     driver.WritesOrderingOwner,
				driver.AttrUnifiedAddressing:               1,
				driver.AttrComputeCapabilityMajor:          9,
				driver.AttrComputeCapabilityMinor:          0,
			},
		}
		binary.BigEndian.PutUint32(d.uuid[0:4], 0xfa4e0000+uint32(i))
		binary.BigEndian.PutUint32(d.uuid[4:8], uint32(os.Getpid()))
		copy(d.uuid[8:], "gdrpcfak")
		g.devs = append(g.devs, d)
	}
	return g
}

func (g *GPU) checkLeaks() {
	g.mu.Lock()
	defer g.mu.Unlock()
	var errs []string
	for _, a := range g.allocs {
		if a.ipc {
			errs = append(errs, fmt.Sprintf("IPC mapping %#x (%d bytes) on device %d not closed", a.base, a.size, a.dev))
		} else {
			errs = append(errs, fmt.Sprintf("device memory %#x (%d bytes) on device %d not freed", a.base, a.size, a.dev))
		}
	}
	for p := range g.hostRegs {
		errs = append(errs, fmt.Sprintf("host memory %#x still registered", p))
	}
	for s := range g.streams {
		errs = append(errs, fmt.Sprintf("stream %#x not destroyed", uintptr(s)))
	}
	for e := range g.events {
		errs = append(errs, fmt.Sprintf("event %#x not destroyed", uintptr(e)))
	}
	if len(errs) > 0 {
		g.tb.Errorf("devicebuftest: the fake GPU was left with live objects:\n  %s", joinLines(errs))
	}
}

func joinLines(s []string) string {
	out := ""
	for i, l := range s {
		if i > 0 {
			out += "\n  "
		}
		out += l
	}
	return out
}

// UUID returns fake device dev's UUID as devicebuf formats it.
func (g *GPU) UUID(dev int) string { return devicebuf.FormatUUID(g.devs[dev].uuid) }

// SetAttrs sets the GPUDirect RDMA attributes of fake device dev.
func (g *GPU) SetAttrs(dev int, a devicebuf.DeviceAttrs) {
	g.mu.Lock()
	defer g.mu.Unlock()
	d := g.devs[dev]
	sup := 0
	if a.GPUDirectRDMASupported {
		sup = 1
	}
	d.attrs[driver.AttrGPUDirectRDMASupported] = sup
	d.attrs[driver.AttrGPUDirectRDMAFlushWritesOptions] = a.FlushWritesOptions
	d.attrs[driver.AttrGPUDirectRDMAWritesOrdering] = a.WritesOrdering
}

// SetMemory sets the memory size of fake device dev; allocations beyond it fail with
// CUDA_ERROR_OUT_OF_MEMORY.
func (g *GPU) SetMemory(dev int, bytes uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.devs[dev].memory = bytes
}

// Flushes returns how many times cuFlushGPUDirectRDMAWrites was called on device dev.
func (g *GPU) Flushes(dev int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.devs[dev].flushes
}

// Allocations returns the number of live device allocations (IPC mappings included).
func (g *GPU) Allocations() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.allocs)
}

// HostRegistrations returns the number of host ranges registered (cuMemHostRegister).
func (g *GPU) HostRegistrations() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.hostRegs)
}

// Peek copies n bytes of fake device memory at device pointer p into a new slice, through
// the fake's alias (for test assertions; production code has no such thing).
func (g *GPU) Peek(p uintptr, n int) ([]byte, error) {
	g.mu.Lock()
	b, err := g.deviceRangeLocked(-1, p, n)
	g.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return slices.Clone(b), nil
}

// View returns fake device memory [p, p+n) as the fake's read-write alias sees it, without
// copying (for test assertions; valid until the memory is freed).
func (g *GPU) View(p uintptr, n int) ([]byte, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.deviceRangeLocked(-1, p, n)
}

// Poke writes b into fake device memory at device pointer p (for test set-up).
func (g *GPU) Poke(p uintptr, b []byte) error {
	g.mu.Lock()
	d, err := g.deviceRangeLocked(-1, p, len(b))
	g.mu.Unlock()
	if err != nil {
		return err
	}
	copy(d, b)
	return nil
}

// ---- driver.Driver ----

var errInvalidValue = &driver.Error{Op: "fake", Code: 1, Name: "CUDA_ERROR_INVALID_VALUE", Desc: "invalid argument"}

func cuError(op string, code int, name, desc string) error {
	return &driver.Error{Op: op, Code: code, Name: name, Desc: desc}
}

func (g *GPU) Init() error { return g.absent }

func (g *GPU) DriverVersion() (int, error) { return 13000, g.absent }

func (g *GPU) DeviceCount() (int, error) { return len(g.devs), g.absent }

func (g *GPU) dev(op string, dev int) (*fakeDevice, error) {
	if g.absent != nil {
		return nil, g.absent
	}
	if dev < 0 || dev >= len(g.devs) {
		return nil, cuError(op, 101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal")
	}
	return g.devs[dev], nil
}

func (g *GPU) DeviceUUID(dev int) ([16]byte, error) {
	d, err := g.dev("cuDeviceGetUuid", dev)
	if err != nil {
		return [16]byte{}, err
	}
	return d.uuid, nil
}

func (g *GPU) DeviceName(dev int) (string, error) {
	d, err := g.dev("cuDeviceGetName", dev)
	if err != nil {
		return "", err
	}
	return d.name, nil
}

func (g *GPU) DevicePCIBusID(dev int) (string, error) {
	d, err := g.dev("cuDeviceGetPCIBusId", dev)
	if err != nil {
		return "", err
	}
	return d.busID, nil
}

func (g *GPU) DeviceTotalMem(dev int) (uint64, error) {
	d, err := g.dev("cuDeviceTotalMem", dev)
	if err != nil {
		return 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return d.memory, nil
}

func (g *GPU) DeviceAttribute(dev int, attr driver.Attribute) (int, error) {
	d, err := g.dev("cuDeviceGetAttribute", dev)
	if err != nil {
		return 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	v, ok := d.attrs[attr]
	if !ok {
		return 0, nil
	}
	return v, nil
}

// mapMemfd maps fd (size bytes) twice: PROT_NONE for the device pointer, read-write alias.
func mapMemfd(fd, size int) (devMap, alias []byte, err error) {
	devMap, err = unix.Mmap(fd, 0, size, unix.PROT_NONE, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("mmap PROT_NONE: %w", err)
	}
	alias, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = unix.Munmap(devMap)
		return nil, nil, fmt.Errorf("mmap alias: %w", err)
	}
	return devMap, alias, nil
}

func (g *GPU) insertLocked(a *fakeAlloc) {
	i, _ := slices.BinarySearchFunc(g.allocs, a.base, func(x *fakeAlloc, b uintptr) int {
		switch {
		case x.base < b:
			return -1
		case x.base > b:
			return 1
		}
		return 0
	})
	g.allocs = slices.Insert(g.allocs, i, a)
}

// findLocked returns the allocation holding p, or nil.
func (g *GPU) findLocked(p uintptr) *fakeAlloc {
	i, found := slices.BinarySearchFunc(g.allocs, p, func(x *fakeAlloc, b uintptr) int {
		switch {
		case x.base < b:
			return -1
		case x.base > b:
			return 1
		}
		return 0
	})
	if found {
		return g.allocs[i]
	}
	if i == 0 {
		return nil
	}
	a := g.allocs[i-1]
	if p < a.base+uintptr(a.size) {
		return a
	}
	return nil
}

func (g *GPU) removeLocked(a *fakeAlloc) {
	if i := slices.Index(g.allocs, a); i >= 0 {
		g.allocs = slices.Delete(g.allocs, i, i+1)
	}
}

func (g *GPU) MemAlloc(dev int, n int) (uintptr, error) {
	d, err := g.dev("cuMemAlloc", dev)
	if err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, errInvalidValue
	}
	size := (n + os.Getpagesize() - 1) &^ (os.Getpagesize() - 1)
	g.mu.Lock()
	if d.used+uint64(size) > d.memory {
		g.mu.Unlock()
		return 0, cuError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
	}
	d.used += uint64(size)
	g.nextID++
	id := g.nextID
	g.mu.Unlock()
	a, err := newFakeAlloc(id, dev, size)
	if err != nil {
		g.mu.Lock()
		d.used -= uint64(size)
		g.mu.Unlock()
		return 0, cuError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY", err.Error())
	}
	g.mu.Lock()
	g.insertLocked(a)
	g.mu.Unlock()
	return a.base, nil
}

func newFakeAlloc(id uint64, dev, size int) (*fakeAlloc, error) {
	fd, err := unix.MemfdCreate("devicebuftest-gpu", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("ftruncate: %w", err)
	}
	devMap, alias, err := mapMemfd(fd, size)
	if err != nil {
		_ = unix.Close(fd)
		return nil, err
	}
	return &fakeAlloc{id: id, dev: dev, base: uintptr(unsafe.Pointer(&devMap[0])), size: size, fd: fd, devMap: devMap, alias: alias}, nil
}

func (a *fakeAlloc) unmap() {
	_ = unix.Munmap(a.devMap)
	_ = unix.Munmap(a.alias)
	_ = unix.Close(a.fd)
}

func (g *GPU) MemFree(dev int, p uintptr) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	a := g.findLocked(p)
	if a == nil || a.base != p || a.ipc {
		g.mu.Unlock()
		return cuError("cuMemFree", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("%#x is not a device allocation", p))
	}
	g.removeLocked(a)
	g.devs[a.dev].used -= uint64(a.size)
	g.mu.Unlock()
	a.unmap()
	return nil
}

func (g *GPU) SetSyncMemops(dev int, p uintptr) error {
	if _, err := g.dev("cuPointerSetAttribute", dev); err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.findLocked(p) == nil {
		return cuError("cuPointerSetAttribute", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("%#x is not device memory", p))
	}
	return nil
}

func (g *GPU) MemAddressRange(dev int, p uintptr) (uintptr, int, error) {
	if _, err := g.dev("cuMemGetAddressRange", dev); err != nil {
		return 0, 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	a := g.findLocked(p)
	if a == nil {
		return 0, 0, cuError("cuMemGetAddressRange", 400, "CUDA_ERROR_INVALID_HANDLE", fmt.Sprintf("%#x is not device memory", p))
	}
	return a.base, a.size, nil
}

func (g *GPU) MemHostRegister(p uintptr, n int) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.findLocked(p) != nil {
		return errInvalidValue
	}
	if _, ok := g.hostRegs[p]; ok {
		return cuError("cuMemHostRegister", 712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped")
	}
	g.hostRegs[p] = n
	return nil
}

func (g *GPU) MemHostUnregister(p uintptr) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.hostRegs[p]; !ok {
		return cuError("cuMemHostUnregister", 713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region")
	}
	delete(g.hostRegs, p)
	return nil
}

// deviceRangeLocked returns the alias bytes of device memory [p, p+n), checking that it lies
// in one allocation (of device dev unless dev < 0).
func (g *GPU) deviceRangeLocked(dev int, p uintptr, n int) ([]byte, error) {
	a := g.findLocked(p)
	if a == nil {
		return nil, cuError("cuMemcpy", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("%#x is not device memory", p))
	}
	if dev >= 0 && a.dev != dev {
		return nil, cuError("cuMemcpy", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("%#x is memory of device %d, not %d", p, a.dev, dev))
	}
	off := int(p - a.base)
	if n < 0 || n > a.size-off {
		return nil, cuError("cuMemcpy", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("[%#x+%d] runs past the allocation [%#x+%d]", p, n, a.base, a.size))
	}
	return a.alias[off : off+n : off+n], nil
}

// hostRangeLocked returns host memory [p, p+n), refusing fake device memory.
func (g *GPU) hostRangeLocked(p uintptr, n int) ([]byte, error) {
	if p == 0 {
		return nil, errInvalidValue
	}
	if a := g.findLocked(p); a != nil || g.findLocked(p+uintptr(n)-1) != nil {
		return nil, cuError("cuMemcpy", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("host pointer %#x is device memory", p))
	}
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n), nil
}

func (g *GPU) Memcpy(dir driver.Dir, dstDev int, dst uintptr, srcDev int, src uintptr, n int, s driver.Stream) error {
	if g.absent != nil {
		return g.absent
	}
	if n == 0 {
		return nil
	}
	g.mu.Lock()
	var d, sb []byte
	var err error
	switch dir {
	case driver.HtoD:
		if d, err = g.deviceRangeLocked(dstDev, dst, n); err == nil {
			sb, err = g.hostRangeLocked(src, n)
		}
	case driver.DtoH:
		if d, err = g.hostRangeLocked(dst, n); err == nil {
			sb, err = g.deviceRangeLocked(srcDev, src, n)
		}
	case driver.DtoD:
		if d, err = g.deviceRangeLocked(dstDev, dst, n); err == nil {
			sb, err = g.deviceRangeLocked(srcDev, src, n)
		}
	default:
		err = errInvalidValue
	}
	if err != nil {
		g.mu.Unlock()
		return err
	}
	if s == 0 {
		if g.strayLocked(func() { copy(d, sb) }) {
			g.mu.Unlock()
			return errUnsettled("cuMemcpyAsync")
		}
		g.mu.Unlock()
		copy(d, sb)
		return nil
	}
	st, ok := g.streams[s]
	if !ok {
		g.mu.Unlock()
		return cuError("cuMemcpyAsync", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown stream")
	}
	st.queueLocked(func() error { copy(d, sb); return nil })
	g.mu.Unlock()
	return nil
}

func (g *GPU) MemsetZero(dev int, p uintptr, n int) error {
	if g.absent != nil {
		return g.absent
	}
	if n == 0 {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	d, err := g.deviceRangeLocked(dev, p, n)
	if err != nil {
		return err
	}
	if g.strayLocked(func() { clear(d) }) {
		return errUnsettled("cuMemsetD8Async")
	}
	clear(d)
	return nil
}

// FailWaits makes the next n synchronous copies and memsets (Memcpy on no
// stream, MemsetZero) fail their wait as a failure that is not sticky does:
// the work is queued, the call returns an error wrapping the driver's
// ErrUnsettled, and the work runs when RunStrays is called, into whatever
// memory its addresses then name.
func (g *GPU) FailWaits(n int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.failWaits = n
}

// RunStrays runs the work of the waits FailWaits failed, and returns how
// much there was.
func (g *GPU) RunStrays() int {
	g.mu.Lock()
	strays := g.strays
	g.strays = nil
	g.mu.Unlock()
	for _, f := range strays {
		f()
	}
	return len(strays)
}

// strayLocked keeps work as a stray, and reports true, where FailWaits asks
// for its wait to fail.
func (g *GPU) strayLocked(work func()) bool {
	if g.failWaits == 0 {
		return false
	}
	g.failWaits--
	g.strays = append(g.strays, work)
	return true
}

func errUnsettled(call string) error {
	return fmt.Errorf("%w: %w", driver.ErrUnsettled, cuError(call, 201, "CUDA_ERROR_INVALID_CONTEXT", "a failure FailWaits asked for"))
}

func (g *GPU) StreamCreate(dev int, blocking bool) (driver.Stream, error) {
	if _, err := g.dev("cuStreamCreate", dev); err != nil {
		return 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.nextS += 0x10
	g.streams[g.nextS] = &fakeStream{dev: dev}
	return g.nextS, nil
}

func (g *GPU) StreamSynchronize(s driver.Stream) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	st, ok := g.streams[s]
	if !ok {
		g.mu.Unlock()
		return cuError("cuStreamSynchronize", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown stream")
	}
	if st.failSyncs > 0 {
		st.failSyncs--
		g.mu.Unlock()
		return cuError("cuStreamSynchronize", 201, "CUDA_ERROR_INVALID_CONTEXT", "a failure FailSyncs asked for")
	}
	g.mu.Unlock()
	st.run.Lock()
	defer st.run.Unlock()
	g.mu.Lock()
	ops := st.pending
	st.pending = nil
	g.mu.Unlock()
	var errs []error
	for _, op := range ops {
		errs = append(errs, op())
		g.mu.Lock()
		st.ran++
		g.mu.Unlock()
	}
	return errors.Join(errs...)
}

// Streams returns the handles of the fake's live streams, sorted (the
// streams the fake makes get growing handles): a test finds a stream some
// code made by the handle that was not there before.
func (g *GPU) Streams() []uintptr {
	g.mu.Lock()
	defer g.mu.Unlock()
	hs := make([]uintptr, 0, len(g.streams))
	for s := range g.streams {
		hs = append(hs, uintptr(s))
	}
	slices.Sort(hs)
	return hs
}

// FailSyncs makes the next n synchronizations of stream (a devicebuf.Stream's
// Handle) fail as a failure that is not sticky does: the work queued on it
// stays queued, and a later synchronization runs it.
func (g *GPU) FailSyncs(stream uintptr, n int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	st, ok := g.streams[driver.Stream(stream)]
	if !ok {
		return cuError("cuStreamSynchronize", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown stream")
	}
	st.failSyncs = n
	return nil
}

// Hang queues on s work that does not end until release is called (a
// kernel that spins, a device that stopped): until then the events recorded
// on s after it are not complete, and a synchronization of s blocks. stream
// is a devicebuf.Stream's Handle.
func (g *GPU) Hang(stream uintptr) (release func(), err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	st, ok := g.streams[driver.Stream(stream)]
	if !ok {
		return nil, cuError("cuLaunchKernel", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown stream")
	}
	hung := make(chan struct{})
	st.queueLocked(func() error { <-hung; return nil })
	var once sync.Once
	return func() { once.Do(func() { close(hung) }) }, nil
}

func (g *GPU) StreamDestroy(s driver.Stream) error {
	if err := g.StreamSynchronize(s); err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.streams, s)
	return nil
}

// StreamAdopt registers a stream handle made elsewhere (a test's stand-in for
// an application's stream).
func (g *GPU) StreamAdopt(dev int, s driver.Stream) error {
	if _, err := g.dev("cuStreamAdopt", dev); err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.streams[s]; ok || s == 0 {
		return cuError("cuStreamAdopt", 1, "CUDA_ERROR_INVALID_VALUE", "stream known already")
	}
	g.streams[s] = &fakeStream{dev: dev}
	return nil
}

// StreamDisown runs an adopted stream's deferred copies and forgets it.
func (g *GPU) StreamDisown(s driver.Stream) error { return g.StreamDestroy(s) }

// StreamWaitEvent defers, on s, a run of the copies the event's stream held when it was
// recorded (the fake runs a stream's copies when it is synchronized).
func (g *GPU) StreamWaitEvent(s driver.Stream, e driver.Event) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	st, ev, err := g.streamEventLocked("cuStreamWaitEvent", s, e)
	if err != nil {
		return err
	}
	if rec := ev.rec.stream; rec != 0 && rec != s {
		st.queueLocked(func() error { return g.syncIfLive(rec) })
	}
	return nil
}

// syncIfLive synchronizes s unless it was destroyed (which ran its copies).
func (g *GPU) syncIfLive(s driver.Stream) error {
	g.mu.Lock()
	_, ok := g.streams[s]
	g.mu.Unlock()
	if !ok {
		return nil
	}
	return g.StreamSynchronize(s)
}

func (g *GPU) EventCreate(dev int, interprocess bool) (driver.Event, error) {
	if _, err := g.dev("cuEventCreate", dev); err != nil {
		return 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.nextID++
	return g.addEventLocked(&fakeEvent{dev: dev, ipc: interprocess, rec: &eventRecord{id: g.nextID}}), nil
}

func (g *GPU) addEventLocked(ev *fakeEvent) driver.Event {
	g.nextE += 0x10
	g.events[g.nextE] = ev
	return g.nextE
}

func (g *GPU) EventRecord(e driver.Event, s driver.Stream) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	st, ev, err := g.streamEventLocked("cuEventRecord", s, e)
	if err != nil {
		return err
	}
	ev.rec.stream, ev.rec.at = s, st.queued
	return nil
}

// streamEventLocked looks up stream s and event e for op (g.mu held).
func (g *GPU) streamEventLocked(op string, s driver.Stream, e driver.Event) (*fakeStream, *fakeEvent, error) {
	st, ok := g.streams[s]
	ev, ok2 := g.events[e]
	if !ok || !ok2 {
		return nil, nil, cuError(op, 400, "CUDA_ERROR_INVALID_HANDLE", "unknown stream or event")
	}
	return st, ev, nil
}

func (g *GPU) EventSynchronize(e driver.Event) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	ev, ok := g.events[e]
	if !ok {
		g.mu.Unlock()
		return cuError("cuEventSynchronize", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown event")
	}
	rec := ev.rec.stream
	g.mu.Unlock()
	if rec == 0 {
		return nil
	}
	return g.syncIfLive(rec)
}

// EventQuery reports an event complete once the work queued on its stream before it was
// recorded ran (or the stream is gone). The fake runs a stream's copies when that
// stream is synchronized; a look at an event of this process alone (not interprocess)
// also starts them, on a goroutine of the fake's, as a device runs its streams by itself,
// and reports the event not complete yet. Looks at interprocess events start nothing:
// tests of payloads arriving under them see the copies wait until something waits.
func (g *GPU) EventQuery(e driver.Event) (bool, error) {
	if g.absent != nil {
		return false, g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	ev, ok := g.events[e]
	if !ok {
		return false, cuError("cuEventQuery", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown event")
	}
	s := ev.rec.stream
	st, live := g.streams[s]
	if !live || st.ran >= ev.rec.at {
		return true, nil
	}
	if len(st.pending) > 0 && !st.progressing && !ev.ipc {
		st.progressing = true
		go func() {
			_ = g.syncIfLive(s) // no caller waits for it: an error of its copies goes unreported
			g.mu.Lock()
			st.progressing = false
			g.mu.Unlock()
		}()
	}
	return false, nil
}

func (g *GPU) EventDestroy(e driver.Event) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.events[e]; !ok {
		return cuError("cuEventDestroy", 400, "CUDA_ERROR_INVALID_HANDLE", "unknown event")
	}
	delete(g.events, e)
	return nil
}

// Fake IPC event handle layout: magic, pid, event id.
var ipcEventMagic = [8]byte{'G', 'D', 'R', 'F', 'A', 'K', 'E', 'V'}

func (g *GPU) IpcGetEventHandle(e driver.Event) ([driver.IPCHandleSize]byte, error) {
	var h [driver.IPCHandleSize]byte
	if g.absent != nil {
		return h, g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	ev, ok := g.events[e]
	if !ok || !ev.ipc {
		return h, cuError("cuIpcGetEventHandle", 1, "CUDA_ERROR_INVALID_VALUE", "not an interprocess event")
	}
	copy(h[0:8], ipcEventMagic[:])
	binary.LittleEndian.PutUint32(h[8:12], uint32(os.Getpid()))
	binary.LittleEndian.PutUint64(h[16:24], ev.rec.id)
	return h, nil
}

// IpcOpenEventHandle opens events of this process only: another process's deferred copies
// are out of the fake's reach (real CUDA opens them across processes alone).
func (g *GPU) IpcOpenEventHandle(dev int, h [driver.IPCHandleSize]byte) (driver.Event, error) {
	if _, err := g.dev("cuIpcOpenEventHandle", dev); err != nil {
		return 0, err
	}
	if [8]byte(h[0:8]) != ipcEventMagic {
		return 0, cuError("cuIpcOpenEventHandle", 1, "CUDA_ERROR_INVALID_VALUE", "not a devicebuftest IPC event handle")
	}
	if int(binary.LittleEndian.Uint32(h[8:12])) != os.Getpid() {
		return 0, cuError("cuIpcOpenEventHandle", 801, "CUDA_ERROR_NOT_SUPPORTED", "the fake opens events of its own process only")
	}
	id := binary.LittleEndian.Uint64(h[16:24])
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, ev := range g.events {
		if ev.ipc && ev.rec.id == id {
			return g.addEventLocked(&fakeEvent{dev: dev, rec: ev.rec}), nil
		}
	}
	return 0, cuError("cuIpcOpenEventHandle", 1, "CUDA_ERROR_INVALID_VALUE", "the event was destroyed")
}

func (g *GPU) FlushRDMAWrites(dev int) error {
	d, err := g.dev("cuFlushGPUDirectRDMAWrites", dev)
	if err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	d.flushes++
	return nil
}

// Fake IPC handle layout: magic, pid, fd, size, allocation id, device UUID.
var ipcMagic = [8]byte{'G', 'D', 'R', 'F', 'A', 'K', 'E', '1'}

func (g *GPU) IpcGetMemHandle(dev int, p uintptr) ([driver.IPCHandleSize]byte, error) {
	var h [driver.IPCHandleSize]byte
	d, err := g.dev("cuIpcGetMemHandle", dev)
	if err != nil {
		return h, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	a := g.findLocked(p)
	if a == nil || a.base != p || a.ipc {
		return h, cuError("cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("%#x is not the base of a device allocation", p))
	}
	copy(h[0:8], ipcMagic[:])
	binary.LittleEndian.PutUint32(h[8:12], uint32(os.Getpid()))
	binary.LittleEndian.PutUint32(h[12:16], uint32(a.fd))
	binary.LittleEndian.PutUint64(h[16:24], uint64(a.size))
	binary.LittleEndian.PutUint64(h[24:32], a.id)
	copy(h[32:48], d.uuid[:])
	return h, nil
}

func (g *GPU) IpcOpenMemHandle(dev int, h [driver.IPCHandleSize]byte) (uintptr, error) {
	if _, err := g.dev("cuIpcOpenMemHandle", dev); err != nil {
		return 0, err
	}
	if [8]byte(h[0:8]) != ipcMagic {
		return 0, cuError("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", "not a devicebuftest IPC handle")
	}
	pid := int(binary.LittleEndian.Uint32(h[8:12]))
	fd := int(binary.LittleEndian.Uint32(h[12:16]))
	size := int(binary.LittleEndian.Uint64(h[16:24]))
	id := binary.LittleEndian.Uint64(h[24:32])
	var dupFD int
	var err error
	if pid == os.Getpid() {
		g.mu.Lock()
		var src *fakeAlloc
		for _, a := range g.allocs {
			if a.id == id && !a.ipc {
				src = a
			}
		}
		if src == nil {
			g.mu.Unlock()
			return 0, cuError("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", "the allocation was freed")
		}
		dupFD, err = unix.FcntlInt(uintptr(src.fd), unix.F_DUPFD_CLOEXEC, 0)
		g.mu.Unlock()
	} else {
		dupFD, err = unix.Open(fmt.Sprintf("/proc/%d/fd/%d", pid, fd), unix.O_RDWR|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return 0, cuError("cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", err.Error())
	}
	devMap, alias, err := mapMemfd(dupFD, size)
	if err != nil {
		_ = unix.Close(dupFD)
		return 0, cuError("cuIpcOpenMemHandle", 2, "CUDA_ERROR_OUT_OF_MEMORY", err.Error())
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.nextID++
	a := &fakeAlloc{id: g.nextID, dev: dev, base: uintptr(unsafe.Pointer(&devMap[0])), size: size, fd: dupFD, devMap: devMap, alias: alias, ipc: true}
	g.insertLocked(a)
	return a.base, nil
}

func (g *GPU) IpcCloseMemHandle(dev int, p uintptr) error {
	if g.absent != nil {
		return g.absent
	}
	g.mu.Lock()
	a := g.findLocked(p)
	if a == nil || a.base != p || !a.ipc {
		g.mu.Unlock()
		return cuError("cuIpcCloseMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", fmt.Sprintf("%#x is not an IPC mapping", p))
	}
	g.removeLocked(a)
	g.mu.Unlock()
	a.unmap()
	return nil
}

// ---- driver.Inventory ----

// GPUs lists the fake devices as NVML would.
func (g *GPU) GPUs() ([]driver.GPU, error) {
	if g.absent != nil {
		return nil, g.absent
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]driver.GPU, 0, len(g.devs))
	for _, d := range g.devs {
		out = append(out, driver.GPU{UUID: devicebuf.FormatUUID(d.uuid), Name: d.name, PCIBusID: d.busID,
			MemoryBytes: d.memory, NUMANode: 0, CPUAffinity: "0"})
	}
	return out, nil
}

var (
	_ driver.Driver    = (*GPU)(nil)
	_ driver.Inventory = (*GPU)(nil)
)
