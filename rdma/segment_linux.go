//go:build cgo && !nordma && linux

package rdma

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
)

// mapping is a range of this process's address space, from /proc/self/maps.
type mapping struct {
	start, end uint64
	sharedRW   bool // shared and writable: a shared-memory segment or a device's memory
}

// mappings returns this process's mappings, or nil when they cannot be read.
func mappings() []mapping {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return nil
	}
	defer f.Close()
	var ms []mapping
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
		if err1 != nil || err2 != nil || end <= start {
			continue
		}
		ms = append(ms, mapping{start, end, rest[0] == 'r' && rest[1] == 'w' && rest[3] == 's'})
	}
	if sc.Err() != nil {
		return nil
	}
	return ms
}

// attachedSegment reports whether [p, p+n) lies inside one shared, writable
// mapping of now that before (the mappings read earlier) does not have: a
// segment attached between the two reads. Any other mapping, this process's
// own shared memory included, is refused.
func attachedSegment(before, now []mapping, p uintptr, n int) bool {
	if before == nil {
		return false
	}
	for _, m := range now {
		if uint64(p) < m.start || uint64(p) >= m.end {
			continue
		}
		if !m.sharedRW || uint64(n) > m.end-uint64(p) {
			return false
		}
		for _, b := range before {
			if b.start == m.start {
				return false
			}
		}
		return true
	}
	return false
}
