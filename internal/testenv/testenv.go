// Package testenv holds what the test packages of gdrpc share about their
// environment: which prerequisites GDRPC_REQUIRE demands, child processes
// that re-execute the test binary in a role, and UCX contexts of a test's
// own.
package testenv

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
)

// LogBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Required reports whether GDRPC_REQUIRE (comma-separated) names what (ucx,
// ucx-headers, cuda, python, netns...): a missing prerequisite then fails the test instead
// of skipping it.
func Required(what string) bool {
	for w := range strings.SplitSeq(os.Getenv("GDRPC_REQUIRE"), ",") {
		if strings.TrimSpace(w) == what {
			return true
		}
	}
	return false
}

// StartChild re-executes the test binary (under the command prefix, e.g. ip
// netns exec NAME, if any) with env added to this environment, and returns the
// process and the first line it printed, waiting at most timeout. The child
// ends with the test: its stdin closes, and it is resumed (were it stopped) and
// killed.
func StartChild(tb testing.TB, timeout time.Duration, prefix []string, env ...string) (*exec.Cmd, string) {
	tb.Helper()
	args := append(append([]string{}, prefix...), os.Args[0], "-test.run=^$")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	// Wait closes the stdout pipe once the child exited, so it waits for the
	// reader to see the end first: a child that prints its line and exits at
	// once would otherwise lose the line to the close.
	line := make(chan string, 1)
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			line <- sc.Text()
		} else {
			line <- "EOF"
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	waited := make(chan struct{})
	go func() {
		<-read
		_ = cmd.Wait()
		close(waited)
	}()
	tb.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-waited
	})
	select {
	case l := <-line:
		return cmd, l
	case <-time.After(timeout):
		tb.Fatal("child did not answer")
	}
	return nil, ""
}

// Need skips tb when err says a prerequisite is missing, or fails it when
// GDRPC_REQUIRE names what.
func Need(tb testing.TB, what string, err error) {
	tb.Helper()
	if err == nil {
		return
	}
	if Required(what) {
		tb.Fatalf("%s required (GDRPC_REQUIRE) but unavailable: %v", what, err)
	}
	tb.Skipf("%s unavailable: %v", what, err)
}

// UCXContext returns a UCX context with UCX_TLS tls for the calling test
// alone, closed when the test ends. A test that kills or stops a peer
// process over UCX takes one: a peer that dies in the middle of a send over
// shared memory (UCX's posix and sysv transports) leaves this process's
// shared-memory receive queue of that worker blocked for good (README,
// known limits), and every later test on a shared context would stall.
func UCXContext(tb testing.TB, tls string) *rdma.Context {
	tb.Helper()
	Need(tb, "ucx", rdma.Available())
	c, err := rdma.NewContext(rdma.WithTransports(tls))
	Need(tb, "ucx", err)
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// OpenDescriptors opens up to n descriptors (fewer when the process may not have that
// many) and keeps them open until the test ends: a process that has built up many, as a
// long-running server does.
func OpenDescriptors(tb testing.TB, n int) {
	tb.Helper()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		tb.Fatalf("getrlimit: %v", err)
	}
	open, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatalf("list descriptors: %v", err)
	}
	n = min(n, int(lim.Cur)-len(open)-1000)
	files := make([]*os.File, 0, max(n, 0))
	tb.Cleanup(func() {
		for _, f := range files {
			f.Close()
		}
	})
	for range n {
		f, err := os.Open(os.DevNull)
		if err != nil {
			tb.Fatalf("open %s: %v", os.DevNull, err)
		}
		files = append(files, f)
	}
}

// GoroutineID returns the id of the calling goroutine, as runtime.Stack
// names it ("goroutine 42 [running]:"): for tests that count the goroutines
// that ran something.
func GoroutineID() string {
	var buf [64]byte
	return StackGoroutineID(string(buf[:runtime.Stack(buf[:], false)]))
}

// StackGoroutineID returns the id of the goroutine whose stack, as
// runtime.Stack prints it, is stack.
func StackGoroutineID(stack string) string {
	id, _, _ := strings.Cut(strings.TrimPrefix(stack, "goroutine "), " ")
	return id
}
