package driver

import (
	"errors"
	"sync"
)

// ErrNotSupported is the root of every "this host or build cannot do that" error. Package
// devicebuf re-exports it.
var ErrNotSupported = errors.New("not supported")

// ErrUnsettled is the root of the error of a Memcpy or MemsetZero that returns before the
// work is complete because the device's work was queued but the wait for it failed: a
// failure that is not sticky leaves the work going, so the memory it reads and writes must
// not be reused.
var ErrUnsettled = errors.New("queued, but the wait for it failed: it may still run")

// Dir is the direction of a copy.
type Dir uint8

// Directions of a copy.
const (
	HtoD Dir = iota + 1
	DtoH
	DtoD
)

// Attribute names a device attribute (values are CUdevice_attribute).
type Attribute int

// Device attributes devicebuf reads (values from cuda.h).
const (
	AttrPCIBusID                        Attribute = 33
	AttrPCIDeviceID                     Attribute = 34
	AttrUnifiedAddressing               Attribute = 41
	AttrPCIDomainID                     Attribute = 50
	AttrComputeCapabilityMajor          Attribute = 75
	AttrComputeCapabilityMinor          Attribute = 76
	AttrGPUDirectRDMASupported          Attribute = 116
	AttrGPUDirectRDMAFlushWritesOptions Attribute = 117
	AttrGPUDirectRDMAWritesOrdering     Attribute = 118
)

// Values of AttrGPUDirectRDMAFlushWritesOptions (a bit mask) and
// AttrGPUDirectRDMAWritesOrdering.
const (
	FlushWritesOptionHost   = 1 << 0
	FlushWritesOptionMemOps = 1 << 1

	WritesOrderingNone       = 0
	WritesOrderingOwner      = 100
	WritesOrderingAllDevices = 200
)

// IPCHandleSize is CU_IPC_HANDLE_SIZE.
const IPCHandleSize = 64

// Stream is an opaque stream handle; 0 is never a valid stream made by StreamCreate.
type Stream uintptr

// Event is an opaque event handle; 0 is never a valid event.
type Event uintptr

// Driver is the subset of the CUDA driver API devicebuf uses. Device arguments are CUDA
// ordinals; the implementation makes that device's primary context current on the calling
// thread for the call. Host pointers passed in are valid for the call only unless said
// otherwise. Implementations are safe for concurrent use.
type Driver interface {
	// Init loads and initialises the driver; an absent driver gives an error wrapping
	// ErrNotSupported with the reason. Every other method may be called only after Init
	// returned nil.
	Init() error
	DriverVersion() (int, error)
	DeviceCount() (int, error)
	DeviceUUID(dev int) ([16]byte, error)
	DeviceName(dev int) (string, error)
	DevicePCIBusID(dev int) (string, error)
	DeviceTotalMem(dev int) (uint64, error)
	DeviceAttribute(dev int, attr Attribute) (int, error)

	MemAlloc(dev int, n int) (uintptr, error)
	MemFree(dev int, p uintptr) error
	// SetSyncMemops sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the allocation holding p.
	SetSyncMemops(dev int, p uintptr) error
	// MemAddressRange returns the allocation that holds device pointer p.
	MemAddressRange(dev int, p uintptr) (base uintptr, size int, err error)
	MemHostRegister(p uintptr, n int) error
	MemHostUnregister(p uintptr) error

	// Memcpy copies n bytes. dstDev/srcDev are the devices of the device sides (ignored for
	// host sides). With s == 0 the copy is complete when Memcpy returns, or, where the
	// error wraps ErrUnsettled, may still run; otherwise it is ordered on s and complete
	// after StreamSynchronize(s).
	Memcpy(dir Dir, dstDev int, dst uintptr, srcDev int, src uintptr, n int, s Stream) error
	// MemsetZero sets n bytes of device memory at p to zero on the device and returns when
	// they are, or, where the error wraps ErrUnsettled, may still be setting them.
	MemsetZero(dev int, p uintptr, n int) error
	// StreamCreate makes a stream on dev: a blocking one (its work ordered after work on
	// the legacy default stream) or a non-blocking one.
	StreamCreate(dev int, blocking bool) (Stream, error)
	StreamSynchronize(s Stream) error
	StreamDestroy(s Stream) error
	// StreamAdopt makes s, a stream of dev's primary context the application
	// created, usable with the other methods until StreamDisown; neither creates
	// nor destroys it.
	StreamAdopt(dev int, s Stream) error
	StreamDisown(s Stream) error
	// StreamWaitEvent orders work queued on s after it behind what e captured.
	StreamWaitEvent(s Stream, e Event) error

	// EventCreate makes an event on dev without timing; an interprocess one can be
	// exported with IpcGetEventHandle.
	EventCreate(dev int, interprocess bool) (Event, error)
	// EventRecord captures the work queued on s so far in e.
	EventRecord(e Event, s Stream) error
	// EventSynchronize waits until the work e last captured is complete (at once for an
	// event never recorded).
	EventSynchronize(e Event) error
	// EventQuery reports whether the work e last captured is complete, without waiting.
	EventQuery(e Event) (bool, error)
	EventDestroy(e Event) error

	// FlushRDMAWrites calls cuFlushGPUDirectRDMAWrites(current context, to owner).
	FlushRDMAWrites(dev int) error

	IpcGetMemHandle(dev int, p uintptr) ([IPCHandleSize]byte, error)
	IpcOpenMemHandle(dev int, h [IPCHandleSize]byte) (uintptr, error)
	IpcCloseMemHandle(dev int, p uintptr) error
	IpcGetEventHandle(e Event) ([IPCHandleSize]byte, error)
	// IpcOpenEventHandle opens another process's interprocess event on dev: recording it
	// here is seen by that process's waits, and the other way round.
	IpcOpenEventHandle(dev int, h [IPCHandleSize]byte) (Event, error)
}

// ThreadContexts is the optional ability of a driver to make a device's context current on
// the calling OS thread from C code that is not its own (UCX's, called by package rdma).
type ThreadContexts interface {
	// ThreadContext returns dev's primary context (a CUcontext, retained for the process's
	// life) and two C function pointers: push, `int push(void *ctx)`, makes ctx current on
	// the calling thread, keeping the context it replaces, and returns a CUresult; pop,
	// `void pop(void)`, restores the context the matching push replaced.
	ThreadContext(dev int) (ctx, push, pop uintptr, err error)
}

// GPU is one device as the management library (NVML) reports it.
type GPU struct {
	UUID        string
	Name        string
	PCIBusID    string
	MemoryBytes uint64
	NUMANode    int // -1 if unknown
	CPUAffinity string
}

// Inventory lists GPUs through the management library.
type Inventory interface {
	// GPUs returns every GPU the management library sees; an absent library gives an error
	// wrapping ErrNotSupported.
	GPUs() ([]GPU, error)
}

var (
	mu        sync.RWMutex
	curDriver Driver
	curInv    Inventory
	defDriver func() Driver
	defInv    func() Inventory
)

// SetDefaults names the implementations used when none was installed (the real ones).
// Package devicebuf calls it once at init.
func SetDefaults(d func() Driver, inv func() Inventory) {
	mu.Lock()
	defer mu.Unlock()
	defDriver, defInv = d, inv
}

// Current returns the driver in use.
func Current() Driver {
	mu.RLock()
	d := curDriver
	f := defDriver
	mu.RUnlock()
	if d != nil {
		return d
	}
	if f == nil {
		return nil
	}
	return f()
}

// CurrentInventory returns the inventory in use.
func CurrentInventory() Inventory {
	mu.RLock()
	i := curInv
	f := defInv
	mu.RUnlock()
	if i != nil {
		return i
	}
	if f == nil {
		return nil
	}
	return f()
}

// Install makes d and inv current (nil restores the defaults) and returns a function that
// puts back what was installed before.
func Install(d Driver, inv Inventory) (restore func()) {
	mu.Lock()
	prevD, prevI := curDriver, curInv
	curDriver, curInv = d, inv
	mu.Unlock()
	return func() {
		mu.Lock()
		curDriver, curInv = prevD, prevI
		mu.Unlock()
	}
}

// Error is a CUDA driver error: the CUresult code and the driver's name and description of
// it.
type Error struct {
	Op   string // the driver call
	Code int    // CUresult
	Name string // "CUDA_ERROR_OUT_OF_MEMORY"
	Desc string // "out of memory"
}

func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = "CUresult " + itoa(e.Code)
	}
	if e.Desc != "" {
		return e.Op + ": " + name + ": " + e.Desc
	}
	return e.Op + ": " + name
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	neg := n < 0
	if neg {
		n = -n
	}
	var b [20]byte
	i := len(b)
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	if neg {
		i--
		b[i] = '-'
	}
	return string(b[i:])
}
