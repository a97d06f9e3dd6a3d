package devicebuf

import (
	"fmt"
	"sync"
)

// PinHost page-locks n bytes of host memory at ptr that this package did not
// allocate (memory UCX allocated, a user's region) with CUDA, so copies between
// it and GPU memory run at pinned speed. It returns the function that unpins
// it, once: a later call returns an error and leaves the driver alone (the
// same pages may be pinned again by then, by someone else). Without a CUDA
// driver it fails with an error wrapping ErrNotSupported. ptr must be C or
// mmap'ed memory, never the Go heap.
func PinHost(ptr uintptr, n int) (unpin func() error, err error) {
	d, err := cudaDriver()
	if err != nil {
		return nil, err
	}
	if ptr == 0 || n <= 0 || uintptr(n) > ^uintptr(0)-ptr {
		return nil, fmt.Errorf("devicebuf: pin %d bytes at %#x", n, ptr)
	}
	if err := d.MemHostRegister(ptr, n); err != nil {
		return nil, fmt.Errorf("devicebuf: cuMemHostRegister %d bytes at %#x: %w", n, ptr, err)
	}
	live.pinned.Add(1)
	var once sync.Once
	return func() error {
		err, ran := error(nil), false
		once.Do(func() {
			ran = true
			live.pinned.Add(-1)
			err = d.MemHostUnregister(ptr)
		})
		if !ran {
			return fmt.Errorf("devicebuf: unpin %d bytes at %#x: already unpinned", n, ptr)
		}
		return err
	}, nil
}
