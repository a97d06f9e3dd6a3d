package oob

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/sessionleak"
)

// TestMain checks, once the tests passed, that none left sessions, their
// goroutines, the engine's goroutines, or anything in the engine's tables:
// outbox entries, pulls, receive spaces and the ranges of them held.
func TestMain(m *testing.M) {
	os.Exit(leaktest.Run(m, func() error {
		return sessionleak.Check(func() error {
			var left []string
			return leaktest.Poll(10*time.Second, func() error {
				if st := ReadStats(); st != (Stats{}) {
					return fmt.Errorf("the engine holds %+v", st)
				}
				if left = leaktest.Goroutines("gdrpc/gdrpc/oob."); len(left) > 0 {
					return fmt.Errorf("%d engine goroutines alive:\n%s", len(left), strings.Join(left, "\n\n"))
				}
				return nil
			})
		})
	}))
}
