//go:build cgo && !nordma && linux

package rdma

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// shmTempDir returns a directory in shared memory (tmpfs), where UCX makes
// its posix segments, removed when the test ends.
func shmTempDir(t *testing.T) string {
	d, err := os.MkdirTemp("/dev/shm", "gdrpc-rdma-test-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// shmSegment creates a file of n bytes named name in shared memory, as
// UCX's posix segments are, closed when the test ends.
func shmSegment(t *testing.T, name string, n int) *os.File {
	f, err := os.Create(filepath.Join(shmTempDir(t), name))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	require.NoError(t, f.Truncate(int64(n)))
	return f
}

// checkHeld checks key, of component, for 8192 bytes at keyAt: it must pass
// and hold a segment of 8192 bytes until the returned release (and what its
// key keeps, until the test ends).
func checkHeld(t *testing.T, component string, key []byte) (release func()) {
	h, err := checkSegment(component, key, false, keyAt, 8192)
	require.NoError(t, err)
	require.NotNil(t, h.release)
	require.Equal(t, uint64(8192), h.mapped)
	t.Cleanup(h.drop)
	return h.release
}

// sharedFile maps a file of n bytes shared and writable, as UCX attaches a
// peer's segment.
func sharedFile(t *testing.T, n int) (*os.File, []byte) {
	f, err := os.Create(filepath.Join(shmTempDir(t), "segment"))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	require.NoError(t, f.Truncate(int64(n)))
	b, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	require.NoError(t, err)
	t.Cleanup(func() { syscall.Munmap(b) })
	return f, b
}

// Only a shared, writable mapping made since the first read takes direct
// copies, and only a range inside it.
func TestAttachedSegment(t *testing.T) {
	page := os.Getpagesize()
	_, old := sharedFile(t, 4*page)
	private, err := syscall.Mmap(-1, 0, page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	defer syscall.Munmap(private)
	before := mappings()
	require.NotNil(t, before)
	_, seg := sharedFile(t, 4*page)
	newPrivate, err := syscall.Mmap(-1, 0, page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	defer syscall.Munmap(newPrivate)
	now := mappings()

	p := uintptr(unsafe.Pointer(&seg[0]))
	require.True(t, attachedSegment(before, now, p, 4*page))
	require.True(t, attachedSegment(before, now, p+uintptr(page)+3, page))
	require.False(t, attachedSegment(before, now, p, 4*page+1), "past the segment's end")
	require.False(t, attachedSegment(before, now, uintptr(unsafe.Pointer(&old[0])), page), "a shared mapping this process had before")
	require.False(t, attachedSegment(before, now, uintptr(unsafe.Pointer(&newPrivate[0])), page), "a private mapping")
	heap := make([]byte, page)
	require.False(t, attachedSegment(before, now, uintptr(unsafe.Pointer(&heap[0])), page), "the Go heap")
	require.False(t, attachedSegment(nil, now, p, page), "no first read")
}

// A segment whose file shrank under the mapping faults past its end: the copy
// fails, in either direction, and the process lives on.
func TestCopyGuardedFault(t *testing.T) {
	page := os.Getpagesize()
	f, seg := sharedFile(t, 4*page)
	local := make([]byte, 2*page)
	for i := range local {
		local[i] = byte(i)
	}
	require.NoError(t, copyGuarded(seg[page:], local))
	require.Equal(t, local, seg[page:3*page])

	require.NoError(t, f.Truncate(int64(page)))
	err := copyGuarded(seg[page:], local)
	require.ErrorContains(t, err, "faulted")
	err = copyGuarded(local, seg[2*page:])
	require.ErrorContains(t, err, "faulted")
	require.NoError(t, copyGuarded(local[:page], seg[:page]), "the pages the file still has")
}

// A direct copy shared by several goroutines into (or out of) a segment whose
// file shrank fails as a whole, and the process lives on: each goroutine
// turns its own faults into errors (a fault panics only on a goroutine that
// asked for it).
func TestSharedCopyFault(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(directWorkers))
	n := 4*directShare + 3
	f, seg := sharedFile(t, n)
	local := make([]byte, n)
	for i := range local {
		local[i] = byte(i * 7)
	}
	c := directCopy{e: &Endpoint{}, ctx: context.Background(), local: local, seg: seg}
	require.NoError(t, c.run())
	require.True(t, bytes.Equal(local, seg), "the whole file in place")

	require.NoError(t, f.Truncate(int64(directShare+rmaPiece/2))) // the second piece of the second share on
	for _, get := range []bool{false, true} {
		c.get = get
		err := c.run()
		require.ErrorContains(t, err, "faulted", "get=%v", get)
	}
	c.seg = seg[:directShare]
	c.local = local[:directShare]
	require.NoError(t, c.run(), "the pages the file still has")
}

// posixKey is the key of UCX's posix domain naming fd of process pid in
// procfs mode, n bytes long.
func posixKey(pid, fd int, n uint64) []byte {
	k := binary.LittleEndian.AppendUint64(nil, posixProcFS|posixShmOpen|uint64(fd)<<posixPIDBits|uint64(pid))
	k = binary.LittleEndian.AppendUint64(k, keyAt)
	return binary.LittleEndian.AppendUint64(k, n)
}

// keyAt is where the segments of the test keys lie in their owner.
const keyAt = 0x10000000

// A posix or sysv key is unpacked only when its segment attaches: a key
// naming a descriptor that is not open, a file that is no UCX segment, or a
// segment id that does not exist is refused before UCX sees it.
func TestCheckSegment(t *testing.T) {
	seg := shmSegment(t, posixFilePfx+"1234", 8192)
	odd := shmSegment(t, posixFilePfx+"5678", 4097) // UCX maps, and packs, whole pages
	other := shmSegment(t, "model.bin", 8192)
	pid := os.Getpid()
	require.NoError(t, checkSegmentOnce("posix", posixKey(pid, int(seg.Fd()), 8192), false, keyAt, 8192))
	page := os.Getpagesize()
	require.NoError(t, checkSegmentOnce("posix", posixKey(pid, int(odd.Fd()), uint64((4097+page-1)/page*page)), false, keyAt+4096, 1))
	require.NoError(t, checkSegmentOnce("tcp", nil, true, 0, 1<<20), "other domains are UCX's to check")

	shmid, err := unix.SysvShmGet(unix.IPC_PRIVATE, 8192, unix.IPC_CREAT|0o600)
	require.NoError(t, err)
	t.Cleanup(func() { unix.SysvShmCtl(shmid, unix.IPC_RMID, nil) })
	sysv := func(id uint32) []byte {
		return binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, id), keyAt)
	}
	require.NoError(t, checkSegmentOnce("sysv", sysv(uint32(shmid)), false, keyAt, 8192))

	// Segments this process made, named by a peer that is another process.
	err = checkSegmentOnce("posix", posixKey(pid, int(seg.Fd()), 8192), true, keyAt, 8192)
	require.ErrorIs(t, err, ErrBadKey)
	require.ErrorContains(t, err, "this process's own")
	err = checkSegmentOnce("sysv", sysv(uint32(shmid)), true, keyAt, 8192)
	require.ErrorIs(t, err, ErrBadKey)
	require.ErrorContains(t, err, "this process's own")
	// The descriptor named through a thread of this process: /proc/<tid>/fd
	// is the same table.
	tasks, err := os.ReadDir("/proc/self/task")
	require.NoError(t, err)
	tid := 0
	for _, e := range tasks {
		if n, _ := strconv.Atoi(e.Name()); n != pid {
			tid = n
			break
		}
	}
	require.NotZero(t, tid, "a Go process runs more than one thread")
	require.NoError(t, checkSegmentOnce("posix", posixKey(tid, int(seg.Fd()), 8192), false, keyAt, 8192), "the thread's table holds the segment")
	err = checkSegmentOnce("posix", posixKey(tid, int(seg.Fd()), 8192), true, keyAt, 8192)
	require.ErrorIs(t, err, ErrBadKey)
	require.ErrorContains(t, err, "this process's own")

	posixKeyAt := func(pid, fd int, n, at uint64) []byte {
		k := posixKey(pid, fd, n)
		binary.LittleEndian.PutUint64(k[8:], at)
		return k
	}
	sysvAt := func(id uint32, at uint64) []byte {
		return binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, id), at)
	}
	hugeKey := posixKey(pid, int(seg.Fd()), 8192)
	binary.LittleEndian.PutUint64(hugeKey, binary.LittleEndian.Uint64(hugeKey)|posixHugeTLB) // UCX would map it with MAP_HUGETLB, and fail
	var fifo [2]int
	require.NoError(t, unix.Pipe(fifo[:]))
	t.Cleanup(func() { unix.Close(fifo[0]); unix.Close(fifo[1]) })
	dirKey := posixKey(pid, 3, 8192)
	binary.LittleEndian.PutUint64(dirKey, 0x1234) // no procfs, no shm_open: a path follows
	cases := map[string]struct {
		component string
		key       []byte
		why       string
	}{
		"closed descriptor":    {"posix", posixKey(pid, 1<<29, 8192), "does not open"},
		"dead process":         {"posix", posixKey(1<<30-1, 3, 8192), "does not open"},
		"not a UCX segment":    {"posix", posixKey(pid, int(other.Fd()), 8192), "no UCX segment"},
		"a pipe":               {"posix", posixKey(pid, fifo[0], 8192), "of 0 bytes"},
		"longer than its file": {"posix", posixKey(pid, int(seg.Fd()), 8192+uint64(os.Getpagesize())), "of 8192 bytes"},
		"empty":                {"posix", posixKey(pid, int(seg.Fd()), 0), "empty"},
		"short":                {"posix", posixKey(pid, int(seg.Fd()), 8192)[:16], "16 bytes"},
		"directory path":       {"posix", dirKey, "directory path"},
		"unknown shm_open":     {"posix", binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, posixShmOpen|0xdeadbeef), keyAt), 4096), "does not open"},
		"unknown sysv id":      {"sysv", sysv(uint32(math.MaxInt32 - 7)), "does not attach"},
		"negative sysv id":     {"sysv", sysv(math.MaxUint32), "segment id"},
		"short sysv":           {"sysv", sysv(uint32(shmid))[:8], "8 bytes"},
		// The region's addresses, less the segment's in its owner, are
		// offsets into the mapping UCX makes: one the segment does not
		// hold would reach this process's other memory.
		"posix region before its segment": {"posix", posixKeyAt(pid, int(seg.Fd()), 8192, keyAt+4096), "outside its segment"},
		"posix region past its segment":   {"posix", posixKeyAt(pid, int(seg.Fd()), 8192, keyAt-8192+1), "outside its segment"},
		"sysv region before its segment":  {"sysv", sysvAt(uint32(shmid), keyAt+1), "outside its segment"},
		"sysv region past its segment":    {"sysv", sysvAt(uint32(shmid), keyAt-8192+1), "outside its segment"},
		"sysv segment far below":          {"sysv", sysvAt(uint32(shmid), 0), "outside its segment"},
		"huge pages off hugetlbfs":        {"posix", hugeKey, "huge pages"},
	}
	// A file named as UCX names its segments, on a file system of a disk.
	disk, err := os.Create(filepath.Join(t.TempDir(), posixFilePfx+"9"))
	require.NoError(t, err)
	t.Cleanup(func() { disk.Close() })
	require.NoError(t, disk.Truncate(8192))
	var dfs unix.Statfs_t
	require.NoError(t, unix.Fstatfs(int(disk.Fd()), &dfs))
	if dfs.Type != unix.TMPFS_MAGIC {
		cases["off tmpfs"] = struct {
			component string
			key       []byte
			why       string
		}{"posix", posixKey(pid, int(disk.Fd()), 8192), "on no tmpfs"}
	} else {
		t.Log("the test's temporary directory is on tmpfs: no segment off tmpfs to try")
	}
	for name, tc := range cases {
		err := checkSegmentOnce(tc.component, tc.key, false, keyAt, 4096)
		require.ErrorIs(t, err, ErrBadKey, name)
		require.ErrorContains(t, err, tc.why, name)
	}
}

// checkSegmentOnce is checkSegment for a key nobody unpacks: it lets go of
// what the check holds at once.
func checkSegmentOnce(component string, comp []byte, foreign bool, base, length uint64) error {
	h, err := checkSegment(component, comp, foreign, base, length)
	if h.release != nil {
		h.release()
	}
	h.drop()
	return err
}

// A posix key that passes is rewritten to name this process's own
// descriptor of the file checked, held until release: what the peer's
// descriptor becomes after the check (another file, a pipe) is not what
// UCX opens.
func TestCheckSegmentHoldsPosixFile(t *testing.T) {
	seg := shmSegment(t, posixFilePfx+"1", 8192)
	want, err := seg.Stat()
	require.NoError(t, err)
	peerFD := int(seg.Fd())
	key := posixKey(os.Getpid(), peerFD, 8192)
	release := checkHeld(t, "posix", key)

	id := binary.LittleEndian.Uint64(key)
	require.Equal(t, uint64(posixProcFS), id&posixFlags, "procfs mode, shm_open dropped")
	require.Equal(t, uint64(os.Getpid()), id&(1<<posixPIDBits-1))
	ownFD := int(id&^posixFlags) >> posixPIDBits
	require.NotEqual(t, peerFD, ownFD)
	require.Equal(t, []byte{0x00, 0x00, 0x00, 0x10}, key[8:12], "the rest of the key as it was")

	// The peer's descriptor now names a pipe, which UCX's mapping of would fail.
	var p [2]int
	require.NoError(t, unix.Pipe(p[:]))
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	require.NoError(t, unix.Dup2(p[0], peerFD))
	got, err := os.Stat(fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), ownFD))
	require.NoError(t, err)
	require.True(t, os.SameFile(want, got), "the key names the file checked")

	release()
	_, err = os.Stat(fmt.Sprintf("/proc/self/fd/%d", ownFD))
	require.ErrorIs(t, err, os.ErrNotExist, "released: the descriptor is closed")
}

// A sysv segment that passes stays attached until release: removed by its
// owner meanwhile, it still attaches (UCX's attach follows the check), and
// goes once released.
func TestCheckSegmentHoldsSysvSegment(t *testing.T) {
	shmid, err := unix.SysvShmGet(unix.IPC_PRIVATE, 8192, unix.IPC_CREAT|0o600)
	require.NoError(t, err)
	key := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, uint32(shmid)), keyAt)
	release := checkHeld(t, "sysv", key)
	_, err = unix.SysvShmCtl(shmid, unix.IPC_RMID, nil)
	require.NoError(t, err)
	b, err := unix.SysvShmAttach(shmid, 0, 0)
	require.NoError(t, err, "held: the removed segment still attaches")
	require.NoError(t, unix.SysvShmDetach(b))
	release()
	_, err = unix.SysvShmAttach(shmid, 0, 0)
	require.Error(t, err, "released: the segment is gone")
}

// A posix key longer than the host's memory is refused before anything is
// opened or mapped (UCX maps the length the key says, and crashes where the
// mapping fails).
func TestCheckSegmentTooLong(t *testing.T) {
	limit := segmentMax()
	require.Less(t, limit, uint64(math.MaxInt64), "the host's memory is known")
	page := uint64(os.Getpagesize())
	n := (limit/page + 1) * page
	err := checkSegmentOnce("posix", posixKey(os.Getpid(), 1<<29, n), false, keyAt, 4096)
	require.ErrorIs(t, err, ErrBadKey)
	require.ErrorContains(t, err, "larger than this host's memory")
}

// The segments of live keys map at most mappedBudget into this process, all
// peers together: a key past it is refused, and what a key reserved comes
// back when it goes.
func TestCheckSegmentMappedBudget(t *testing.T) {
	seg := shmSegment(t, posixFilePfx+"2", 8192)
	key := func() []byte { return posixKey(os.Getpid(), int(seg.Fd()), 8192) }

	was := mappedSegments.Load()
	require.True(t, reserveMapped(mappedBudget-was-4096), "all but a page of the budget taken")
	defer unreserveMapped(mappedBudget - was - 4096)
	err := checkSegmentOnce("posix", key(), false, keyAt, 8192)
	require.ErrorIs(t, err, ErrBadKey)
	require.ErrorContains(t, err, "address space")
	require.Equal(t, mappedBudget-uint64(4096), mappedSegments.Load(), "a refused key reserves nothing")

	unreserveMapped(4096) // two pages free now
	h, err := checkSegment("posix", key(), false, keyAt, 8192)
	require.NoError(t, err)
	h.release()
	require.Equal(t, uint64(mappedBudget), mappedSegments.Load())
	h.drop()
	require.True(t, reserveMapped(4096), "given back")
}

// A posix segment this process maps, named by a key of a peer in another
// process through that process's descriptor of it (a peer can open one
// through this process's procfs entry, as UCX does), is refused: this
// process's puts would land in its own memory. One a live key of a peer
// attached is the peer's, and another key may name it while that lives.
func TestCheckSegmentRefusesOwnMapping(t *testing.T) {
	f, _ := sharedFile(t, 8192) // this process's own: mapped here
	own := filepath.Join(filepath.Dir(f.Name()), posixFilePfx+"3")
	require.NoError(t, os.Rename(f.Name(), own))
	peer := shmSegment(t, posixFilePfx+"4", 8192)

	holder := exec.Command("sleep", "60")
	holder.ExtraFiles = []*os.File{f, peer} // its descriptors 3 and 4
	require.NoError(t, holder.Start())
	defer func() {
		_ = holder.Process.Kill()
		_ = holder.Wait()
	}()
	pid := holder.Process.Pid

	err := checkSegmentOnce("posix", posixKey(pid, 3, 8192), true, keyAt, 8192)
	require.ErrorIs(t, err, ErrBadKey)
	require.ErrorContains(t, err, "this process's own")
	require.NoError(t, checkSegmentOnce("posix", posixKey(pid, 3, 8192), false, keyAt, 8192), "a peer in this process may")

	// The peer's segment: a key's check counts it, and its unpack maps it.
	first, err := checkSegment("posix", posixKey(pid, 4, 8192), true, keyAt, 8192)
	require.NoError(t, err)
	first.release()
	attached, err := syscall.Mmap(int(peer.Fd()), 0, 8192, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	require.NoError(t, err)
	require.NoError(t, checkSegmentOnce("posix", posixKey(pid, 4, 8192), true, keyAt, 8192), "a second key of a segment a live key attached")
	first.drop()
	err = checkSegmentOnce("posix", posixKey(pid, 4, 8192), true, keyAt, 8192)
	require.ErrorContains(t, err, "this process's own", "mapped with no live key of a peer: as if it were this process's")
	require.NoError(t, syscall.Munmap(attached))
	require.NoError(t, checkSegmentOnce("posix", posixKey(pid, 4, 8192), true, keyAt, 8192))
	peerSegments.Lock()
	defer peerSegments.Unlock()
	require.Empty(t, peerSegments.n, "every count dropped")
}
