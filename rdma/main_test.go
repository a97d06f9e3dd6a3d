package rdma_test

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

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
	base := runtime.NumGoroutine()
	code := m.Run()
	if code == 0 {
		if err := checkLeaks(base); err != nil {
			fmt.Fprintln(os.Stderr, "leak check:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// checkLeaks waits (bounded) for goroutines and live UCX objects to go away.
func checkLeaks(base int) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		st := rdma.Stats()
		if n <= base && st.Zero() {
			return nil
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			return fmt.Errorf("%d goroutines (started with %d), stats %+v\n%s", n, base, st, buf)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// requireUCX skips when UCX cannot be used, or fails when GDRPC_REQUIRE
// contains "ucx".
func requireUCX(t testing.TB) {
	t.Helper()
	if err := rdma.Available(); err != nil {
		if strings.Contains(os.Getenv("GDRPC_REQUIRE"), "ucx") {
			t.Fatalf("UCX required (GDRPC_REQUIRE): %v", err)
		}
		t.Skipf("UCX not available: %v", err)
	}
}
