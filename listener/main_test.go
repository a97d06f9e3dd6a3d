package listener_test

import (
	"os"
	"testing"

	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/sessionleak"
)

func TestMain(m *testing.M) {
	gdrcodec.Register() // the servers here serve gdr calls
	os.Exit(leaktest.Run(m, func() error { return sessionleak.Check() }))
}
