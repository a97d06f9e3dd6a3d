package devicebuf

import (
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/gdrpc/gdrpc/devicebuf/internal/cuda"
	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

func init() {
	driver.SetDefaults(cuda.Default, defaultInventory)
}

// cudaDriver returns the current driver, initialised, or why there is none.
func cudaDriver() (driver.Driver, error) {
	d := driver.Current()
	if d == nil {
		return nil, fmt.Errorf("devicebuf: no CUDA driver: %w", ErrNotSupported)
	}
	if err := d.Init(); err != nil {
		return nil, err
	}
	return d, nil
}

// checkDevice returns the initialised driver if dev is a valid ordinal.
func checkDevice(dev int) (driver.Driver, error) {
	d, err := cudaDriver()
	if err != nil {
		return nil, err
	}
	n, err := d.DeviceCount()
	if err != nil {
		return nil, err
	}
	if dev < 0 || dev >= n {
		return nil, fmt.Errorf("devicebuf: CUDA device %d out of range (%d devices)", dev, n)
	}
	return d, nil
}

// CUDAAvailable returns nil if the CUDA driver loaded and initialised, else an error
// wrapping ErrNotSupported with the reason (no libcuda.so.1 with dlerror's message, no
// device, built without cgo).
func CUDAAvailable() error {
	_, err := cudaDriver()
	return err
}

// DeviceCount returns the number of CUDA devices.
func DeviceCount() (int, error) {
	d, err := cudaDriver()
	if err != nil {
		return 0, err
	}
	return d.DeviceCount()
}

// DriverVersion returns the CUDA driver version as the driver reports it (1000*major +
// 10*minor, e.g. 13000 for 13.0).
func DriverVersion() (int, error) {
	d, err := cudaDriver()
	if err != nil {
		return 0, err
	}
	return d.DriverVersion()
}

// FormatUUID formats a 16-byte device UUID as NVML and nvidia-smi print it.
func FormatUUID(u [16]byte) string {
	b := make([]byte, 0, len("GPU-")+36)
	b = append(b, "GPU-"...)
	for i, part := range [][]byte{u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]} {
		if i > 0 {
			b = append(b, '-')
		}
		b = hex.AppendEncode(b, part)
	}
	return string(b)
}

// DeviceUUIDOf returns the UUID of CUDA device dev ("GPU-...").
func DeviceUUIDOf(dev int) (string, error) {
	d, err := checkDevice(dev)
	if err != nil {
		return "", err
	}
	u, err := d.DeviceUUID(dev)
	if err != nil {
		return "", err
	}
	return FormatUUID(u), nil
}

// deviceUUID returns dev's UUID, or "" when the driver cannot tell.
func deviceUUID(d driver.Driver, dev int) string {
	if d == nil || d.Init() != nil {
		return ""
	}
	u, err := d.DeviceUUID(dev)
	if err != nil {
		return ""
	}
	if s, ok := uuidNames.Load(u); ok {
		return s.(string)
	}
	s := FormatUUID(u)
	uuidNames.Store(u, s)
	return s
}

// uuidNames holds the names of this host's devices that deviceUUID made
// (each buffer wrapped or received names its device): a few.
var uuidNames sync.Map // [16]byte -> string

// DeviceAttrs are the device attributes the transfer paths depend on.
type DeviceAttrs struct {
	// GPUDirectRDMASupported: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED.
	GPUDirectRDMASupported bool `json:"gpudirect_rdma_supported"`
	// FlushWritesOptions: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS, a mask of
	// FlushWritesOptionHost and FlushWritesOptionMemOps.
	FlushWritesOptions int `json:"flush_writes_options"`
	// WritesOrdering: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, one of
	// WritesOrderingNone, WritesOrderingOwner, WritesOrderingAllDevices.
	WritesOrdering int `json:"writes_ordering"`
}

// Values of DeviceAttrs.FlushWritesOptions and DeviceAttrs.WritesOrdering.
const (
	FlushWritesOptionHost    = driver.FlushWritesOptionHost
	FlushWritesOptionMemOps  = driver.FlushWritesOptionMemOps
	WritesOrderingNone       = driver.WritesOrderingNone
	WritesOrderingOwner      = driver.WritesOrderingOwner
	WritesOrderingAllDevices = driver.WritesOrderingAllDevices
)

// Attributes reads the GPUDirect RDMA attributes of CUDA device number device.
func Attributes(device int) (DeviceAttrs, error) {
	d, err := checkDevice(device)
	if err != nil {
		return DeviceAttrs{}, err
	}
	return readAttrs(d, device)
}

func readAttrs(d driver.Driver, dev int) (DeviceAttrs, error) {
	var a DeviceAttrs
	sup, err := d.DeviceAttribute(dev, driver.AttrGPUDirectRDMASupported)
	if err != nil {
		return a, fmt.Errorf("devicebuf: GPU_DIRECT_RDMA_SUPPORTED: %w", err)
	}
	a.GPUDirectRDMASupported = sup != 0
	if a.FlushWritesOptions, err = d.DeviceAttribute(dev, driver.AttrGPUDirectRDMAFlushWritesOptions); err != nil {
		return a, fmt.Errorf("devicebuf: GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: %w", err)
	}
	if a.WritesOrdering, err = d.DeviceAttribute(dev, driver.AttrGPUDirectRDMAWritesOrdering); err != nil {
		return a, fmt.Errorf("devicebuf: GPU_DIRECT_RDMA_WRITES_ORDERING: %w", err)
	}
	return a, nil
}

// NeedsRDMAFlush reports whether data that an RDMA NIC wrote into the memory of CUDA device
// number device must be flushed (FlushRDMAWrites) before a consumer on it may read it: true
// where the device does not order GPUDirect RDMA writes for its own context (WritesOrdering
// below Owner).
func NeedsRDMAFlush(device int) (bool, error) {
	d, err := checkDevice(device)
	if err != nil {
		return false, err
	}
	a, err := readAttrs(d, device)
	if err != nil {
		return false, err
	}
	return a.WritesOrdering < WritesOrderingOwner, nil
}

// FlushRDMAWrites makes GPUDirect RDMA writes into the memory of CUDA device number device
// that completed before the call visible to work on that device that follows it. It calls
// cuFlushGPUDirectRDMAWrites only where the device's WritesOrdering says a consumer on the
// owning device needs it; where the device orders writes itself it does nothing. A device
// that neither orders writes nor offers a host-side flush gives an error wrapping
// ErrNotSupported.
func FlushRDMAWrites(device int) error {
	d, err := checkDevice(device)
	if err != nil {
		return err
	}
	a, err := readAttrs(d, device)
	if err != nil {
		return err
	}
	if a.WritesOrdering >= WritesOrderingOwner {
		return nil
	}
	if a.FlushWritesOptions&FlushWritesOptionHost == 0 {
		return fmt.Errorf("devicebuf: device %d neither orders GPUDirect RDMA writes nor offers a host flush: %w", device, ErrNotSupported)
	}
	if err := d.FlushRDMAWrites(device); err != nil {
		return fmt.Errorf("devicebuf: flush GPUDirect RDMA writes on device %d: %w", device, err)
	}
	return nil
}

type cudaAllocator struct {
	d    driver.Driver
	dev  int
	uuid string
}

// NewCUDAAllocator returns an allocator of memory on CUDA device number device (cuMemAlloc,
// with CU_POINTER_ATTRIBUTE_SYNC_MEMOPS set so that RDMA sees completed copies). Without a
// driver it returns an error wrapping ErrNotSupported.
func NewCUDAAllocator(device int) (Allocator, error) {
	d, err := checkDevice(device)
	if err != nil {
		return nil, err
	}
	return &cudaAllocator{d: d, dev: device, uuid: deviceUUID(d, device)}, nil
}

func (c *cudaAllocator) Kind() Kind  { return CUDA }
func (c *cudaAllocator) Device() int { return c.dev }

// Alloc allocates n bytes of device memory (n > 0).
func (c *cudaAllocator) Alloc(n int) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("devicebuf: alloc of %d bytes", n)
	}
	p, err := c.d.MemAlloc(c.dev, n)
	if err != nil {
		return nil, fmt.Errorf("devicebuf: cuMemAlloc %d bytes on device %d: %w", n, c.dev, err)
	}
	if err := c.d.SetSyncMemops(c.dev, p); err != nil {
		_ = c.d.MemFree(c.dev, p)
		return nil, fmt.Errorf("devicebuf: set SYNC_MEMOPS: %w", err)
	}
	live.bytes[CUDA].Add(int64(n))
	d, dev := c.d, c.dev
	a := newAllocation(CUDA, dev, func() {
		_ = d.MemFree(dev, p)
		live.bytes[CUDA].Add(-int64(n))
	})
	a.uuid = c.uuid
	a.drv = d
	return a.newRoot(p, n), nil
}

// DeviceInfo describes one CUDA device as the CUDA driver sees it.
type DeviceInfo struct {
	Index             int         `json:"index"` // CUDA ordinal
	UUID              string      `json:"uuid"`
	Name              string      `json:"name"`
	PCIBusID          string      `json:"pci_bus_id"` // as the driver prints it, "0000:3B:00.0"
	MemoryBytes       uint64      `json:"memory_bytes"`
	ComputeCapability string      `json:"compute_capability"` // "9.0"
	Attrs             DeviceAttrs `json:"attrs"`
}

// Describe returns what the CUDA driver reports about CUDA device number device.
func Describe(device int) (DeviceInfo, error) {
	d, err := checkDevice(device)
	if err != nil {
		return DeviceInfo{}, err
	}
	info := DeviceInfo{Index: device}
	u, err := d.DeviceUUID(device)
	if err != nil {
		return info, err
	}
	info.UUID = FormatUUID(u)
	if info.Name, err = d.DeviceName(device); err != nil {
		return info, err
	}
	if info.PCIBusID, err = d.DevicePCIBusID(device); err != nil {
		return info, err
	}
	if info.MemoryBytes, err = d.DeviceTotalMem(device); err != nil {
		return info, err
	}
	major, err := d.DeviceAttribute(device, driver.AttrComputeCapabilityMajor)
	if err != nil {
		return info, err
	}
	minor, err := d.DeviceAttribute(device, driver.AttrComputeCapabilityMinor)
	if err != nil {
		return info, err
	}
	info.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
	if info.Attrs, err = readAttrs(d, device); err != nil {
		return info, err
	}
	return info, nil
}
