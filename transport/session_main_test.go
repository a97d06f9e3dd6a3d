package transport_test

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	code := m.Run()
	if code == 0 {
		if err := checkLeaks(); err != nil {
			fmt.Fprintln(os.Stderr, "leak check:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// checkLeaks waits (bounded) for the goroutines of sessions, listeners, yamux
// and gRPC to end, then checks the registry, the rdma objects and the checks
// other test files added.
func checkLeaks() error {
	deadline := time.Now().Add(5 * time.Second)
	var leaked []string
	for {
		leaked = leakedGoroutines()
		if len(leaked) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // polling for exit, bounded by deadline
	}
	var errs []error
	if len(leaked) > 0 {
		errs = append(errs, fmt.Errorf("%d goroutines leaked:\n%s", len(leaked), strings.Join(leaked, "\n\n")))
	}
	if n := transport.NumSessions(); n != 0 {
		errs = append(errs, fmt.Errorf("%d sessions still registered", n))
	}
	if st := rdma.Stats(); st.Endpoints != 0 || st.Listeners != 0 {
		errs = append(errs, fmt.Errorf("rdma objects alive: %+v", st))
	}
	for _, f := range transport.LeakChecks {
		if err := f(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func leakedGoroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "leakedGoroutines") {
			continue
		}
		if strings.Contains(g, "gdrpc/gdrpc/transport") || strings.Contains(g, "hashicorp/yamux") ||
			strings.Contains(g, "google.golang.org/grpc") {
			out = append(out, g)
		}
	}
	return out
}
