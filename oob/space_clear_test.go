package oob

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// spaceAfterOtherPeer is a trusted UCX (tcp) session, A, whose client advertised
// a receive space of spaceBytes to its server after a pull of a 256 KiB
// payload into memory of the client's host pool. Before that, the client
// pulled a payload of spaceBytes from another peer, B, over a session of its
// own into the same pool, and released it, as a decoded message's buffer
// goes back: B's bytes are what the space's memory held. It returns A's
// client and server sessions, a context of a message that came over A (as
// gRPC's peer of the client's call has it), the space, and B's payload.
func spaceAfterOtherPeer(t *testing.T, spaceBytes int) (cs, ss *transport.Session, fromServer context.Context, sp *space, other []byte) {
	t.Helper()
	setTransferConfig(t, TransferConfig{ReceiveSpace: spaceBytes})
	rc := ucxContext(t, "tcp")
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX)}
	trusted := append(append([]transport.Option{}, ucx...), transport.WithTrustPeers(true))
	pool := HostPool(rc)
	pull := func(from *transport.Session, payload []byte) {
		t.Helper()
		d := Offer(Source{Bytes: payload}, OfferOptions{})
		t.Cleanup(func() { Withdraw(d.Token) })
		d.Owner = from.PeerID()
		dst, path, err := FetchFrom(testContext(t), d, pool)
		require.NoError(t, err)
		require.Equal(t, PathRDMA, path)
		got, err := dst.HostBytes()
		require.NoError(t, err)
		require.True(t, bytes.Equal(payload, got))
		require.NoError(t, dst.Release())
	}

	// Peer B (untrusted: its session gets no space) sends the client a
	// payload of the space's size; the client decodes and releases it.
	_, csB, _, _, _ := lanePair(t, ucx, ucx)
	other = bytes.Repeat([]byte("PEER-B-SECRET "), spaceBytes/14+1)[:spaceBytes]
	pull(csB, other)

	// Peer A, trusted: a pull by rdma prompts the client's space.
	_, cs, ss, cc, _ := lanePair(t, trusted, trusted)
	pull(cs, bytes.Repeat([]byte{7}, 256<<10))
	require.Eventually(t, func() bool { return len(peerSpacesOf(ss)) == 1 }, 10*time.Second, time.Millisecond, "the server took the client's space")
	a := stateOf(cs)
	a.space.mu.Lock()
	require.Len(t, a.space.own, 1)
	sp = a.space.own[0]
	a.space.mu.Unlock()
	fromServer = peer.NewContext(testContext(t), &peer.Peer{Addr: cc.RemoteAddr()})
	require.Equal(t, cs, transport.SessionFromContext(fromServer))
	return cs, ss, fromServer, sp, other
}

// TestSpaceMemoryCleared: a receive space is memory of the receiver's
// allocator, offered to a path on which the receiver cannot count what
// arrives (rdma, cuda-ipc), as a rendezvous destination is, and so is
// cleared as one is. A descriptor naming a range the owner never wrote must
// not hand the application whatever the allocator's block held before:
// here another peer's payload, which the application might hand back to A
// (an echo, an error message). What reaches it is bytes that arrived, or
// zeros.
func TestSpaceMemoryCleared(t *testing.T) {
	const spaceBytes = 1 << 20
	cs, _, fromServer, sp, other := spaceAfterOtherPeer(t, spaceBytes)
	const off, n = 512 << 10, 4096 // nothing was ever written there
	d := Descriptor{Owner: cs.PeerID(), Token: Token(newToken()), Length: n, Kind: devicebuf.Host, Device: -1,
		Space: sp.id, SpaceOffset: off, SpacePath: PathRDMA, SpaceGen: 1}
	b, path, err := FetchNew(fromServer, d, func(int) (*devicebuf.Buffer, error) {
		return nil, errors.New("nothing is allocated: the payload is in receive space")
	})
	require.NoError(t, err)
	require.Equal(t, PathRDMA, path)
	hb, err := b.HostBytes()
	require.NoError(t, err)
	got := bytes.Clone(hb)
	require.NoError(t, b.Release())
	leaked := bytes.Equal(got, other[off:off+n])
	require.False(t, leaked, "A's descriptor handed the application peer B's bytes, left in the space's memory, as a payload that never arrived: %q", got[:36])
	require.Equal(t, make([]byte, n), got, "a range nothing was written into reaches the application uncleared")
}

// makingSpace is the receive space the tests below configure: large enough
// that making and clearing it (fresh memory) takes a while.
const makingSpace = 512 << 20

// promptSpace makes a trusted UCX (tcp) session on rc, pulls one
// payload over it into rc's host pool, which starts the making of the
// client's receive space on a goroutine of its own, waits until that
// goroutine reserved the space's bytes (it is making the space then), and
// returns the client's session.
func promptSpace(t *testing.T, rc *rdma.Context) *transport.Session {
	t.Helper()
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX), transport.WithTrustPeers(true)}
	_, cs, _, _, _ := lanePair(t, ucx, ucx)
	payload := bytes.Repeat([]byte{7}, 256<<10)
	d := Offer(Source{Bytes: payload}, OfferOptions{})
	t.Cleanup(func() { Withdraw(d.Token) })
	d.Owner = cs.PeerID()
	dst, path, err := FetchFrom(testContext(t), d, HostPool(rc))
	require.NoError(t, err)
	require.Equal(t, PathRDMA, path)
	require.NoError(t, dst.Release())
	// The space is being made once its bytes are reserved (Stats.SpaceBytes
	// counts spaces being made).
	require.Eventually(t, func() bool { return ReadStats().SpaceBytes == makingSpace }, 10*time.Second, 100*time.Microsecond)
	return cs
}

// Session.Close waits, through the engine's Join, for the goroutine that makes
// a receive space after a pull: it allocates, clears and registers the
// space's memory from the pool and UCX context that the application closes
// next.
func TestCloseWaitsForSpaceMaking(t *testing.T) {
	setTransferConfig(t, TransferConfig{ReceiveSpace: makingSpace})
	rc := ucxContext(t, "tcp")
	cs := promptSpace(t, rc)
	require.NoError(t, cs.Close())
	making := ReadStats().Making
	// Let it end before the context's cleanup closes the pool and the context.
	require.Eventually(t, func() bool { return ReadStats().Making == 0 }, 20*time.Second, time.Millisecond)
	require.Zero(t, making, "Session.Close (and the engine's Join) returned while a receive space of the session was still being made")
}
