//go:build cgo && !nordma && !linux

package rdma

// sharedSegment reports false: where the process's mappings cannot be read,
// puts and gets stay UCX operations.
func sharedSegment(p uintptr, n int) bool { return false }
