//go:build cgo && !nocuda

package nvmlinv

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

type inventory struct{}

// Default returns the NVML inventory.
func Default() driver.Inventory { return inventory{} }

// mu serialises Init/Shutdown pairs (NVML reference-counts them, go-nvml's loader does not
// like concurrent first loads).
var mu sync.Mutex

func (inventory) GPUs() ([]driver.GPU, error) {
	mu.Lock()
	defer mu.Unlock()
	if ret := nvml.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, fmt.Errorf("devicebuf: NVML: libnvidia-ml.so.1 not found: %w", driver.ErrNotSupported)
		}
		return nil, fmt.Errorf("devicebuf: NVML init: %v: %w", nvml.ErrorString(ret), driver.ErrNotSupported)
	}
	defer nvml.Shutdown()
	n, ret := nvml.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("devicebuf: NVML device count: %s", nvml.ErrorString(ret))
	}
	out := make([]driver.GPU, 0, n)
	for i := 0; i < n; i++ {
		dev, ret := nvml.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("devicebuf: NVML device %d: %s", i, nvml.ErrorString(ret))
		}
		g := driver.GPU{NUMANode: -1}
		if g.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("devicebuf: NVML device %d UUID: %s", i, nvml.ErrorString(ret))
		}
		g.Name, _ = dev.GetName()
		if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			g.PCIBusID = normBusID(cString(pci.BusId[:]))
		}
		if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			g.MemoryBytes = mem.Total
		}
		if node, ret := dev.GetNumaNodeId(); ret == nvml.SUCCESS {
			g.NUMANode = node
		} else if g.PCIBusID != "" {
			g.NUMANode = sysfsNUMANode(g.PCIBusID)
		}
		if mask, ret := dev.GetCpuAffinity((runtime.NumCPU() + 63) / 64 * 2); ret == nvml.SUCCESS {
			g.CPUAffinity = CPUList(mask)
		}
		out = append(out, g)
	}
	return out, nil
}

func cString(b []int8) string {
	var sb strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	return sb.String()
}

// normBusID turns NVML's "00000000:3B:00.0" into the sysfs form "0000:3b:00.0".
func normBusID(s string) string {
	s = strings.ToLower(s)
	if i := strings.IndexByte(s, ':'); i > 4 {
		s = s[i-4:]
	}
	return s
}

func sysfsNUMANode(busID string) int {
	b, err := os.ReadFile("/sys/bus/pci/devices/" + busID + "/numa_node")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

// CPUList formats a CPU bit mask (64 CPUs per word, as NVML returns it) as a list such as
// "0-15,32-47".
func CPUList(mask []uint) string {
	var parts []string
	start := -1
	total := len(mask) * 64
	for cpu := 0; cpu <= total; cpu++ {
		set := cpu < total && mask[cpu/64]&(1<<(cpu%64)) != 0
		switch {
		case set && start < 0:
			start = cpu
		case !set && start >= 0:
			if cpu-1 == start {
				parts = append(parts, strconv.Itoa(start))
			} else {
				parts = append(parts, fmt.Sprintf("%d-%d", start, cpu-1))
			}
			start = -1
		}
	}
	return strings.Join(parts, ",")
}
