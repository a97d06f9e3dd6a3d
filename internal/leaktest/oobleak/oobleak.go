// Package oobleak is the leak check of tests that run gRPC over gdrpc with
// out-of-band payloads: sessions, outbox entries, attached buffers and
// goroutines left over.
package oobleak

import (
	"fmt"
	"runtime"
	"time"

	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Settled waits (bounded) for what the tests started to wind down and reports
// what is left. goroutines is the count taken before the tests ran; a few more
// may stay (the shared UCX context's progress goroutine, timers).
func Settled(goroutines int) error {
	return leaktest.Poll(10*time.Second, func() error {
		runtime.GC()
		switch {
		case transport.ReadStats().Sessions != 0:
			return fmt.Errorf("%d sessions", transport.ReadStats().Sessions)
		case oob.ReadStats().Offered != 0:
			return fmt.Errorf("%d outbox entries", oob.ReadStats().Offered)
		case oob.ReadStats().Spaces != 0 || oob.ReadStats().Landed != 0 || oob.ReadStats().SpaceBytes != 0:
			st := oob.ReadStats()
			return fmt.Errorf("%d receive spaces alive (%d bytes), %d ranges of them held", st.Spaces, st.SpaceBytes, st.Landed)
		case gdrcodec.Attached() != 0:
			return fmt.Errorf("%d attached buffers", gdrcodec.Attached())
		case runtime.NumGoroutine() > goroutines+4:
			buf := make([]byte, 1<<20)
			return fmt.Errorf("%d goroutines, %d before:\n%s", runtime.NumGoroutine(), goroutines, buf[:runtime.Stack(buf, true)])
		}
		return nil
	})
}
