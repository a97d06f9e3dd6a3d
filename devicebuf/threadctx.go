package devicebuf

import (
	"fmt"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// ThreadContexts makes a device's CUDA context current around calls other C libraries make
// on CUDA memory (UCX's, through package rdma): such calls fail, or take a device pointer
// for host memory, on a thread where no context is current.
type ThreadContexts struct {
	d driver.ThreadContexts
}

// CUDAThreadContexts returns the process's ThreadContexts, or an error wrapping
// ErrNotSupported where the CUDA driver is absent or cannot provide them.
func CUDAThreadContexts() (*ThreadContexts, error) {
	d, err := cudaDriver()
	if err != nil {
		return nil, err
	}
	tc, ok := d.(driver.ThreadContexts)
	if !ok {
		return nil, fmt.Errorf("devicebuf: this CUDA driver cannot make contexts current for other libraries: %w", ErrNotSupported)
	}
	return &ThreadContexts{d: tc}, nil
}

// ThreadContext returns device dev's primary context (a CUcontext, retained for the
// process's life) and two C function pointers: push, `int push(void *ctx)`, makes ctx
// current on the calling OS thread, keeping the context it replaces, and returns a
// CUresult; pop, `void pop(void)`, restores that context. A caller pairs every successful
// push with a pop on the same thread.
func (t *ThreadContexts) ThreadContext(dev int) (ctx, push, pop uintptr, err error) {
	if _, err := checkDevice(dev); err != nil {
		return 0, 0, 0, err
	}
	return t.d.ThreadContext(dev)
}
