package devicebuftest

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
)

// LeakCheck returns an error describing every devicebuf live-object counter that is not
// zero (buffers, bytes, pinned ranges, pool regions, registrations, IPC mappings, streams).
func LeakCheck() error {
	c := devicebuf.Live()
	if c.IsZero() {
		return nil
	}
	return fmt.Errorf("devicebuf objects still live: %+v", c)
}

// Main runs a package's tests (call it from TestMain) and then fails the run if devicebuf
// objects or goroutines started by the tests are still live. Goroutines get a bounded grace
// period (2 s) to finish exiting.
func Main(m *testing.M) {
	before := goroutineIDs()
	code := m.Run()
	if code == 0 {
		if err := LeakCheck(); err != nil {
			fmt.Fprintln(os.Stderr, "leak check:", err)
			code = 1
		}
		if leaked := waitGoroutines(before, 2*time.Second); leaked != "" {
			fmt.Fprintln(os.Stderr, "leak check: goroutines still running:\n"+leaked)
			code = 1
		}
	}
	os.Exit(code)
}

func goroutineIDs() map[string]bool {
	ids := map[string]bool{}
	for _, g := range stacks() {
		ids[strings.SplitN(g, " ", 3)[1]] = true
	}
	return ids
}

func stacks() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Split(strings.TrimSpace(string(buf[:n])), "\n\n")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// waitGoroutines returns the stacks of goroutines not in before (other than this one and
// os/signal's) still running after timeout, or "".
func waitGoroutines(before map[string]bool, timeout time.Duration) string {
	deadline := time.Now().Add(timeout)
	for {
		var leaked []string
		for _, g := range stacks() {
			f := strings.SplitN(g, " ", 3)
			if len(f) < 3 || before[f[1]] || strings.Contains(g, "devicebuftest.stacks") || strings.Contains(g, "os/signal.") {
				continue
			}
			leaked = append(leaked, g)
		}
		if len(leaked) == 0 {
			return ""
		}
		if time.Now().After(deadline) {
			return strings.Join(leaked, "\n\n")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
