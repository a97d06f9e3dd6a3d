// Package leaktest holds the leak checks the test mains of gdrpc share: the
// stacks of goroutines still alive, and a bounded poll for things to wind
// down, and the step that runs them after the tests. It imports nothing of
// gdrpc, so every package's tests can use it.
package leaktest

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Goroutines returns the stacks of live goroutines (the caller's excepted)
// whose stack mentions any of markers.
func Goroutines(markers ...string) []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	self := make([]byte, 64)
	self = self[:runtime.Stack(self, false)]
	selfHeader, _, _ := strings.Cut(string(self), "\n")
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.HasPrefix(g, selfHeader) {
			continue
		}
		for _, m := range markers {
			if strings.Contains(g, m) {
				out = append(out, g)
				break
			}
		}
	}
	return out
}

// Poll calls check until it returns nil or bound has passed, and returns its
// last result. Things shut down on their own goroutines after a test ends;
// polling, bounded, is how a test main waits for them.
func Poll(bound time.Duration, check func() error) error {
	deadline := time.Now().Add(bound)
	for {
		err := check()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond) // polling for shutdown, bounded by the deadline
	}
}

// Run runs the tests and, when they passed, check; it returns the exit code
// for os.Exit, 1 when check reports a leak.
func Run(m *testing.M, check func() error) int {
	code := m.Run()
	if code == 0 {
		if err := check(); err != nil {
			fmt.Fprintln(os.Stderr, "leak check:", err)
			return 1
		}
	}
	return code
}
