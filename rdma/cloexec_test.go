package rdma_test

import (
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestCloexecOnReturn: once Listen, Dial and Accept returned, no descriptor
// opened since the context was made is inheritable by a child (UCX opens its
// own without close-on-exec; they are marked off the worker's lock, and the
// calls wait for that).
func TestCloexecOnReturn(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		before := map[string]bool{}
		entries, err := os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		for _, e := range entries {
			before[e.Name()] = true
		}
		c := newContext(t, tls)
		pair(t, c)
		entries, err = os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		for _, e := range entries {
			fd, err := strconv.Atoi(e.Name())
			if err != nil || before[e.Name()] {
				continue
			}
			flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
			if err != nil {
				continue // closed since the listing (the listing's own descriptor)
			}
			target, _ := os.Readlink("/proc/self/fd/" + e.Name())
			require.NotZero(t, flags&unix.FD_CLOEXEC, "descriptor %d (%s) is inheritable", fd, target)
		}
	})
}
