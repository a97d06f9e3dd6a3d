//go:build cgo && !nordma && linux

package rdma

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
)

// sharedSegment reports whether [p, p+n) lies inside one shared, writable
// mapping of this process (a shared-memory segment), read from
// /proc/self/maps: never this process's private memory (the Go heap, C
// allocations, stacks).
func sharedSegment(p uintptr, n int) bool {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset dev inode path
		rng, rest, ok := bytes.Cut(sc.Bytes(), []byte(" "))
		lo, hi, ok2 := bytes.Cut(rng, []byte("-"))
		if !ok || !ok2 || len(rest) < 4 {
			continue
		}
		start, err1 := strconv.ParseUint(string(lo), 16, 64)
		end, err2 := strconv.ParseUint(string(hi), 16, 64)
		if err1 != nil || err2 != nil || uint64(p) < start || uint64(p) >= end {
			continue
		}
		return rest[0] == 'r' && rest[1] == 'w' && rest[3] == 's' && uint64(n) <= end-uint64(p)
	}
	return false
}
