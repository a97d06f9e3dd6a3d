//go:build cgo && !nordma && linux

package rdma_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// A key of a peer's shared-memory segment reserves the address space its
// mapping takes while it lives, and gives it back when it goes.
func TestKeyGivesBackAddressSpace(t *testing.T) {
	c := newContext(t, transports[0].tls)
	client, _ := pair(t, c)
	before := rdma.MappedSegments()
	_, _, rk := exposed(t, c, client, 1<<20)
	require.True(t, rk.Direct())
	require.GreaterOrEqual(t, rdma.MappedSegments()-before, uint64(1<<20), "the segment's mapping reserved")
	require.NoError(t, rk.Close())
	require.Equal(t, before, rdma.MappedSegments(), "given back with the key")
}
