//go:build cgo && !nordma && linux

package rdma

// MappedSegments returns the address space reserved for the segments of
// live keys (mappedBudget).
func MappedSegments() uint64 { return mappedSegments.Load() }
