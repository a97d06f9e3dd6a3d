// Package cuda is the CUDA driver API loaded at run time: dlopen of libcuda.so.1 and dlsym
// of the few entry points devicebuf needs, with prototypes written here (no CUDA headers or
// toolkit at build time). It is the only package that calls the CUDA driver, and it never
// dereferences a device pointer.
//
// Each call that needs a context makes the device's primary context (retained once per
// device for the life of the process) current and performs the operation inside one C
// call, so the context is current on the very OS thread that runs the operation.
//
// Without cgo, or with the nocuda build tag, Default returns a driver that reports
// ErrNotSupported for every call.
package cuda
