//go:build cgo && !nordma && linux

package rdma

import (
	"math"

	"golang.org/x/sys/unix"
)

// markAllBut sets FD_CLOEXEC on every descriptor of the process but those in
// keep (sorted), a close_range call per gap between them: a scan costs a few
// system calls whatever the number of open descriptors, where listing
// /proc/self/fd costs one per descriptor. It reports false, having marked
// nothing, where the kernel lacks CLOSE_RANGE_CLOEXEC (before Linux 5.11).
func markAllBut(keep []int) bool {
	first := uint(0)
	for _, fd := range keep {
		if uint(fd) > first {
			if err := unix.CloseRange(first, uint(fd)-1, unix.CLOSE_RANGE_CLOEXEC); err != nil {
				return false
			}
		}
		first = uint(fd) + 1
	}
	return unix.CloseRange(first, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC) == nil
}
