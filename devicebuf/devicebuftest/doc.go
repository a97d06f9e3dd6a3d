// Package devicebuftest is a fake GPU for tests that run without one.
//
// Install replaces the CUDA driver (and the NVML inventory) that package devicebuf uses with
// a fake whose "device memory" is a memfd mapped PROT_NONE at the device pointer, so that any
// CPU touch of it faults, plus a hidden read-write alias of the same memfd that only the fake
// driver's copies use. Higher layers use it to prove they never dereference device memory.
//
// It must never be imported by non-test code.
package devicebuftest
