// Package sessionleak is the leak check of tests that run gdrpc sessions:
// goroutines of sessions, yamux and gRPC, registered sessions, and rdma
// endpoints and listeners left over.
package sessionleak

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// Check waits (bounded) for the goroutines of sessions, listeners, yamux and
// gRPC to end, then checks the session registry, the rdma objects and extra.
func Check(extra ...func() error) error {
	var leaked []string
	leaktest.Poll(5*time.Second, func() error {
		if leaked = Goroutines(); len(leaked) > 0 {
			return errors.New("goroutines alive")
		}
		return nil
	})
	var errs []error
	if len(leaked) > 0 {
		errs = append(errs, fmt.Errorf("%d goroutines leaked:\n%s", len(leaked), strings.Join(leaked, "\n\n")))
	}
	if n := transport.ReadStats().Sessions; n != 0 {
		errs = append(errs, fmt.Errorf("%d sessions still registered", n))
	}
	if st := rdma.Stats(); st.Endpoints != 0 || st.Listeners != 0 {
		errs = append(errs, fmt.Errorf("rdma objects alive: %+v", st))
	}
	for _, f := range extra {
		if err := f(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Goroutines returns the goroutines of sessions, yamux and gRPC still alive.
func Goroutines() []string {
	return leaktest.Goroutines("gdrpc/gdrpc/transport", "hashicorp/yamux", "google.golang.org/grpc")
}
