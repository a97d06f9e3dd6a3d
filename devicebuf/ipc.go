package devicebuf

import (
	"fmt"
	"slices"
	"sync"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// IPCHandle is a CUDA IPC memory handle (cudaIpcMemHandle_t): it names a device allocation
// so that another process on the same host can map it.
type IPCHandle [driver.IPCHandleSize]byte

// OwnIPC reports whether h is a handle this process exported (of an allocation still live).
func OwnIPC(h IPCHandle) bool {
	d, err := cudaDriver()
	if err != nil {
		return false
	}
	exports.Lock()
	defer exports.Unlock()
	return exports.liveLocked(ipcKey{d: d, h: h}) != nil
}

// ExportIPC returns an IPC handle for the device allocation b lies in, and b's offset
// within that allocation. The allocation must stay alive while peers use the handle. The
// handle of an allocation is made once and remembered while the allocation lives.
func ExportIPC(b *Buffer) (IPCHandle, int, error) {
	if b.Kind() != CUDA {
		return IPCHandle{}, 0, fmt.Errorf("devicebuf: IPC export of %s memory: %w", b.Kind(), ErrNotSupported)
	}
	if !b.tryRetain() {
		return IPCHandle{}, 0, ErrReleased
	}
	defer b.Release()
	owner := b.a.region.a // the allocation whose memory b lies in (a pool region, for a block)
	if e := owner.export.Load(); e != nil && b.ptr >= e.base {
		return e.h, int(b.ptr - e.base), nil
	}
	d, err := driverOf(b)
	if err != nil {
		return IPCHandle{}, 0, err
	}
	base, size, err := d.MemAddressRange(b.Device(), b.Ptr())
	if err != nil {
		return IPCHandle{}, 0, fmt.Errorf("devicebuf: address range of %s: %w", b, err)
	}
	h, err := d.IpcGetMemHandle(b.Device(), base)
	if err != nil {
		return IPCHandle{}, 0, fmt.Errorf("devicebuf: cuIpcGetMemHandle: %w", err)
	}
	e := &exportEntry{h: IPCHandle(h), base: base, d: d, owner: owner}
	// An allocation that starts where the driver's allocation starts can be opened in this
	// process without the driver (which refuses a process's own handles).
	if r := owner.region; r.ptr == base && r.n <= size {
		exports.Lock()
		switch had := owner.export.Load(); {
		case had != nil:
			// Exported meanwhile by another goroutine: one entry an allocation.
		case !owner.freed:
			k := ipcKey{d: d, h: e.h}
			exports.m[k] = append(exports.m[k], e)
			owner.export.Store(e)
		}
		exports.Unlock()
	}
	return e.h, int(b.Ptr() - base), nil
}

// driverOf returns the initialised driver that made or maps CUDA buffer b.
func driverOf(b *Buffer) (driver.Driver, error) {
	if d := b.a.drv; d != nil {
		if err := d.Init(); err != nil {
			return nil, err
		}
		return d, nil
	}
	return checkDevice(b.Device())
}

// exportEntry is an IPC handle this process exported for an allocation it owns.
type exportEntry struct {
	h     IPCHandle
	base  uintptr
	d     driver.Driver
	owner *allocation
}

// exports maps the handles this process exported (for allocations still alive) to their
// allocations, so that OpenIPC of a handle of this process returns the memory itself.
// Several allocations may share a handle: a buffer and a Wrap of its memory each export
// the driver allocation they lie in, and either may be freed first.
var exports = exportTable{m: map[ipcKey][]*exportEntry{}}

type exportTable struct {
	sync.Mutex
	m map[ipcKey][]*exportEntry
}

// liveLocked returns the entry of the allocation still alive that exported k and covers
// the most of the driver's allocation (a Wrap may cover a part of it), or nil (x locked).
func (x *exportTable) liveLocked(k ipcKey) *exportEntry {
	var best *exportEntry
	for _, e := range x.m[k] {
		if !e.owner.freed && (best == nil || e.owner.region.n > best.owner.region.n) {
			best = e
		}
	}
	return best
}

// unexport forgets a's handle; called when a's memory is freed.
func unexport(a *allocation) {
	exports.Lock()
	defer exports.Unlock()
	a.freed = true
	if e := a.export.Load(); e != nil {
		k := ipcKey{d: e.d, h: e.h}
		if rest := slices.DeleteFunc(exports.m[k], func(x *exportEntry) bool { return x == e }); len(rest) > 0 {
			exports.m[k] = rest
		} else {
			delete(exports.m, k)
		}
	}
}

// openOwn returns a new handle onto an allocation of this process that exported h, or nil.
func openOwn(d driver.Driver, h IPCHandle) *Buffer {
	exports.Lock()
	defer exports.Unlock()
	e := exports.liveLocked(ipcKey{d: d, h: h})
	if e == nil {
		return nil
	}
	r := e.owner.region
	return e.owner.tryNewHandle(r.ptr, r.n)
}

type ipcKey struct {
	d   driver.Driver
	dev int // the device mapped on (0 in exports)
	h   IPCHandle
}

type ipcMapping struct {
	ptr   uintptr
	size  int
	users int
}

var ipcCache = struct {
	sync.Mutex
	m map[ipcKey]*ipcMapping
}{m: map[ipcKey]*ipcMapping{}}

// OpenIPC maps a peer's allocation named by h on CUDA device number device and returns a
// Buffer covering the whole allocation (Slice it at the offset ExportIPC returned).
// Mappings are cached per allocation: opening the same handle again shares the mapping, and
// it is closed when the last Buffer returned for it is released.
//
// A handle this process exported (the CUDA driver refuses to open those) gives a Buffer onto
// the exporting allocation itself, on the exporter's device, which keeps the allocation
// alive until released.
func OpenIPC(h IPCHandle, device int) (*Buffer, error) {
	d, err := checkDevice(device)
	if err != nil {
		return nil, err
	}
	if b := openOwn(d, h); b != nil {
		return b, nil
	}
	k := ipcKey{d, device, h}
	ipcCache.Lock()
	defer ipcCache.Unlock()
	m := ipcCache.m[k]
	if m == nil {
		p, err := d.IpcOpenMemHandle(device, h)
		if err != nil {
			return nil, fmt.Errorf("devicebuf: cuIpcOpenMemHandle on device %d: %w", device, err)
		}
		base, size, err := d.MemAddressRange(device, p)
		if err != nil {
			_ = d.IpcCloseMemHandle(device, p)
			return nil, fmt.Errorf("devicebuf: address range of IPC mapping: %w", err)
		}
		m = &ipcMapping{ptr: base, size: size}
		ipcCache.m[k] = m
		live.ipc.Add(1)
	}
	m.users++
	a := newAllocation(CUDA, device, func() {
		ipcCache.Lock()
		defer ipcCache.Unlock()
		m.users--
		if m.users == 0 {
			delete(ipcCache.m, k)
			_ = d.IpcCloseMemHandle(device, m.ptr)
			live.ipc.Add(-1)
		}
	})
	a.uuid = deviceUUID(d, device)
	a.drv = d
	return a.newRoot(m.ptr, m.size), nil
}
