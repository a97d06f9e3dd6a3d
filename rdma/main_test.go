package rdma_test

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
)

// childEnv selects a child role when the test binary re-executes itself.
const childEnv = "GDRPC_RDMA_TEST_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	// The Default context (created by Available) keeps its worker's
	// goroutine for the life of the process: count it in the baseline.
	_ = rdma.Available()
	base := len(goroutines())
	os.Exit(leaktest.Run(m, func() error { return checkLeaks(base) }))
}

// checkLeaks waits (bounded) for goroutines and live UCX objects to go away.
func checkLeaks(base int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		g := goroutines()
		st := rdma.Stats()
		if len(g) <= base && st.Zero() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d goroutines (started with %d), stats %+v\n%s", len(g), base, st, strings.Join(g, "\n\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// goroutines returns the stacks of the goroutines that count for the leak
// check: not this one, not the runtime's signal watcher (go test -fuzz).
func goroutines() []string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 || strings.Contains(g, "os/signal.signal_recv") {
			continue
		}
		out = append(out, g)
	}
	return out
}

// requireUCX skips when UCX cannot be used, or fails when GDRPC_REQUIRE
// contains "ucx".
func requireUCX(t testing.TB) {
	t.Helper()
	testenv.Need(t, "ucx", rdma.Available())
}
