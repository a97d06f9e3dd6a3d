//go:build cgo && !nordma

package rdma

import (
	"os"
	"slices"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// maxBaseline is how many inheritable descriptors a baseline holds; any
// beyond are marked like UCX's.
const maxBaseline = 64

// cloexecScanner marks UCX's descriptors close-on-exec. Descriptors open
// without FD_CLOEXEC when the baseline is taken, before UCX is loaded, are
// the user's: they stay inheritable. Every other descriptor found without
// FD_CLOEXEC is UCX's (Go opens all of its own with FD_CLOEXEC).
type cloexecScanner struct {
	mu      sync.Mutex
	based   bool  // the baseline was taken: scans mark
	blind   bool  // the baseline could not be listed: scans mark nothing
	keep    []int // the baseline: the user's inheritable descriptors, sorted
	noRange bool  // markAllBut does not work here
}

// ucxFDs is the process's scanner; load takes its baseline before opening
// libucp.
var ucxFDs cloexecScanner

// baseline records the descriptors open without FD_CLOEXEC now, the first
// time it is called; later calls do nothing. Until then scan does nothing.
func (s *cloexecScanner) baseline() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.based {
		return
	}
	s.based = true
	// Without a listing nothing tells the user's descriptors from UCX's:
	// marking all would close the user's stdio in their children.
	s.blind = !eachInheritable(func(fd, _ int) {
		if len(s.keep) < maxBaseline {
			s.keep = append(s.keep, fd)
		}
	})
	slices.Sort(s.keep)
}

// scan sets FD_CLOEXEC on every descriptor open without it that is not in
// the baseline.
func (s *cloexecScanner) scan() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.based || s.blind {
		return
	}
	if !s.noRange {
		if markAllBut(s.keep) {
			return
		}
		s.noRange = true // the kernel lacks close_range's CLOEXEC: list and mark
	}
	eachInheritable(func(fd, flags int) {
		if !slices.Contains(s.keep, fd) {
			// Fails only for a descriptor closed since the listing.
			_, _ = unix.FcntlInt(uintptr(fd), unix.F_SETFD, flags|unix.FD_CLOEXEC)
		}
	})
}

// eachInheritable calls f with each descriptor of the process that is open
// without FD_CLOEXEC, and its descriptor flags, as listed in /proc/self/fd
// (the listing's own descriptor left out). It reports false, having called
// nothing, when the directory cannot be opened (no /proc, or no descriptor
// left).
func eachInheritable(f func(fd, flags int)) bool {
	dir, err := os.Open("/proc/self/fd")
	if err != nil {
		return false
	}
	defer dir.Close()
	self := int(dir.Fd())
	for {
		names, listErr := dir.Readdirnames(64)
		for _, name := range names {
			fd, err := strconv.Atoi(name)
			if err != nil || fd < 0 || fd == self {
				continue
			}
			flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
			if err != nil || flags&unix.FD_CLOEXEC != 0 {
				continue
			}
			f(fd, flags)
		}
		if listErr != nil {
			return true
		}
	}
}
