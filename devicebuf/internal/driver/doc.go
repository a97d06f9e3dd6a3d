// Package driver is the seam between package devicebuf and a CUDA driver: the real one
// (package cuda, libcuda.so.1 loaded at run time) or the fake GPU of package devicebuftest.
//
// It owns the Driver and Inventory interfaces and the process-wide choice of the current
// implementation. It never touches device memory and imports no C.
package driver
