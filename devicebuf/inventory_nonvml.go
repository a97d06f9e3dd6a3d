//go:build !cgo || nocuda

package devicebuf

import (
	"fmt"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

type noInventory struct{}

func (noInventory) GPUs() ([]driver.GPU, error) {
	return nil, fmt.Errorf("devicebuf: NVML: built without cgo or with the nocuda tag: %w", ErrNotSupported)
}

func defaultInventory() driver.Inventory { return noInventory{} }
