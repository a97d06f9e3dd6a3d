package devicebuf

import (
	"errors"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

var (
	// ErrNotSupported reports that this host or build cannot do what was asked (no
	// libcuda.so.1, no libnvidia-ml.so.1, built without cgo, ...). Errors wrap it with the
	// reason.
	ErrNotSupported = driver.ErrNotSupported
	// ErrExhausted reports that a pool has no free block of the size asked and may not grow.
	ErrExhausted = errors.New("devicebuf: pool exhausted")
	// ErrNotHost reports that CPU access was asked of memory that is not host memory.
	ErrNotHost = errors.New("devicebuf: not host memory")
	// ErrReleased reports use of a Buffer after its last Release.
	ErrReleased = errors.New("devicebuf: buffer released")
	// ErrUnsettled reports a Copy or Clear whose device work was queued but whose wait for
	// it failed: the work may still run, so devicebuf holds the buffers it touches for good
	// (their memory is lost rather than reused under it).
	ErrUnsettled = driver.ErrUnsettled
)

// CUDAError is an error the CUDA driver returned: the call, the CUresult code, and the
// driver's name and description of it.
type CUDAError = driver.Error
