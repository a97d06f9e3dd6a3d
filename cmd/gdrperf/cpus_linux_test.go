package main

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The re-executed server names the CPUs it may run on: a server started
// from a thread confined to one CPU inherits that CPU alone (as under
// taskset), and says so, while this process names all of its own.
func TestServerNamesItsCPUs(t *testing.T) {
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	cpu := -1
	for c := range 1024 {
		if all.IsSet(c) {
			cpu = c
		}
	}
	require.GreaterOrEqual(t, cpu, 0)
	whole := allowedCPUs()

	o := &options{transport: "tcp", mem: "host", recv: "host", op: "pull", perftest: "none", callLimit: time.Minute}
	started := make(chan error, 1)
	var info readyInfo
	var ch *child
	go func() {
		// The child inherits the affinity of the thread that starts it.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var one unix.CPUSet
		one.Set(cpu)
		if err := unix.SchedSetaffinity(0, &one); err != nil {
			started <- err
			return
		}
		var err error
		ch, info, err = startChild(context.Background(), o)
		if rerr := unix.SchedSetaffinity(0, &all); err == nil {
			err = rerr
		}
		started <- err
	}()
	require.NoError(t, <-started)
	defer func() { require.NoError(t, ch.stop()) }()
	require.Equal(t, strconv.Itoa(cpu), info.CPUs)
	require.Equal(t, whole, allowedCPUs())
	if runtime.NumCPU() > 1 {
		require.NotEqual(t, info.CPUs, whole)
	}
}
