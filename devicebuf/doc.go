// Package devicebuf models "a buffer somewhere": host memory or CUDA device memory, with
// explicit, reference-counted lifetimes, allocators and registered pools, and copies between
// any two kinds of memory.
//
// It owns:
//   - Buffer (pointer, length, kind, device) and its views, Retain/Release;
//   - allocators: page-aligned host memory (optionally pinned), CUDA device memory, and
//     pools of large regions carved into size classes, registered once with a Registrar;
//   - copies between kinds, synchronous and on a Stream;
//   - the CUDA driver API, loaded at run time (dlopen of libcuda.so.1; no CUDA headers or
//     toolkit at build time), device attributes, GPUDirect RDMA write flushing, CUDA IPC;
//   - the GPU inventory through NVML (libnvidia-ml.so.1, loaded at run time);
//   - Live, the leak counters every layer's tests check.
//
// It must never:
//   - dereference a device pointer with the CPU (only the driver's copies move device bytes;
//     package devicebuftest makes fake device memory fault on any CPU touch to prove it);
//   - require a GPU, libcuda or libnvidia-ml to build or to run host code: their absence is
//     a run-time ErrNotSupported carrying the loader's message, and a build without cgo
//     compiles and reports ErrNotSupported for everything CUDA;
//   - know about RDMA, UCX or peers: registration goes through the Registrar interface that
//     the caller supplies.
//
// Memory that C, a NIC or the GPU can see is freed explicitly when the last reference is
// released; finalizers are not the mechanism.
//
// Builds: without cgo, or with the nocuda build tag, the CUDA driver and NVML are never
// loaded and every CUDA or inventory call returns an error wrapping ErrNotSupported; host
// memory, pools and host copies work in every build.
//
// CUDA calls: every call that needs a context makes the device's primary context (retained
// once per device for the life of the process) current and performs the operation within
// one C call, so the context is current on exactly the OS thread that runs the operation.
package devicebuf
