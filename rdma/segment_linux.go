//go:build cgo && !nordma && linux

package rdma

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// mapping is a range of this process's address space, from /proc/self/maps.
type mapping struct {
	start, end uint64
	sharedRW   bool        // shared and writable: a shared-memory segment or a device's memory
	file       segmentFile // the file mapped, or zero
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
		m := mapping{start: start, end: end, sharedRW: rest[0] == 'r' && rest[1] == 'w' && rest[3] == 's'}
		if f := bytes.Fields(rest); len(f) >= 4 { // perms offset dev inode
			major, minor, ok := bytes.Cut(f[2], []byte(":"))
			maj, err1 := strconv.ParseUint(string(major), 16, 32)
			mnr, err2 := strconv.ParseUint(string(minor), 16, 32)
			ino, err3 := strconv.ParseUint(string(f[3]), 10, 64)
			if ok && err1 == nil && err2 == nil && err3 == nil && ino != 0 {
				m.file = segmentFile{dev: unix.Mkdev(uint32(maj), uint32(mnr)), ino: ino}
			}
		}
		ms = append(ms, m)
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

// UCX's posix memory domain names a segment by a 64-bit id whose top bits are
// flags; in procfs mode the rest is the owner's pid and the segment's file
// descriptor in it (uct/sm/mm/posix).
const (
	posixProcFS   = 1 << 63
	posixShmOpen  = 1 << 62
	posixHugeTLB  = 1 << 61
	posixPIDNS    = 1 << 60 // the owner names its pid namespace in its address
	posixFlags    = 0xf << 60
	posixPIDBits  = 30
	posixKeyBytes = 24 // segment id, owner's address, length
	sysvKeyBytes  = 12 // shmid, owner's address
	posixFilePfx  = "ucx_shm_posix_"
)

// checkSegment reports why UCX must not unpack comp, the key of a peer's
// memory domain of kind component, for the region [base, base+length) the
// key's header names: a shared-memory segment that does not attach, a file
// that is no UCX segment, a segment that does not hold the region, or one
// this process could not map. UCX attaches a posix or sysv segment as it
// unpacks the key, with this process's rights, and a failed attach crashes
// ucp_ep_rkey_unpack (UCX 1.13 to 1.18: its error path releases the key it
// failed to make, and may free what it never allocated), so a receiver that
// died after its RTR, or a forged key, would take the owner down.
//
// What is checked is what UCX attaches: the segment stays held from the
// check until release, which the caller runs once UCX's unpack returned. A
// posix key is rewritten, in comp, to name this process's own descriptor of
// the file checked, so that UCX opens that file and not what the peer's
// descriptor or name refers to by then; a sysv segment stays attached here,
// so that it cannot go, nor its id name another. The hold returned (empty
// when err is not nil, and for keys of other domains) says what to let go
// of when UCX's unpack returned (release) and when the key goes, or at once
// if the unpack failed (drop).
//
// A put or get through the key reaches address a of the region at a, less
// the address the key says the segment has in its owner, plus where this
// process attached it, with no bound of UCX's: only a region that lies in
// the segment as the key places it keeps those within the mapping, and so
// within what checkRMA bounds (the region).
//
// With foreign set the key must name the peer's memory, not this process's:
// a posix segment under this process's id or one of its threads', or a sysv
// segment it created, is refused, for this process's puts would land in its
// own memory (another peer's receive space, a pool of its own); so is a
// posix segment this process maps that no live key of a peer attached,
// however the key names it (takePeerSegment).
func checkSegment(component string, comp []byte, foreign bool, base, length uint64) (segmentHold, error) {
	switch component {
	case "posix":
		return checkPosixSegment(comp, foreign, base, length)
	case "sysv":
		return checkSysvSegment(comp, foreign, base, length)
	}
	return segmentHold{}, nil
}

// mappedBudget bounds the address space that the segments of live keys map
// into this process, all peers together: each key's segment may be as long
// as the host's memory (segmentMax), and a peer that sends many keys of
// sparse segments would otherwise exhaust the address space the Go heap
// grows into. A quarter of x86-64's 128 TiB of user address space.
const mappedBudget = 32 << 40

// mappedSegments is the address space reserved for keys' segments.
var mappedSegments atomic.Uint64

// reserveMapped reserves n bytes of mappedBudget, or reports that they would
// exceed it.
func reserveMapped(n uint64) bool {
	for {
		was := mappedSegments.Load()
		if n > mappedBudget-was {
			return false
		}
		if mappedSegments.CompareAndSwap(was, was+n) {
			return true
		}
	}
}

// unreserveMapped gives back n bytes that reserveMapped reserved.
func unreserveMapped(n uint64) {
	if n > 0 {
		mappedSegments.Add(-n)
	}
}

// errMappedBudget refuses a key whose segment would map past mappedBudget.
func errMappedBudget(n uint64) error {
	return fmt.Errorf("%w: its segment of %d bytes would take this process's peers' segments past %d TiB of address space", ErrBadKey, n, uint64(mappedBudget)>>40)
}

// holdsRegion reports why a segment of n bytes at addr in its owner does not
// hold [base, base+length).
func holdsRegion(addr, n, base, length uint64) error {
	if base < addr || base-addr > n || length > n-(base-addr) {
		return fmt.Errorf("%w: the region [%#x, +%d) lies outside its segment [%#x, +%d)", ErrBadKey, base, length, addr, n)
	}
	return nil
}

func checkPosixSegment(comp []byte, foreign bool, base, regionLen uint64) (segmentHold, error) {
	if len(comp) < posixKeyBytes {
		return segmentHold{}, fmt.Errorf("%w: posix segment key of %d bytes", ErrBadKey, len(comp))
	}
	id := binary.LittleEndian.Uint64(comp)
	length := binary.LittleEndian.Uint64(comp[16:])
	if length == 0 {
		return segmentHold{}, fmt.Errorf("%w: empty posix segment", ErrBadKey)
	}
	if err := holdsRegion(binary.LittleEndian.Uint64(comp[8:]), length, base, regionLen); err != nil {
		return segmentHold{}, err
	}
	if limit := segmentMax(); length > limit {
		// UCX maps the whole length the key says: one past the host's
		// memory is no segment a peer made, and its mapping could fail.
		return segmentHold{}, fmt.Errorf("%w: its posix segment of %d bytes is larger than this host's memory (%d)", ErrBadKey, length, limit)
	}
	mmid := id &^ posixFlags
	var path string
	// Never blocking: what the peer's descriptor names by now may be a
	// FIFO or a device, which checkPosixFile refuses once open.
	flags := os.O_RDWR | unix.O_NONBLOCK
	switch {
	case id&posixProcFS != 0:
		pid := mmid & (1<<posixPIDBits - 1)
		if foreign && ownTask(pid) {
			return segmentHold{}, fmt.Errorf("%w: its posix segment is this process's own", ErrBadKey)
		}
		path = fmt.Sprintf("/proc/%d/fd/%d", pid, mmid>>posixPIDBits)
	case id&posixShmOpen != 0:
		path = fmt.Sprintf("/dev/shm/%s%x", posixFilePfx, mmid)
		flags |= unix.O_NOFOLLOW // as shm_open opens it
	default:
		// A file in a directory the key names (UCX_POSIX_USE_PROC_LINK=n
		// without shm_open): a path the peer chose.
		return segmentHold{}, fmt.Errorf("%w: posix segment named by a directory path", ErrBadKey)
	}
	f, err := os.OpenFile(path, flags, 0)
	if err != nil {
		return segmentHold{}, fmt.Errorf("%w: its posix segment does not open: %w", ErrBadKey, err)
	}
	h := segmentHold{release: func() { f.Close() }}
	refuse := func(err error) (segmentHold, error) {
		h.release()
		h.drop()
		return segmentHold{}, err
	}
	// UCX is to open the descriptor this process holds, through procfs: the
	// file checked, whatever the peer's descriptor or name became since.
	fd := uint64(f.Fd())
	if fd >= 1<<(60-posixPIDBits) || uint64(os.Getpid()) >= 1<<posixPIDBits {
		return refuse(fmt.Errorf("%w: descriptor %d or process id %d does not fit a posix segment id", ErrBadKey, fd, os.Getpid()))
	}
	if err := checkPosixFile(f, id, length); err != nil {
		return refuse(err)
	}
	if foreign {
		if h.file, err = takePeerSegment(f); err != nil {
			return refuse(err)
		}
	}
	if !reserveMapped(length) {
		return refuse(errMappedBudget(length))
	}
	h.mapped = length
	own := id&(posixHugeTLB|posixPIDNS) | posixProcFS | fd<<posixPIDBits | uint64(os.Getpid())
	binary.LittleEndian.PutUint64(comp, own)
	return h, nil
}

// checkPosixFile reports why f, opened for the posix key whose segment id
// is id, is no segment UCX can map length bytes of: a file of
// another kind or a shorter one, one flagged for huge pages off hugetlbfs,
// a descriptor open on a file that is no UCX segment, or a mapping this
// process cannot make now.
func checkPosixFile(f *os.File, id, length uint64) error {
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("%w: its posix segment: %w", ErrBadKey, err)
	}
	// UCX packs the length it mapped, the file's rounded up to pages.
	page := uint64(os.Getpagesize())
	if !fi.Mode().IsRegular() || fi.Size() < 0 || (uint64(fi.Size())+page-1)/page*page < length {
		return fmt.Errorf("%w: its posix segment is a %v of %d bytes, the key says %d", ErrBadKey, fi.Mode().Type(), fi.Size(), length)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil {
		return fmt.Errorf("%w: its posix segment: %w", ErrBadKey, err)
	}
	mapFlags := unix.MAP_SHARED
	if id&posixHugeTLB != 0 {
		// UCX maps it with MAP_HUGETLB, which fails on a file of any other
		// file system, and refuses a length whose huge pages would double
		// it: either way its unpack fails, and crashes.
		if fs.Type != unix.HUGETLBFS_MAGIC || fs.Bsize <= 0 || length%uint64(fs.Bsize) != 0 {
			return fmt.Errorf("%w: its posix segment is flagged for huge pages, and is no whole number of them on hugetlbfs", ErrBadKey)
		}
		mapFlags |= unix.MAP_HUGETLB
	} else if fs.Type != unix.TMPFS_MAGIC {
		// UCX makes its segments in shared memory (shm_open's tmpfs). A file
		// elsewhere would turn a put into this process's own writes to a
		// disk, or to a FUSE file system whose server may never answer the
		// copy's page fault.
		return fmt.Errorf("%w: its posix segment is on no tmpfs (file system %#x): no UCX segment", ErrBadKey, fs.Type)
	}
	if id&posixProcFS != 0 {
		// What the descriptor is open on: a UCX segment, whose name stays
		// in the link once it was unlinked, and not any file the process
		// holds open. (Read through this process's own descriptor: the
		// peer's may name another file by now.)
		target, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
		if err != nil {
			return fmt.Errorf("%w: its posix segment: %w", ErrBadKey, err)
		}
		if !strings.HasPrefix(filepath.Base(strings.TrimSuffix(target, " (deleted)")), posixFilePfx) {
			return fmt.Errorf("%w: its posix segment is %q, no UCX segment", ErrBadKey, target)
		}
	}
	// The mapping UCX will make, made and unmade here: one that fails here
	// (address space, a limit) is refused rather than left to crash UCX.
	// Nothing is touched, so no page is read or allocated.
	if length > math.MaxInt {
		return fmt.Errorf("%w: its posix segment of %d bytes", ErrBadKey, length)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(length), unix.PROT_READ|unix.PROT_WRITE, mapFlags)
	if err != nil {
		return fmt.Errorf("%w: its posix segment of %d bytes does not map: %w", ErrBadKey, length, err)
	}
	_ = unix.Munmap(b)
	return nil
}

// segmentMax is the longest shared-memory segment a key may name: this
// host's memory and swap together.
func segmentMax() uint64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Unit == 0 {
		return math.MaxInt64
	}
	return (uint64(si.Totalram) + uint64(si.Totalswap)) * uint64(si.Unit)
}

// segmentHold is what checkSegment keeps of a key's segment: release, if
// not nil, until UCX's unpack returned (the segment held open or attached);
// the rest until the key goes (drop): the address space its mapping takes
// (reserveMapped) and, for a key of a peer in another process, its file in
// peerSegments.
type segmentHold struct {
	release func()
	mapped  uint64
	file    segmentFile
}

// drop gives back what h keeps for its key's life.
func (h segmentHold) drop() {
	unreserveMapped(h.mapped)
	dropPeerSegment(h.file)
}

// segmentFile names a file by device and inode, as fstat and
// /proc/self/maps do; the zero value names none.
type segmentFile struct{ dev, ino uint64 }

// peerSegments counts, by file, the posix segments that live keys of peers
// in other processes attached: mapped in this process, yet a peer's.
var peerSegments = struct {
	sync.Mutex
	n map[segmentFile]int
}{n: map[segmentFile]int{}}

// takePeerSegment returns the file of f, a posix segment a key of a peer in
// another process names, counted in peerSegments until dropPeerSegment, or
// why it is no peer's: this process maps it and no live key of a peer
// attached it, so it is this process's own (a receive space, a pool, UCX's
// own queues), named through another process's descriptor of it (one the
// peer opened through this process's procfs entry, as UCX does) or by its
// shm_open name, neither of which ownTask sees. Attached, it would have this
// process's puts land in its own memory.
func takePeerSegment(f *os.File) (segmentFile, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return segmentFile{}, fmt.Errorf("%w: its posix segment: %w", ErrBadKey, err)
	}
	file := segmentFile{dev: st.Dev, ino: st.Ino}
	peerSegments.Lock()
	defer peerSegments.Unlock()
	if peerSegments.n[file] == 0 {
		// Read with the lock held: a key of the same segment unpacked
		// meanwhile maps it only once counted.
		ms := mappings()
		if ms == nil {
			return segmentFile{}, fmt.Errorf("%w: this process's mappings cannot be read to check its posix segment", ErrBadKey)
		}
		for _, m := range ms {
			if m.file == file {
				return segmentFile{}, fmt.Errorf("%w: its posix segment is this process's own", ErrBadKey)
			}
		}
	}
	peerSegments.n[file]++
	return file, nil
}

// dropPeerSegment ends a count takePeerSegment took; the zero file is none.
func dropPeerSegment(file segmentFile) {
	if file == (segmentFile{}) {
		return
	}
	peerSegments.Lock()
	defer peerSegments.Unlock()
	if peerSegments.n[file]--; peerSegments.n[file] <= 0 {
		delete(peerSegments.n, file)
	}
}

// ownTask reports whether id is this process's id or one of its threads':
// /proc/<id>/fd of any of them is this process's descriptor table.
func ownTask(id uint64) bool {
	if id == uint64(os.Getpid()) {
		return true
	}
	_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", id))
	return err == nil
}

func checkSysvSegment(comp []byte, foreign bool, base, length uint64) (segmentHold, error) {
	if len(comp) < sysvKeyBytes {
		return segmentHold{}, fmt.Errorf("%w: sysv segment key of %d bytes", ErrBadKey, len(comp))
	}
	id := binary.LittleEndian.Uint32(comp)
	if id > math.MaxInt32 {
		return segmentHold{}, fmt.Errorf("%w: sysv segment id %d", ErrBadKey, id)
	}
	// Attached first, and held so until release: the segment cannot go
	// before UCX attaches it too, nor its id name another one meanwhile.
	// The kernel grants the attach, for writing as UCX's, by the segment's
	// mode and this process's ids and capabilities.
	b, err := unix.SysvShmAttach(int(id), 0, 0)
	if err != nil {
		return segmentHold{}, fmt.Errorf("%w: its sysv segment %d does not attach: %w", ErrBadKey, id, err)
	}
	release := func() { _ = unix.SysvShmDetach(b) }
	refuse := func(err error) (segmentHold, error) {
		release()
		return segmentHold{}, err
	}
	var ds unix.SysvShmDesc
	if _, err := unix.SysvShmCtl(int(id), unix.IPC_STAT, &ds); err != nil {
		return refuse(fmt.Errorf("%w: its sysv segment %d does not attach: %w", ErrBadKey, id, err))
	}
	if err := checkSysvDesc(&ds, id, foreign, binary.LittleEndian.Uint64(comp[4:]), base, length); err != nil {
		return refuse(err)
	}
	if !reserveMapped(ds.Segsz) {
		return refuse(errMappedBudget(ds.Segsz))
	}
	return segmentHold{release: release, mapped: ds.Segsz}, nil
}

// checkSysvDesc reports why the sysv segment id, described by ds, is not
// one a peer's key may name at addr for [base, base+length).
func checkSysvDesc(ds *unix.SysvShmDesc, id uint32, foreign bool, addr, base, length uint64) error {
	// UCX makes its segments under IPC_PRIVATE; one under a key of its own
	// is another program's shared memory, which no peer exposes.
	if ds.Perm.Key != unix.IPC_PRIVATE {
		return fmt.Errorf("%w: its sysv segment %d has key %#x, no UCX segment", ErrBadKey, id, uint32(ds.Perm.Key))
	}
	if foreign && int(ds.Cpid) == os.Getpid() {
		return fmt.Errorf("%w: its sysv segment %d is this process's own", ErrBadKey, id)
	}
	return holdsRegion(addr, ds.Segsz, base, length)
}
