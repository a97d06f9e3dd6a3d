package transport_test

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/internal/leaktest"
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
	var leaked []string
	leaktest.Poll(5*time.Second, func() error {
		if leaked = leakedGoroutines(); len(leaked) > 0 {
			return errors.New("goroutines alive")
		}
		return nil
	})
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

// leakedGoroutines returns the goroutines of sessions, yamux and gRPC still alive.
func leakedGoroutines() []string {
	return leaktest.Goroutines("gdrpc/gdrpc/transport", "hashicorp/yamux", "google.golang.org/grpc")
}
