//go:build cgo && !nocuda

package devicebuf

import (
	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
	"github.com/gdrpc/gdrpc/devicebuf/internal/nvmlinv"
)

func defaultInventory() driver.Inventory { return nvmlinv.Default() }
