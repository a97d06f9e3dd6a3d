//go:build cgo && !nocuda

package nvmlinv

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
	"github.com/gdrpc/gdrpc/internal/testenv"
)

func TestCPUList(t *testing.T) {
	for _, c := range []struct {
		name string
		mask []uint
		want string
	}{
		{"empty", nil, ""},
		{"none", []uint{0}, ""},
		{"one", []uint{1 << 3}, "3"},
		{"range", []uint{0xffff}, "0-15"},
		{"two ranges across words", []uint{0xffff << 48, 0xf}, "48-67"},
		{"split", []uint{0b1011}, "0-1,3"},
		{"last bit", []uint{0, 1 << 63}, "127"},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, CPUList(c.mask))
		})
	}
}

func TestNormBusID(t *testing.T) {
	require.Equal(t, "0000:3b:00.0", normBusID("00000000:3B:00.0"))
	require.Equal(t, "0000:3b:00.0", normBusID("0000:3B:00.0"))
}

func TestGPUsWithoutNVML(t *testing.T) {
	gpus, err := Default().GPUs()
	if err == nil {
		t.Logf("NVML present: %+v", gpus)
		return
	}
	if testenv.Required("cuda") {
		t.Fatalf("GDRPC_REQUIRE=cuda: %v", err)
	}
	require.True(t, errors.Is(err, driver.ErrNotSupported), "%v", err)
	require.Contains(t, err.Error(), "libnvidia-ml.so.1")
}
