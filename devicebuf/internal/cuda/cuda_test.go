//go:build cgo && !nocuda

package cuda

import (
	"errors"
	"strings"
	"testing"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
	"github.com/gdrpc/gdrpc/internal/testenv"
)

// TestUseBeforeInit calls the driver without Init: each entry point loads the library first
// (or reports why it cannot) instead of calling through unresolved symbols.
func TestUseBeforeInit(t *testing.T) {
	d := newReal()
	n, err := d.DeviceCount()
	if err != nil {
		if testenv.Required("cuda") {
			t.Fatalf("GDRPC_REQUIRE=cuda: %v", err)
		}
		if !errors.Is(err, driver.ErrNotSupported) {
			t.Fatalf("DeviceCount without a driver: %v, want ErrNotSupported", err)
		}
		if !strings.Contains(err.Error(), LibraryName) && !strings.Contains(err.Error(), "cuInit") {
			t.Fatalf("the error does not carry the loader's message: %v", err)
		}
		for name, call := range map[string]func() error{
			"MemAlloc":        func() error { _, err := d.MemAlloc(0, 4096); return err },
			"Memcpy":          func() error { return d.Memcpy(driver.HtoD, 0, 0x1000, -1, 0x2000, 1, 0) },
			"DeviceAttribute": func() error { _, err := d.DeviceAttribute(0, driver.AttrGPUDirectRDMASupported); return err },
			"MemHostRegister": func() error { return d.MemHostRegister(0x1000, 4096) },
			"FlushRDMAWrites": func() error { return d.FlushRDMAWrites(0) },
		} {
			if err := call(); !errors.Is(err, driver.ErrNotSupported) {
				t.Errorf("%s without a driver: %v, want ErrNotSupported", name, err)
			}
		}
		return
	}
	if n <= 0 {
		t.Fatalf("%d devices", n)
	}
	if err := d.StreamSynchronize(0x1234); err == nil {
		t.Fatal("an unknown stream is refused")
	}
}
