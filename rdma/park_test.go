//go:build linux && cgo && !nordma

package rdma_test

import (
	"io"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestDriverParksInGoPoller checks that an idle driver waits in Go's poller
// (its goroutine in IO wait, holding no thread or P) rather than in a C call,
// and that messages wake it: every round trip between two workers whose
// drivers never poll goes through a park and a wake-up on both sides.
func TestDriverParksInGoPoller(t *testing.T) {
	requireUCX(t)
	c, err := rdma.NewContext(rdma.WithPollTime(0))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	cw, sw := c.Worker(), newWorker(t, c)
	client, server := pairOn(t, cw, sw)
	// A lost wake-up leaves a driver parked until its timeout: parks of 5 s
	// make one a round trip no load on the machine comes near.
	const park, lost = 5 * time.Second, 4 * time.Second
	for _, w := range []*rdma.Worker{cw, sw} {
		w.SetPark(func(efd int) time.Duration { return park })
		t.Cleanup(func() { w.SetPark(nil) }) // before the endpoints close
	}
	slow := 0
	msg, back := make([]byte, 64), make([]byte, 64)
	for i := range 300 {
		start := time.Now()
		copy(msg, pattern(len(msg), uint64(i)))
		_, err := client.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(server, back)
		require.NoError(t, err)
		_, err = server.Write(back)
		require.NoError(t, err)
		_, err = io.ReadFull(client, back)
		require.NoError(t, err)
		require.Equal(t, msg, back, "round trip %d", i)
		if time.Since(start) >= lost {
			slow++
		}
	}
	require.Zero(t, slow, "round trips of %v or more: a wake-up was lost", lost)

	w := c.Worker()
	require.Eventually(t, w.Parked, 10*time.Second, time.Millisecond, "the driver parks when idle")
	drivers := leaktest.Goroutines("rdma.(*Worker).run(")
	require.NotEmpty(t, drivers)
	parked := 0
	for _, g := range drivers {
		require.NotContains(t, g, "_Cfunc_rdma_worker_wait", "a driver waits in C:\n%s", g)
		if strings.Contains(g, "[IO wait") && strings.Contains(g, "rdma.(*Worker).park(") {
			parked++
		}
	}
	require.NotZero(t, parked, "no driver waits in Go's poller:\n%s", strings.Join(drivers, "\n\n"))
}

// TestDriverYieldsToPeerOnItsCore runs an echo between this process and a
// child with every thread of both on one core: a driver that polls there
// keeps its peer from running, so one of the two must find out and yield the
// core between polling rounds. Every echo must come back intact.
func TestDriverYieldsToPeerOnItsCore(t *testing.T) {
	requireUCX(t)
	pinProcess(t)
	ch := startChild(t, transports[0].tls) // forked by a pinned thread: pinned too

	msg, back := make([]byte, 256), make([]byte, 256)
	yielding := func() bool {
		ch.command(t, cmdYield, 0, 0)
		b := make([]byte, 1)
		_, err := io.ReadFull(ch.ep, b)
		require.NoError(t, err)
		return b[0] == 1 || yielded(ch.ctx.Worker())
	}
	for i := 0; ; i++ {
		copy(msg, pattern(len(msg), uint64(i)))
		ch.command(t, cmdEcho, uint64(len(msg)), 0)
		_, err := ch.ep.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(ch.ep, back)
		require.NoError(t, err)
		require.Equal(t, msg, back, "echo %d", i)
		if i%50 == 49 && yielding() {
			return
		}
		require.Less(t, i, 2000, "no driver yields after %d echoes on one core", i)
	}
}

// yielded reports whether w's driver has yielded its core.
func yielded(w *rdma.Worker) bool { return w.Yielded() }

// pinProcess puts every thread of this process on one of its cores until
// the test ends; threads started later inherit it (it pins again until no
// thread was started by one not yet pinned). The cleanup gives every thread
// the process's mask back.
func pinProcess(t *testing.T) {
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	cpu := -1
	for i := range 1024 {
		if all.IsSet(i) {
			cpu = i
			break
		}
	}
	require.GreaterOrEqual(t, cpu, 0)
	var one unix.CPUSet
	one.Set(cpu)
	// setAll sets every thread's mask and returns how many threads it set.
	setAll := func(set *unix.CPUSet) (int, error) {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return 0, err
		}
		n := 0
		for _, task := range tasks {
			tid, err := strconv.Atoi(task.Name())
			if err != nil {
				continue
			}
			// A thread may exit meanwhile (ESRCH).
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
				return n, err
			}
			n++
		}
		return n, nil
	}
	t.Cleanup(func() {
		_, err := setAll(&all)
		require.NoError(t, err)
	})
	for prev := -1; ; {
		n, err := setAll(&one)
		require.NoError(t, err)
		if n == prev {
			return
		}
		prev = n
	}
}

// Bytes that arrive after the driver's last progress and before it parks
// wake it: the poller already took their edge, and UCX's tcp transport arms
// without looking, so only a look at the event fd after the arm sees them.
// The server's driver is held just before a park until the client's byte is
// readable on its event fd, and a moment more for Go's poller to take the
// edge; that park's timeout is long, so a lost wake-up shows as a round trip
// of seconds.
func TestDriverWakesForBytesBeforePark(t *testing.T) {
	c := newContext(t, "tcp")
	cw, sw := newWorker(t, c), newWorker(t, c)
	client, server := pairOn(t, cw, sw)
	const sleep, bound = 20 * time.Second, 30 * time.Second
	reached, hold := make(chan struct{}), make(chan struct{}, 1)
	var armed atomic.Bool
	sw.SetPark(func(efd int) time.Duration {
		if efd < 0 || !armed.CompareAndSwap(true, false) {
			return 0
		}
		reached <- struct{}{}
		<-hold // the client wrote
		pfd := []unix.PollFd{{Fd: int32(efd), Events: unix.POLLIN}}
		for {
			n, err := unix.Poll(pfd, 5000)
			if err == unix.EINTR {
				continue
			}
			if err != nil || n == 0 {
				return 0 // the test's round trip fails on its own
			}
			break
		}
		// Widens the window the fix closes (the poller takes the edge before
		// the park's read begins); correctness does not depend on it.
		time.Sleep(20 * time.Millisecond)
		return sleep
	})
	t.Cleanup(func() { sw.SetPark(nil) })

	b := make([]byte, 1)
	for i := range 5 {
		armed.Store(true)
		select {
		case <-reached:
		case <-time.After(bound):
			t.Fatal("the server's driver never went to park")
		}
		start := time.Now()
		_, err := client.Write([]byte{byte(i)})
		require.NoError(t, err)
		hold <- struct{}{}
		require.NoError(t, server.SetReadDeadline(time.Now().Add(bound)))
		_, err = io.ReadFull(server, b)
		require.NoError(t, err)
		require.Equal(t, byte(i), b[0])
		require.Less(t, time.Since(start), sleep/4, "round %d: the server's driver slept through the byte", i)
	}
}
