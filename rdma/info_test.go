package rdma

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestInfoAtLeast(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want bool
	}{
		{"1.18.1", true},
		{"1.18", true},
		{"1.19.0", true},
		{"2.0.0", true},
		{"1.17.9", false},
		{"1.16.0", false},
		{"1.13.1", false},
		{"0.99", false},
		{"", false},
		{"1", false},
		{"one.18", false},
		{"1.x", false},
	} {
		require.Equal(t, tc.want, Info{Version: tc.v}.AtLeast(1, 18), "version %q", tc.v)
	}
}
