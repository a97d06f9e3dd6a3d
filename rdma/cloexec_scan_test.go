//go:build cgo && !nordma

package rdma

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// inheritablePipe opens a pipe without close-on-exec; the test's end closes
// both descriptors.
func inheritablePipe(t testing.TB) [2]int {
	t.Helper()
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], 0))
	t.Cleanup(func() {
		unix.Close(p[0])
		unix.Close(p[1])
	})
	require.False(t, isCloexec(t, p[0]))
	require.False(t, isCloexec(t, p[1]))
	return p
}

// pauseMarking keeps the process's marker (markCloexec) from scanning until
// the test ends. The Default context's worker lives as long as the process,
// and its driver asks for a scan whenever it goes idle: such a scan marks
// every descriptor opened since UCX was loaded, the inheritable ones a test
// opens to watch its own scanner included. It waits for a scan under way to
// end; meanwhile, as while paused, the driver's requests are dropped, and
// others wait for the scan that resuming runs.
func pauseMarking(t testing.TB) {
	t.Helper()
	for {
		cloexec.mu.Lock()
		if !cloexec.running {
			break
		}
		cloexec.mu.Unlock()
		<-markCloexec(false) // the running scan, or the next, covers it
	}
	cloexec.running = true
	cloexec.mu.Unlock()
	t.Cleanup(func() {
		cloexec.mu.Lock()
		cloexec.running = false
		cloexec.mu.Unlock()
		<-markCloexec(false)
	})
}

// isCloexec reports whether fd has FD_CLOEXEC set.
func isCloexec(t testing.TB, fd int) bool {
	t.Helper()
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	require.NoError(t, err)
	return flags&unix.FD_CLOEXEC != 0
}

// TestCloexecScanner runs each case with close_range (the default on Linux)
// and with the listing of /proc/self/fd that kernels without it get.
func TestCloexecScanner(t *testing.T) {
	pauseMarking(t)
	for _, listing := range []bool{false, true} {
		t.Run(fmt.Sprintf("listing=%v", listing), func(t *testing.T) {
			t.Run("marks descriptors opened after the baseline", func(t *testing.T) {
				s := cloexecScanner{noRange: listing}
				s.baseline()
				p := inheritablePipe(t)
				s.scan()
				require.True(t, isCloexec(t, p[0]))
				require.True(t, isCloexec(t, p[1]))
			})
			t.Run("leaves the baseline inheritable", func(t *testing.T) {
				s := cloexecScanner{noRange: listing}
				user := inheritablePipe(t)
				s.baseline()
				later := inheritablePipe(t)
				s.scan()
				require.False(t, isCloexec(t, user[0]))
				require.False(t, isCloexec(t, user[1]))
				require.True(t, isCloexec(t, later[0]))
				require.True(t, isCloexec(t, later[1]))
			})
			t.Run("marks nothing before the baseline", func(t *testing.T) {
				s := cloexecScanner{noRange: listing}
				p := inheritablePipe(t)
				s.scan()
				require.False(t, isCloexec(t, p[0]))
				require.False(t, isCloexec(t, p[1]))
			})
			t.Run("takes the baseline once", func(t *testing.T) {
				s := cloexecScanner{noRange: listing}
				s.baseline()
				p := inheritablePipe(t)
				s.baseline()
				s.scan()
				require.True(t, isCloexec(t, p[0]))
				require.True(t, isCloexec(t, p[1]))
			})
			t.Run("holds at most maxBaseline descriptors", func(t *testing.T) {
				s := cloexecScanner{noRange: listing}
				var fds []int
				for range maxBaseline/2 + 1 {
					p := inheritablePipe(t)
					fds = append(fds, p[0], p[1])
				}
				s.baseline()
				require.Len(t, s.keep, maxBaseline)
				s.scan()
				for _, fd := range fds {
					require.Equal(t, !slices.Contains(s.keep, fd), isCloexec(t, fd), "descriptor %d", fd)
				}
			})
		})
	}
}

// The process's scanner took its baseline when UCX was loaded: a descriptor
// opened without close-on-exec since then is UCX's to it, and marked.
func TestCloexecScanAfterLoad(t *testing.T) {
	_ = load()
	pauseMarking(t)
	p := inheritablePipe(t)
	ucxFDs.scan()
	require.True(t, isCloexec(t, p[0]))
	require.True(t, isCloexec(t, p[1]))
}

// A baseline that cannot be listed (here: no descriptor left to open
// /proc/self/fd with) leaves the scanner blind: it marks nothing, rather
// than every descriptor the user has, stdio included.
func TestCloexecBlindBaseline(t *testing.T) {
	pauseMarking(t)
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	low := lim
	low.Cur = 1024
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	var dups []int
	defer func() {
		for _, fd := range dups {
			unix.Close(fd)
		}
		require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	}()
	for {
		fd, err := unix.Dup(0)
		if err != nil {
			require.ErrorIs(t, err, unix.EMFILE)
			break
		}
		dups = append(dups, fd)
	}
	var s cloexecScanner
	s.baseline() // fails to list: no descriptor left
	for _, fd := range dups {
		unix.Close(fd)
	}
	dups = nil
	require.True(t, s.blind)
	p := inheritablePipe(t)
	s.scan()
	require.False(t, isCloexec(t, p[0]), "a blind scanner marks nothing")
	require.False(t, isCloexec(t, p[1]))
}
