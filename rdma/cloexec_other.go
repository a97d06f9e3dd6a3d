//go:build cgo && !nordma && !linux

package rdma

// markAllBut reports false: only Linux has close_range's CLOEXEC.
func markAllBut([]int) bool { return false }
