package oob

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// TestRefusedSpaceGivenBack: a client that trusts its server advertises
// receive space after a pull by rdma; a server that does not trust its
// clients refuses it and says so (SPACE-WITHDRAWN), and the client gives the
// space's memory back at once, not when the session ends, and advertises no
// other over the session, however large its later pulls.
func TestRefusedSpaceGivenBack(t *testing.T) {
	rc := ucxContext(t, "tcp")
	base := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX)}
	clientOpts := append(append([]transport.Option{}, base...), transport.WithTrustPeers(true))
	pool := HostPool(rc)
	before := ReadStats()
	inUse := pool.Stats().BytesInUse
	var advertised atomic.Int32
	interceptControl(t, ctlSpace, func(*transport.Session, []byte) bool {
		advertised.Add(1)
		return false
	})
	_, cs, ss, _, _ := lanePair(t, base, clientOpts)
	for i, n := range []int{1 << 20, 8 << 20} {
		want := bytes.Repeat([]byte{byte(i + 1)}, n)
		d := Offer(Source{Bytes: want}, OfferOptions{})
		t.Cleanup(func() { Withdraw(d.Token) })
		d.Owner = cs.Peer().ID
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		dst, path, err := FetchFrom(ctx, d, pool)
		cancel()
		require.NoError(t, err)
		require.Equal(t, PathRDMA, path)
		got, err := dst.HostBytes()
		require.NoError(t, err)
		require.True(t, bytes.Equal(want, got), "pull %d", i)
		dst.Release()
		require.Eventually(t, func() bool {
			return !advertisesOver(cs) && ReadStats().Spaces == before.Spaces && pool.Stats().BytesInUse == inUse
		}, 10*time.Second, time.Millisecond, "pull %d: the refused space's memory goes back", i)
		require.Empty(t, peerSpacesOf(ss), "the untrusting server took no space")
	}
	require.NoError(t, cs.Close())
	select {
	case <-ss.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the server's session outlived the client's close")
	}
	require.Equal(t, int32(1), advertised.Load(), "one space advertised over the session, refused, and no other")
}
