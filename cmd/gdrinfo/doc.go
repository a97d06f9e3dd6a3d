// Command gdrinfo reports what this host can do for gdrpc: the GPUs (NVML), the CUDA driver
// version and the GPUDirect RDMA attributes of each device, the UCX version, transports and
// registrable memory types, and which gdrpc transfer paths are available, each with the
// reason when it is not.
//
// Usage:
//
//	gdrinfo        # human-readable
//	gdrinfo -json  # one JSON object, for tools
//
// It only reads; it changes no device or library state, and it never touches GPU memory.
package main
