package listener_test

import (
	"os"
	"testing"

	"github.com/gdrpc/gdrpc/gdrcodec"
)

func TestMain(m *testing.M) {
	gdrcodec.Register() // the servers here serve gdr calls
	os.Exit(m.Run())
}
