package devicebuf

import (
	"fmt"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// GPU is one GPU of this host as NVML reports it.
type GPU struct {
	// Index is the CUDA ordinal of the GPU (matched on UUID), or -1 where CUDA does not see
	// it (CUDA_VISIBLE_DEVICES, or no CUDA driver).
	Index       int    `json:"index"`
	UUID        string `json:"uuid"` // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
	Name        string `json:"name"`
	PCIBusID    string `json:"pci_bus_id"` // "0000:3b:00.0"
	MemoryBytes uint64 `json:"memory_bytes"`
	NUMANode    int    `json:"numa_node"`    // -1 if unknown
	CPUAffinity string `json:"cpu_affinity"` // CPU list ("0-15,32-47"), "" if unknown
}

// Inventory lists the GPUs through NVML (libnvidia-ml.so.1, loaded at run time): first those
// CUDA sees, in CUDA ordinal order, then any others. Without NVML it returns an error
// wrapping ErrNotSupported.
func Inventory() ([]GPU, error) {
	inv := driver.CurrentInventory()
	if inv == nil {
		return nil, fmt.Errorf("devicebuf: no GPU inventory: %w", ErrNotSupported)
	}
	gs, err := inv.GPUs()
	if err != nil {
		return nil, err
	}
	byUUID := make(map[string]driver.GPU, len(gs))
	for _, g := range gs {
		byUUID[g.UUID] = g
	}
	out := make([]GPU, 0, len(gs))
	conv := func(i int, g driver.GPU) GPU {
		return GPU{Index: i, UUID: g.UUID, Name: g.Name, PCIBusID: g.PCIBusID, MemoryBytes: g.MemoryBytes,
			NUMANode: g.NUMANode, CPUAffinity: g.CPUAffinity}
	}
	if d, err := cudaDriver(); err == nil {
		if n, err := d.DeviceCount(); err == nil {
			for i := 0; i < n; i++ {
				u, err := d.DeviceUUID(i)
				if err != nil {
					continue
				}
				if g, ok := byUUID[FormatUUID(u)]; ok {
					out = append(out, conv(i, g))
					delete(byUUID, g.UUID)
				}
			}
		}
	}
	for _, g := range gs {
		if _, ok := byUUID[g.UUID]; ok {
			out = append(out, conv(-1, g))
		}
	}
	return out, nil
}
