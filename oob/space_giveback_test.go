package oob

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// A give-back of a range the application does not hold (one given back
// already) queues no SPACE-FREE: a notice for a range not held would name
// offset 0, no length and no write.
func TestSpaceGiveBackOfRangeNotHeld(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	sp, ps := requestSpace(t, cs, ss, 41)
	client := ss.Peer().ID
	atZero := writtenInto(t, ps, client, 4096) // held throughout
	other := writtenInto(t, ps, client, 4096)
	require.Zero(t, atZero.SpaceOffset)

	sp.mu.Lock()
	sp.held = true // the notices stay queued
	sp.mu.Unlock()
	t.Cleanup(func() { markClosed(sp) })
	held, _, err := fetchLanded(context.Background(), atZero, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, held.Release()) })
	b, _, err := fetchLanded(context.Background(), other, nil)
	require.NoError(t, err)
	require.NoError(t, b.Release())
	sp.giveBack(other.SpaceOffset) // given back already

	sp.mu.Lock()
	pending := slices.Clone(sp.pending)
	sp.mu.Unlock()
	require.Equal(t, []heldRange{{other.SpaceOffset, 4096, other.SpaceGen}}, pending,
		"one notice for the write given back, none for a range not held")
}
