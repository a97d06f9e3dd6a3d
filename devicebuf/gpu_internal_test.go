package devicebuf

import (
	"testing"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
	"github.com/gdrpc/gdrpc/internal/testenv"
)

// TestGPUFlushCall calls cuFlushGPUDirectRDMAWrites itself on a device that offers the host
// flush (FlushRDMAWrites skips the call where the device orders writes).
func TestGPUFlushCall(t *testing.T) {
	testenv.Need(t, "cuda", CUDAAvailable())
	a, err := Attributes(0)
	if err != nil {
		t.Fatal(err)
	}
	if a.FlushWritesOptions&FlushWritesOptionHost == 0 {
		t.Skip("device 0 offers no host flush")
	}
	if err := driver.Current().FlushRDMAWrites(0); err != nil {
		t.Fatalf("cuFlushGPUDirectRDMAWrites: %v", err)
	}
}
