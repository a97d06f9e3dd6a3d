package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// pidfd opens a descriptor of process pid, closed when the test ends, that
// tells when the process ended (exited), and with which it can be killed
// (kill) without the risk of a reused ID. A process still there when the
// test ends is killed.
func pidfd(t *testing.T, pid int) int {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	require.NoError(t, err, "process %d", pid)
	t.Cleanup(func() {
		_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		_ = unix.Close(fd)
	})
	return fd
}

// exited waits up to limit for the process of fd to end, and reports
// whether it did.
func exited(t *testing.T, fd int, limit time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		ms := time.Until(deadline).Milliseconds()
		if ms <= 0 {
			return false
		}
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, int(ms))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		require.NoError(t, err)
		return n == 1
	}
}

// kill kills the process of fd and waits until it ended.
func kill(t *testing.T, fd int) {
	t.Helper()
	require.NoError(t, unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0))
	require.True(t, exited(t, fd, 10*time.Second), "the process outlived SIGKILL for 10s")
}

// cmdline is process pid's command line, its arguments separated by spaces.
func cmdline(pid int) string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return strings.ReplaceAll(string(b), "\x00", " ")
}

// A server process that dies takes its ucx_perftest server with it, and
// stopping it says how it ended.
func TestPerftestDiesWithServer(t *testing.T) {
	bin, log := fakePerftestBin(t)
	o, err := parseFlags([]string{"-transport", "tcp", "-perftest", bin}, io.Discard)
	require.NoError(t, err)
	ch, _, err := startChild(t.Context(), o)
	require.NoError(t, err)
	// The server starts its ucx_perftest server once it announced itself.
	var servers [][]string
	require.Eventually(t, func() bool {
		servers = perftestRuns(t, log, "server")
		return len(servers) > 0
	}, 30*time.Second, 5*time.Millisecond, "no ucx_perftest server listens")
	pid, err := strconv.Atoi(servers[0][1])
	require.NoError(t, err)
	perftest := pidfd(t, pid)

	require.NoError(t, ch.cmd.Process.Kill())
	require.ErrorContains(t, ch.stop(), "the server process failed (signal: killed)")
	require.True(t, exited(t, perftest, 10*time.Second), "the ucx_perftest server outlived its server process")
}

// killServerAt kills the run's server process, and waits until it ended,
// once what was written holds mark.
type killServerAt struct {
	bytes.Buffer
	t      *testing.T
	mark   string
	killed bool
}

func (k *killServerAt) Write(p []byte) (int, error) {
	n, err := k.Buffer.Write(p)
	if !k.killed && strings.Contains(k.String(), k.mark) {
		k.killed = true
		var servers []int
		for _, pid := range childPIDs(k.t, os.Getpid()) {
			if strings.Contains(cmdline(pid), " -child ") {
				servers = append(servers, pid)
			}
		}
		require.Len(k.t, servers, 1, "the run's server process")
		kill(k.t, pidfd(k.t, servers[0]))
	}
	return n, err
}

// A server process killed during a run fails it, with a message that says
// so, even where every row was measured.
func TestServerKilled(t *testing.T) {
	before := childProcesses(t)
	// Killed as its last row is written: gdrpc was measured for every size.
	out := &killServerAt{t: t, mark: `"size_bytes":262144`}
	var errb bytes.Buffer
	code := realMain([]string{"-format", "json", "-sizes", "256KiB", "-iters", "2", "-warmup", "0", "-transport", "tcp", "-perftest", "none"},
		strings.NewReader(""), out, &errb)
	require.True(t, out.killed)
	require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	require.Contains(t, errb.String(), "gdrperf: the server process failed (signal: killed)")
	require.Equal(t, before, childProcesses(t), "processes left")
}

// -busy with -server runs the busy processes beside the server while it
// serves, and stops them when it ends.
func TestBusyServer(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	var cmd *exec.Cmd
	var server int
	var serverErrors func() string
	var done chan error
	// The server listens on its port and the next (plain gRPC): another
	// test's listener may take the next one between the pick and the
	// server's listen, which the server reports and the test tries again.
	for attempt := 0; ; attempt++ {
		port := adjacentFreePorts(t)
		cmd = exec.Command(exe, "-server", fmt.Sprintf("127.0.0.1:%d", port), "-busy", "2", "-transport", "tcp", "-perftest", "none")
		cmd.Env = append(os.Environ(), childEnv+"=1") // this test binary runs gdrperf
		// A file, which the server writes without a goroutine of this process's.
		errf, err := os.Create(fmt.Sprintf("%s/stderr%d", t.TempDir(), attempt))
		require.NoError(t, err)
		defer errf.Close()
		cmd.Stderr = errf
		serverErrors = func() string {
			b, _ := os.ReadFile(errf.Name())
			return string(b)
		}
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		server = pidfd(t, cmd.Process.Pid)
		out := bufio.NewReader(stdout)
		line, err := out.ReadString('\n')
		done = make(chan error, 1)
		go func() {
			_, _ = io.Copy(io.Discard, out) // what follows the first line
			done <- cmd.Wait()
		}()
		if err != nil && strings.Contains(serverErrors(), "address already in use") && attempt < 5 {
			<-done
			continue
		}
		require.NoError(t, err, "stderr: %s", serverErrors())
		require.Contains(t, line, "gdrperf server: gdrpc on 127.0.0.1:"+strconv.Itoa(port))
		break
	}

	var busy []int
	for _, pid := range childPIDs(t, cmd.Process.Pid) {
		if strings.Contains(cmdline(pid), " -spin") {
			busy = append(busy, pid)
		}
	}
	require.Len(t, busy, 2, "busy processes beside the server")
	var busyFDs []int
	for _, pid := range busy {
		busyFDs = append(busyFDs, pidfd(t, pid))
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.True(t, exited(t, server, 30*time.Second), "the server did not end on SIGTERM")
	require.NoError(t, <-done, "stderr: %s", serverErrors())
	for _, fd := range busyFDs {
		require.True(t, exited(t, fd, 10*time.Second), "a busy process outlived the server")
	}
}

// adjacentFreePorts returns a port of 127.0.0.1 that is free, and the next
// one with it, when it looked.
func adjacentFreePorts(t *testing.T) int {
	t.Helper()
	for attempt := 0; ; attempt++ {
		port, err := freePort("127.0.0.1")
		require.NoError(t, err)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1))
		if err == nil {
			require.NoError(t, l.Close())
			return port
		}
		require.Less(t, attempt, 20, "no two free ports in a row: %v", err)
	}
}
