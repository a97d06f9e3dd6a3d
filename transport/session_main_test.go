package transport_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/gdrpc/gdrpc/internal/leaktest/sessionleak"
	"github.com/gdrpc/gdrpc/transport"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	code := m.Run()
	if code == 0 {
		if err := sessionleak.Check(transport.LeakChecks...); err != nil {
			fmt.Fprintln(os.Stderr, "leak check:", err)
			code = 1
		}
	}
	os.Exit(code)
}
