package oob

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/transport"
)

// requestSpace makes ss advertise a 64 KiB host space to the peer of cs, as
// a server does after its first pull of a request, and returns the space and
// the writer's view of it.
func requestSpace(t *testing.T, cs, ss *transport.Session, id uint64) (*space, *peerSpace) {
	t.Helper()
	return requestSpaceOf(t, cs, ss, id, 64<<10)
}

// requestSpaceOf is requestSpace with a space of n bytes.
func requestSpaceOf(t *testing.T, cs, ss *transport.Session, id uint64, n int) (*space, *peerSpace) {
	t.Helper()
	sp, m := ownSpace(t, ss, id, n)
	handleSpace(cs, m.marshal())
	ps := peerSpaceByID(cs, id)
	require.NotNil(t, ps, "a client takes a server's space")
	return sp, ps
}

// ownSpace makes an n-byte host space of ss, as its own, and the SPACE that
// advertises it.
func ownSpace(t *testing.T, ss *transport.Session, id uint64, n int) (*space, *spaceMsg) {
	t.Helper()
	sp := makeSpace(id, ss, devicebuf.HostFromBytes(make([]byte, n)), PathRDMA)
	st := &stateOf(ss).space
	st.mu.Lock()
	st.own = append(st.own, sp)
	st.mu.Unlock()
	spaces.Store(sp.id, sp)
	t.Cleanup(func() { spaces.Delete(sp.id) })
	return sp, &spaceMsg{rtr: rtr{Req: id, Length: uint64(n), Offers: PathRDMA, RAddr: 4096, RKey: []byte{1}}}
}

// written takes a range of ps for an n-byte payload, as land does once the
// write went well, and returns the descriptor naming it.
func writtenInto(t *testing.T, ps *peerSpace, owner transport.ID, n uint64) Descriptor {
	t.Helper()
	off, gen, ok := ps.take(n, 0)
	require.True(t, ok)
	require.True(t, ps.endWrite(off, gen, true))
	ps.writers.Done()
	return Descriptor{Owner: owner, Token: Token{1}, Length: n, Kind: devicebuf.Host, Device: -1, Space: ps.id, SpaceOffset: off, SpacePath: PathRDMA, SpaceGen: gen}
}

// waitGivenBack waits until the owner gave back the range d names.
func waitGivenBack(t *testing.T, ps *peerSpace, d Descriptor, msg string) {
	t.Helper()
	require.Eventually(t, func() bool {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		_, ok := ps.taken[d.SpaceOffset]
		return !ok
	}, 10*time.Second, time.Millisecond, msg)
}

// A write given back is stale: a descriptor naming it again (a request gRPC
// replayed), or an earlier write into the same range, is refused as not in
// the space, so that the receiver pulls it by token; the next write there
// is taken. Writes numbered 0 (an older owner's) are never stale.
func TestStaleWrites(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	_, ps := requestSpace(t, cs, ss, 21)
	client := ss.Peer().ID
	first := writtenInto(t, ps, client, 4096) // so that d's write has an earlier one
	d := writtenInto(t, ps, client, 4096)
	b, _, err := fetchLanded(context.Background(), d, nil)
	require.NoError(t, err)
	_, _, err = fetchLanded(context.Background(), d, nil)
	require.ErrorIs(t, err, errNotInSpace, "held")
	require.NoError(t, b.Release())
	waitGivenBack(t, ps, d, "given back to the writer")
	_, _, err = fetchLanded(context.Background(), d, nil)
	require.ErrorIs(t, err, errNotInSpace, "taken before")
	earlier := d
	earlier.SpaceGen = first.SpaceGen
	_, _, err = fetchLanded(context.Background(), earlier, nil)
	require.ErrorIs(t, err, errNotInSpace, "an earlier write")
	kept, _, err := fetchLanded(context.Background(), first, nil)
	require.NoError(t, err, "another range's write")

	next := writtenInto(t, ps, client, 4096) // first fit: first's range is held
	require.Equal(t, d.SpaceOffset, next.SpaceOffset, "the range is written again")
	b, _, err = fetchLanded(context.Background(), next, nil)
	require.NoError(t, err)
	require.NoError(t, b.Release())
	require.NoError(t, kept.Release())

	unnumbered := next
	unnumbered.SpaceGen = 0
	for range 2 {
		b, _, err = fetchLanded(context.Background(), unnumbered, nil)
		require.NoError(t, err)
		require.NoError(t, b.Release())
	}
}

// WRITES-ENDED gives back the named writes the owner never took, over the
// session the space was advertised on: a write the owner holds stays until
// it is released, one it gave back already is not given back twice, and a
// write given back this way is stale.
func TestWritesEnded(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	sp, ps := requestSpace(t, cs, ss, 22)
	client := ss.Peer().ID
	untaken := writtenInto(t, ps, client, 100)
	held := writtenInto(t, ps, client, 5000)
	b, _, err := fetchLanded(context.Background(), held, nil)
	require.NoError(t, err)
	require.Len(t, ps.taken, 2)

	// Another session's peer cannot name this space.
	cs2, ss2 := tcpPair(t, transport.WithTrustPeers(true))
	_ = cs2
	handleWritesEnded(ss2, writesEnded([]spaceWrite{{spaceRange{22, untaken.SpaceOffset, untaken.SpaceGen}, 100}}))
	sp.mu.Lock()
	require.False(t, sp.staleLocked(untaken.SpaceOffset, untaken.SpaceGen), "another session's WRITES-ENDED")
	sp.mu.Unlock()

	WritesEnded(cs, []Descriptor{untaken, held, descriptorOf(10)})
	waitGivenBack(t, ps, untaken, "the untaken write is given back")
	_, _, err = fetchLanded(context.Background(), untaken, nil)
	require.ErrorIs(t, err, errNotInSpace, "a copy of the request still on its way is pulled instead")
	ps.mu.Lock()
	require.Contains(t, ps.taken, held.SpaceOffset, "the held write stays")
	ps.mu.Unlock()

	require.NoError(t, b.Release())
	require.Eventually(t, func() bool {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		return len(ps.taken) == 0
	}, 10*time.Second, time.Millisecond)
	// Named again, after both were given back: nothing is given back twice
	// (a later write into the range keeps it).
	again := writtenInto(t, ps, client, 100)
	require.Equal(t, untaken.SpaceOffset, again.SpaceOffset)
	handleWritesEnded(ss, writesEnded([]spaceWrite{{spaceRange{22, untaken.SpaceOffset, untaken.SpaceGen}, 100}, {spaceRange{22, held.SpaceOffset, held.SpaceGen}, 5000}}))
	sp.mu.Lock()
	require.Empty(t, sp.pending, "no SPACE-FREE queued")
	sp.mu.Unlock()
	require.Len(t, ps.taken, 1)
}

func TestWritesEndedMessage(t *testing.T) {
	ws := []spaceWrite{{spaceRange{1, 0, 5}, 10}, {spaceRange{2, 4096, 6}, 1 << 20}}
	got, err := parseWritesEnded(writesEnded(ws))
	require.NoError(t, err)
	require.Equal(t, ws, got)
	for name, b := range map[string][]byte{
		"empty":     nil,
		"version":   {9, 0, 0},
		"short":     writesEnded(ws)[:20],
		"trailing":  append(writesEnded(ws), 0),
		"too many":  writesEnded(make([]spaceWrite, maxCallTaken+1)),
		"space 0":   writesEnded([]spaceWrite{{spaceRange{0, 0, 5}, 10}}),
		"write 0":   writesEnded([]spaceWrite{{spaceRange{1, 0, 0}, 10}}),
		"no length": writesEnded([]spaceWrite{{spaceRange{1, 0, 5}, 0}}),
	} {
		_, err := parseWritesEnded(b)
		require.Error(t, err, name)
	}
}

// Malformed or out-of-range writes free nothing.
func TestWritesEndedOutOfRange(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	sp, _ := requestSpace(t, cs, ss, 23)
	for _, w := range []spaceWrite{
		{spaceRange{23, 8, 5}, 10},            // unaligned
		{spaceRange{23, 64 << 10, 5}, 10},     // past the end
		{spaceRange{23, 60 << 10, 5}, 8192},   // runs past the end
		{spaceRange{23, 4096, 5}, ^uint64(0)}, // wraps
		{spaceRange{24, 0, 5}, 10},            // another space
	} {
		handleWritesEnded(ss, writesEnded([]spaceWrite{w}))
	}
	handleWritesEnded(ss, []byte{1, 0})
	sp.mu.Lock()
	defer sp.mu.Unlock()
	require.Empty(t, sp.pending)
	require.Nil(t, sp.last, "nothing recorded as given back")
}

func FuzzParseWritesEnded(f *testing.F) {
	f.Add(writesEnded([]spaceWrite{{spaceRange{1, 0, 5}, 10}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		ws, err := parseWritesEnded(b)
		if err != nil {
			return
		}
		require.LessOrEqual(t, len(ws), maxCallTaken)
		for _, w := range ws {
			require.NotZero(t, w.space)
			require.NotZero(t, w.gen)
			require.NotZero(t, w.n)
		}
	})
}

// A long stream's writes are named in several WRITES-ENDED, each within the
// bound: every untaken one is given back.
func TestWritesEndedMany(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	_, ps := requestSpaceOf(t, cs, ss, 25, 8<<20)
	client := ss.Peer().ID
	var ds []Descriptor
	for range maxCallTaken + 100 {
		ds = append(ds, writtenInto(t, ps, client, 4096))
	}
	WritesEnded(cs, ds)
	require.Eventually(t, func() bool {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		return len(ps.taken) == 0
	}, 10*time.Second, time.Millisecond)
}

// A receiver that refuses a payload without taking it (Discard) gives its
// range back once: not a write given back already, and a descriptor naming
// a space closed with its session is not in the space (the receiver pulls
// by token instead).
func TestDiscardStaleAndClosed(t *testing.T) {
	opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithTrustPeers(true)}
	_, cs, ss, _, sc := lanePair(t, opts, opts)
	sp, ps := requestSpace(t, cs, ss, 26)
	client := ss.Peer().ID
	d := writtenInto(t, ps, client, 4096)
	b, _, err := fetchLanded(context.Background(), d, nil)
	require.NoError(t, err)
	require.NoError(t, b.Release())
	waitGivenBack(t, ps, d, "given back once")

	sp.mu.Lock()
	sp.held = true // hold the notices queued from here on
	sp.mu.Unlock()
	fromClient := peer.NewContext(context.Background(), &peer.Peer{Addr: sc.RemoteAddr()}) // the client's call
	Discard(fromClient, d)
	fresh := writtenInto(t, ps, client, 4096)
	fresh2 := writtenInto(t, ps, client, 4096)
	Discard(context.Background(), fresh2) // no call's session: nothing given back
	Discard(fromClient, fresh)
	sp.mu.Lock()
	pending := slices.Clone(sp.pending)
	sp.mu.Unlock()
	markClosed(sp) // still held: nothing queued goes
	require.Equal(t, []heldRange{{fresh.SpaceOffset, 4096, fresh.SpaceGen}}, pending, "the stale write is not given back again")
	_, _, err = fetchLanded(context.Background(), fresh2, nil)
	require.ErrorIs(t, err, errNotInSpace)
}

// A space's SPACE-FREEs go from one goroutine that waits for the next
// release, from the first release until the space's session ends: no
// release starts a goroutine, and none is left after the session.
func TestSpaceFreeSender(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	_, ps := requestSpace(t, cs, ss, 28)
	client := ss.Peer().ID
	seen := map[string]bool{}
	for i := range 16 {
		d := writtenInto(t, ps, client, 4096)
		b, _, err := fetchLanded(context.Background(), d, nil)
		require.NoError(t, err)
		require.NoError(t, b.Release())
		waitGivenBack(t, ps, d, "given back")
		var waiting []string
		require.Eventually(t, func() bool {
			waiting = freeSenders(true)
			return len(waiting) == 1
		}, 10*time.Second, time.Millisecond, "release %d: one sender waits for the next", i)
		seen[waiting[0]] = true
	}
	require.Len(t, seen, 1, "the goroutines that sent 16 SPACE-FREEs one after another")
	require.NoError(t, ss.Close())
	require.Eventually(t, func() bool { return len(freeSenders(false)) == 0 }, 10*time.Second, time.Millisecond, "the sender ends with its session")
}

// freeSenders returns the ids of the goroutines that run a space's
// sendFrees, only those waiting for the next release when waiting.
func freeSenders(waiting bool) []string {
	var ids []string
	for _, g := range leaktest.Goroutines("oob.(*space).sendFrees") {
		head, _, _ := strings.Cut(g, "\n")
		if waiting && !strings.Contains(head, "[select") {
			continue
		}
		ids = append(ids, testenv.StackGoroutineID(head))
	}
	return ids
}

// A peer that names ever newer writes in WRITES-ENDED while this side's
// SPACE-FREEs cannot go (it stopped reading its control stream) leaves one
// notice queued per range, its latest write's: what stays queued is bounded
// by the space's size, not by what the peer sends.
func TestQueuedFreesBounded(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	sp, _ := requestSpace(t, cs, ss, 33)
	sp.mu.Lock()
	sp.held = true // the notices stay queued, as behind a control stream nobody reads
	sp.mu.Unlock()
	ranges := uint64(sp.region.Len() / spaceAlign)
	latest := map[uint64]uint64{} // offset -> the newest write named there
	gen := uint64(0)
	for range 64 {
		ws := make([]spaceWrite, 0, maxCallTaken)
		for i := range uint64(maxCallTaken) {
			gen++
			off := i % ranges * spaceAlign
			ws = append(ws, spaceWrite{spaceRange{sp.id, off, gen}, spaceAlign})
			latest[off] = gen
		}
		handleWritesEnded(ss, writesEnded(ws))
	}
	sp.mu.Lock()
	pending := slices.Clone(sp.pending)
	sp.mu.Unlock()
	require.Equal(t, int(ranges), len(pending), "one notice per range of the space")
	for _, h := range pending {
		require.Equal(t, latest[h.off], h.gen, "the notice at offset %d names its latest write", h.off)
	}
	markClosed(sp)
}

// A SPACE handled after a SPACE-WITHDRAW (the receiver sent it first, but
// the two went to concurrent handlers) is refused: the owner answered the
// withdrawal already, and never writes into the space. Handled in order, the
// space is taken, and the withdrawal closes it.
func TestSpaceAfterWithdrawRefused(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	const id = 34
	sp, m := ownSpace(t, ss, id, 64<<10)

	// The owner's handler of the SPACE runs only once the receiver has the
	// answer to its withdrawal, sent after the SPACE.
	handled := make(chan *peerSpace)
	intercept(t, ctlSpace, cs, func(p []byte) {
		<-sp.withdrawn
		handleSpace(cs, p)
		handled <- peerSpaceByID(cs, id)
	})
	require.NoError(t, sendControl(context.Background(), ss, ctlSpace, m.marshal())) // as maybeAdvertise
	withdrawSpace(stateOf(ss))                                                       // as Linger
	// withdrawSpace waits for the answer within a bound of its own; a loaded
	// machine may pass it.
	waitFor(t, (<-chan struct{})(sp.withdrawn), "the answer to the withdrawal")
	require.Nil(t, <-handled, "the owner takes a space whose withdrawal it answered")

	// In order, on another pair: taken, then closed by the withdrawal.
	cs, ss = tcpPair(t, transport.WithTrustPeers(true))
	_, ps := requestSpace(t, cs, ss, 35)
	handleSpaceWithdraw(cs, rangeNotice(35, 0, 0))
	_, _, ok := ps.take(4096, 0)
	require.False(t, ok, "a withdrawn space takes no write")
}
