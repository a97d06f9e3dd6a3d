package interop_test

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/grpclog"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// bufs are the devicebuf counters before the tests.
var bufs devicebuf.Counters

// childEnv makes the test binary, re-executed, play a role (a server to kill,
// a side of the two-host test) instead of running tests.
const childEnv = "GDRPC_INTEROP_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		gdrcodec.Register()
		os.Exit(runChild(role))
	}
	// The interop cases report failures through grpclog's Fatal, which would
	// end the process: the logger turns it into a failure of the running test.
	// It is set before any other use of gRPC.
	grpclog.SetLoggerV2(glog)
	gdrcodec.Register()
	// The Default UCX context (created on first use) keeps its progress
	// goroutine for the life of the process: count it in the baseline.
	if rdma.Available() == nil {
		_, _ = rdma.Default()
	}
	base := runtime.NumGoroutine()
	bufs = devicebuf.Live()
	os.Exit(leaktest.Run(m, func() error {
		closeContexts()
		return checkLeaks(base)
	}))
}

// checkLeaks waits (bounded) for what the tests started to wind down, then
// reports what is left (see leaks).
func checkLeaks(base int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC() // attachments of collected messages leave on GC
		err := leaks(base)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond) // polling for shutdown, bounded by the deadline
	}
}

// leaks reports goroutines of gdrpc, yamux or gRPC, sessions in the
// registry, outbox entries, attached buffers, live devicebuf buffer handles
// beyond pool regions, live UCX endpoints, listeners and remote keys. With base >= 0 (the end of the run) it also reports more
// goroutines than base and UCX contexts still open.
func leaks(base int) error {
	var errs []error
	if g := leakedGoroutines(); len(g) > 0 {
		errs = append(errs, fmt.Errorf("%d goroutines leaked:\n%s", len(g), strings.Join(g, "\n\n")))
	} else if n := runtime.NumGoroutine(); base >= 0 && n > base {
		errs = append(errs, fmt.Errorf("%d goroutines, %d before the tests:\n%s", n, base, allStacks()))
	}
	if n := transport.ReadStats().Sessions; n != 0 {
		errs = append(errs, fmt.Errorf("%d sessions still registered", n))
	}
	if n := oob.ReadStats().Offered; n != 0 {
		errs = append(errs, fmt.Errorf("%d outbox entries", n))
	}
	if n := gdrcodec.Attached(); n != 0 {
		errs = append(errs, fmt.Errorf("%d attached buffers", n))
	}
	// Pools keep their regions (each one a buffer handle) for the life of the
	// process: buffers beyond those are leaked references.
	if d := devicebuf.Live().Sub(bufs); d.HostBuffers+d.CUDABuffers != d.Regions || d.IPCMappings != 0 || d.Streams != 0 {
		errs = append(errs, fmt.Errorf("device buffers alive (against the start, pool regions apart): %+v", d))
	}
	if st := rdma.Stats(); st.Endpoints != 0 || st.Listeners != 0 || st.RemoteKeys != 0 || base >= 0 && st.Contexts != 0 {
		errs = append(errs, fmt.Errorf("UCX objects alive: %+v", st))
	}
	return errors.Join(errs...)
}

func allStacks() string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return string(buf[:n])
		}
		buf = make([]byte, 2*len(buf))
	}
}

// leakedGoroutines returns the stacks of goroutines that belong to gdrpc
// sessions, yamux or gRPC.
func leakedGoroutines() []string {
	var out []string
	for _, g := range strings.Split(allStacks(), "\n\n") {
		if strings.Contains(g, "leakedGoroutines") || strings.Contains(g, "allStacks") {
			continue
		}
		if strings.Contains(g, "gdrpc/gdrpc/transport") || strings.Contains(g, "gdrpc/gdrpc/gdrcodec") ||
			strings.Contains(g, "hashicorp/yamux") || strings.Contains(g, "google.golang.org/grpc") {
			out = append(out, g)
		}
	}
	return out
}
