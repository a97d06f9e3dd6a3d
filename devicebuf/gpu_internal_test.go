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

// TestGPUAdoptedStream orders a copy on a stream devicebuf did not make (created through
// the driver and forgotten, as an application's own) after a buffer's arrival, marked by
// an interprocess event: the bytes it copies back are exact.
func TestGPUAdoptedStream(t *testing.T) {
	testenv.Need(t, "cuda", CUDAAvailable())
	d := driver.Current()
	raw, err := d.StreamCreate(0, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.StreamDisown(raw); err != nil { // now the application's, unknown to devicebuf
		t.Fatal(err)
	}
	defer func() { // destroy it as its owner would
		if err := d.StreamAdopt(0, raw); err == nil {
			_ = d.StreamDestroy(raw)
		}
	}()
	gpu, err := NewCUDAAllocator(0)
	if err != nil {
		t.Fatal(err)
	}
	const n = 64 << 20
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i*7 + i>>13)
	}
	src, dst := mustAlloc(t, gpu, n), mustAlloc(t, gpu, n)
	defer src.Release()
	defer dst.Release()
	in := HostFromBytes(want)
	defer in.Release()
	if err := Copy(src, in); err != nil {
		t.Fatal(err)
	}
	recv, _, err := NewIPCEvent(0)
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Close()
	sender, err := NewCopyStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()
	if err := CopyAsync(sender, dst, src); err != nil {
		t.Fatal(err)
	}
	if err := sender.Record(recv); err != nil { // in one process the sender records the event itself
		t.Fatal(err)
	}
	b := WrapArriving(dst.Ptr(), n, 0, nil, recv, 0)
	defer b.Release()
	app, err := AdoptStream(0, uintptr(raw))
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if err := b.WaitOn(app); err != nil {
		t.Fatal(err)
	}
	out := HostFromBytes(got)
	defer out.Release()
	if err := CopyAsync(app, out, b); err != nil {
		t.Fatal(err)
	}
	if err := app.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := app.Close(); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("byte %d: %#x, want %#x", i, got[i], want[i])
		}
	}
}

func mustAlloc(t *testing.T, a Allocator, n int) *Buffer {
	t.Helper()
	b, err := a.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ExportEntries returns how many entries the IPC export table holds.
func ExportEntries() int {
	exports.Lock()
	defer exports.Unlock()
	n := 0
	for _, es := range exports.m {
		n += len(es)
	}
	return n
}
