package devicebuf

import (
	"fmt"
	"sync"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// IPCHandle is a CUDA IPC memory handle (cudaIpcMemHandle_t): it names a device allocation
// so that another process on the same host can map it.
type IPCHandle [driver.IPCHandleSize]byte

// ExportIPC returns an IPC handle for the device allocation b lies in, and b's offset
// within that allocation. The allocation must stay alive while peers use the handle.
func ExportIPC(b *Buffer) (IPCHandle, int, error) {
	if b.Kind() != CUDA {
		return IPCHandle{}, 0, fmt.Errorf("devicebuf: IPC export of %s memory: %w", b.Kind(), ErrNotSupported)
	}
	if b.Released() {
		return IPCHandle{}, 0, ErrReleased
	}
	d, err := checkDevice(b.Device())
	if err != nil {
		return IPCHandle{}, 0, err
	}
	base, _, err := d.MemAddressRange(b.Device(), b.Ptr())
	if err != nil {
		return IPCHandle{}, 0, fmt.Errorf("devicebuf: address range of %s: %w", b, err)
	}
	h, err := d.IpcGetMemHandle(b.Device(), base)
	if err != nil {
		return IPCHandle{}, 0, fmt.Errorf("devicebuf: cuIpcGetMemHandle: %w", err)
	}
	return IPCHandle(h), int(b.Ptr() - base), nil
}

type ipcKey struct {
	d   driver.Driver
	dev int
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

// OpenIPC maps a peer's allocation named by h on device dev and returns a Buffer covering
// the whole allocation (Slice it at the offset ExportIPC returned). Mappings are cached per
// allocation: opening the same handle again shares the mapping, and it is closed when the
// last Buffer returned for it is released.
func OpenIPC(h IPCHandle, device int) (*Buffer, error) {
	d, err := checkDevice(device)
	if err != nil {
		return nil, err
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
