package gdrpc_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc"
)

// The receive-space options override each other in order: a size is one
// space of that size, a limit lets the spaces grow, and 0 or less turns
// the space off either way.
func TestReceiveSpaceOptions(t *testing.T) {
	for _, tt := range []struct {
		name         string
		opts         []gdrpc.Option
		space, limit int
	}{
		{"default", nil, 0, 0},
		{"size", []gdrpc.Option{gdrpc.WithReceiveSpace(8 << 20)}, 8 << 20, 0},
		{"limit", []gdrpc.Option{gdrpc.WithReceiveSpaceLimit(32 << 20)}, 0, 32 << 20},
		{"limit after size", []gdrpc.Option{gdrpc.WithReceiveSpace(8 << 20), gdrpc.WithReceiveSpaceLimit(32 << 20)}, 0, 32 << 20},
		{"size after limit", []gdrpc.Option{gdrpc.WithReceiveSpaceLimit(32 << 20), gdrpc.WithReceiveSpace(8 << 20)}, 8 << 20, 0},
		{"no size", []gdrpc.Option{gdrpc.WithReceiveSpace(0)}, -1, 0},
		{"no limit", []gdrpc.Option{gdrpc.WithReceiveSpaceLimit(-5)}, -1, -5},
	} {
		var c gdrpc.Config
		for _, o := range tt.opts {
			o(&c)
		}
		require.Equal(t, tt.space, c.ReceiveSpace, tt.name)
		require.Equal(t, tt.limit, c.ReceiveSpaceLimit, tt.name)
	}
}
