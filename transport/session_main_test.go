package transport_test

import (
	"os"
	"testing"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/sessionleak"
	"github.com/gdrpc/gdrpc/transport"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	os.Exit(leaktest.Run(m, func() error { return sessionleak.Check(transport.LeakChecks...) }))
}
