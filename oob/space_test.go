package oob

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

func TestPeerSpaceRanges(t *testing.T) {
	p := testPeerSpace(4 * spaceAlign)
	written := func(n uint64) uint64 { // a range taken and written
		off, gen, ok := p.take(n, 0)
		require.True(t, ok)
		require.True(t, p.endWrite(off, gen, true))
		return off
	}
	a := written(1)              // rounded up to spaceAlign
	b := written(spaceAlign + 1) // two units
	c := written(spaceAlign)
	require.Equal(t, []uint64{0, spaceAlign, 3 * spaceAlign}, []uint64{a, b, c})
	_, _, ok := p.take(1, 0)
	require.False(t, ok, "full")

	require.False(t, p.give(spaceAlign, spaceAlign, 0), "a length other than the one taken")
	require.False(t, p.give(2*spaceAlign, spaceAlign, 0), "the middle of a taken range")
	require.True(t, p.give(spaceAlign, spaceAlign+1, 0))
	require.False(t, p.give(spaceAlign, spaceAlign+1, 0), "given back twice")
	_, _, ok = p.take(3*spaceAlign, 0)
	require.False(t, ok, "two units free, not three")
	require.True(t, p.give(0, 1, 0))
	require.True(t, p.give(3*spaceAlign, spaceAlign, 0))
	require.Equal(t, []span{{0, 4 * spaceAlign}}, p.free, "merged")
	var free uint64
	for _, f := range p.free {
		free += f.n
	}
	require.Equal(t, uint64(4*spaceAlign), free)
	require.Empty(t, p.taken)
}

// A copy takes a free event while there is one; once every event marks a
// range still held, copies share them in turn, and an event is free again
// only once no held range is marked by it: giving back a range whose event
// another shares frees nothing.
func TestPeerSpaceEventsShared(t *testing.T) {
	p := testPeerSpace(8 * spaceAlign)
	p.events = make([]devicebuf.IPCEventHandle, 3)
	p.eventUses = make([]int, 3)
	free := func() []int { // the events that mark no held range
		var is []int
		for i, n := range p.eventUses {
			if n == 0 {
				is = append(is, i)
			}
		}
		return is
	}
	mark := func() (uint64, int) { // a range taken, written, and its copy's event
		off, gen, ok := p.take(1, 0)
		require.True(t, ok)
		p.mu.Lock()
		i := p.eventForLocked()
		p.takeEventLocked(off, i)
		p.mu.Unlock()
		require.True(t, p.endWrite(off, gen, true))
		return off, i
	}
	var offs []uint64
	var got []int
	for range 5 {
		off, i := mark()
		offs, got = append(offs, off), append(got, i)
	}
	require.Equal(t, []int{0, 1, 2, 0, 1}, got, "the free events, then each in turn")
	require.Equal(t, []int{2, 2, 1}, p.eventUses)
	require.Empty(t, free())

	require.True(t, p.give(offs[0], 1, 0))
	require.Empty(t, free(), "event 0 still marks a held range")
	require.True(t, p.give(offs[2], 1, 0))
	require.Equal(t, []int{2}, free())
	off, i := mark()
	require.Equal(t, 2, i, "a free event before a shared one")
	require.True(t, p.give(offs[3], 1, 0))
	require.True(t, p.give(off, 1, 0))
	require.Equal(t, []int{0, 2}, free())
	require.Equal(t, []int{0, 2, 0}, p.eventUses)

	// A copy that failed lets go of its event the same way.
	off, gen, ok := p.take(1, 0)
	require.True(t, ok)
	p.mu.Lock()
	i = p.eventForLocked()
	p.takeEventLocked(off, i)
	p.mu.Unlock()
	p.dropEvent(off, i)
	require.False(t, p.endWrite(off, gen, false))
	require.True(t, p.give(offs[1], 1, 0))
	require.True(t, p.give(offs[4], 1, 0))
	require.ElementsMatch(t, []int{0, 1, 2}, free())
	require.Equal(t, []int{0, 0, 0}, p.eventUses)
	require.Empty(t, p.eventOf)
}

// testPeerSpace is a peer's space of n bytes, nothing taken.
func testPeerSpace(n uint64) *peerSpace {
	return &peerSpace{id: 1, free: []span{{0, n}}, taken: map[uint64]*write{}, eventOf: map[uint64]int{}}
}

// A call's end takes back the writes for it that it did not take, at once
// or, for one still under way, when it ends; other calls' writes, and the
// ones it took, stay. Notices name the write: one about an earlier write
// into the same range frees nothing.
func TestPeerSpaceCallEnded(t *testing.T) {
	p := testPeerSpace(8 * spaceAlign)
	type w struct{ off, gen uint64 }
	write := func(call uint64) w {
		off, gen, ok := p.take(spaceAlign, call)
		require.True(t, ok)
		require.True(t, p.endWrite(off, gen, true))
		return w{off, gen}
	}
	taken, lost, other, unnumbered := write(7), write(7), write(8), write(0)
	off, gen, ok := p.take(spaceAlign, 7)
	require.True(t, ok)
	writing := w{off, gen}

	p.reclaimCall(7, map[spaceRange]bool{
		{p.id, taken.off, taken.gen}:   true,
		{p.id + 1, lost.off, lost.gen}: true, // another space's
		{p.id, lost.off, lost.gen + 9}: true, // another write into that range
	})
	require.ElementsMatch(t, []uint64{taken.off, other.off, unnumbered.off, writing.off}, slices.Collect(maps.Keys(p.taken)))
	require.False(t, p.endWrite(writing.off, writing.gen, true), "its call ended while it was written")
	require.NotContains(t, p.taken, writing.off)

	// The range the call lost is written again (first fit): a late notice
	// about the earlier write frees nothing, one about this write does.
	again := write(9)
	require.Equal(t, lost.off, again.off)
	require.False(t, p.give(lost.off, spaceAlign, lost.gen))
	p.reclaimCall(7, map[spaceRange]bool{{p.id, taken.off, taken.gen}: true}) // the same CALL-ENDED, again
	require.Contains(t, p.taken, again.off, "another call's write into the range")
	require.Contains(t, p.taken, taken.off)

	// A SPACE-FREE of a range still being written (no receiver has its
	// descriptor yet) frees nothing, named write or not; a write that
	// failed frees its range, and a later write into the range is not ended
	// by the failed one's end.
	off, gen, ok = p.take(spaceAlign, 10)
	require.True(t, ok)
	require.False(t, p.give(off, spaceAlign, gen))
	require.False(t, p.give(off, spaceAlign, 0))
	require.False(t, p.endWrite(off, gen, false))
	next := write(11)
	require.Equal(t, off, next.off)
	require.False(t, p.endWrite(off, gen, true))
	require.Contains(t, p.taken, next.off)

	for _, x := range []w{taken, other, unnumbered, again, next} {
		require.True(t, p.give(x.off, spaceAlign, x.gen), "%+v", x)
	}
	require.Empty(t, p.taken)
	require.Equal(t, []span{{0, 8 * spaceAlign}}, p.free)
}

// CALL-ENDED round-trips; malformed ones are refused.
func TestCallEndedMessage(t *testing.T) {
	took := []spaceRange{{1, 0, 5}, {2, 4096, 6}}
	id, got, unknown, err := parseCallEnded(callEnded(42, took, false))
	require.NoError(t, err)
	require.Equal(t, uint64(42), id)
	require.Equal(t, map[spaceRange]bool{{1, 0, 5}: true, {2, 4096, 6}: true}, got)
	require.False(t, unknown)
	id, got, unknown, err = parseCallEnded(callEnded(43, took, true))
	require.NoError(t, err)
	require.Equal(t, uint64(43), id)
	require.Empty(t, got, "a call that cannot name what it holds names nothing")
	require.True(t, unknown)
	for name, b := range map[string][]byte{
		"empty":                       nil,
		"version":                     append([]byte{9}, callEnded(1, nil, false)[1:]...),
		"call 0":                      callEnded(0, nil, false),
		"call 0, unknown":             callEnded(0, nil, true),
		"short":                       callEnded(1, took, false)[:20],
		"trailing":                    append(callEnded(1, nil, false), 0),
		"unknown, ranges":             append(callEnded(1, nil, true), callEnded(1, took, false)[11:]...),
		"too many":                    callEnded(1, make([]spaceRange, maxCallTaken+1), false),
		"too many, short of the mark": callEnded(1, make([]spaceRange, takenUnknown-1), false),
	} {
		_, _, _, err := parseCallEnded(b)
		require.Error(t, err, name)
	}
}

// markClosed closes sp as its session's end does, leaving it where it is
// (spaces still maps its id): nothing more lands, no notice goes.
func markClosed(sp *space) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	sp.markClosedLocked()
}

// An owner's copy into the space that never ends (its event recorded behind
// work that does not) fails the pull within the transfer timeout, or the
// caller's context, instead of holding the receiver, and the range goes
// back; one that ends is waited for.
// hungSpaceRig is a client's GPU receive space of one event on the fake
// GPU, a descriptor of a payload that landed in it, and the owner's stream,
// whose work before the event does not end until unhang.
type hungSpaceRig struct {
	cs     *transport.Session
	gpu    devicebuf.Allocator
	region *devicebuf.Buffer
	sp     *space
	d      Descriptor
	owner  *devicebuf.Stream
	unhang func()
}

func newHungSpaceRig(t *testing.T, id uint64, cfg TransferConfig) *hungSpaceRig {
	g := devicebuftest.Install(t, 1)
	setTransferConfig(t, cfg)
	cs, _ := tcpPair(t)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	region, err := gpu.Alloc(64 << 10)
	require.NoError(t, err)
	sp := makeSpace(id, cs, region, PathCUDAIPC)
	ev, _, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	sp.events = []*devicebuf.Event{ev}
	spaces.Store(sp.id, sp)
	t.Cleanup(func() { spaces.Delete(sp.id) })
	d := Descriptor{Owner: cs.Peer().ID, Token: Token{1}, Length: 4096, Kind: devicebuf.CUDA, Device: 0,
		Space: sp.id, SpacePath: PathCUDAIPC, SpaceEvent: 1}
	// The owner's stream: work that does not end, then its event.
	owner, err := devicebuf.NewCopyStream(0)
	require.NoError(t, err)
	unhang, err := g.Hang(owner.Handle())
	require.NoError(t, err)
	t.Cleanup(unhang)
	require.NoError(t, owner.Record(ev))
	return &hungSpaceRig{cs: cs, gpu: gpu, region: region, sp: sp, d: d, owner: owner, unhang: unhang}
}

func TestFetchLandedBoundsOwnersCopy(t *testing.T) {
	r := newHungSpaceRig(t, 9, TransferConfig{Timeout: 50 * time.Millisecond})
	cs, region, sp, d, owner, unhang := r.cs, r.region, r.sp, r.d, r.owner, r.unhang

	kind := func(err error) TransferErrorKind {
		var te *TransferError
		require.ErrorAs(t, err, &te)
		return te.Kind
	}
	start := time.Now()
	_, _, err := takeLanded(context.Background(), d)
	require.ErrorIs(t, err, context.DeadlineExceeded, "the transfer timeout")
	require.Equal(t, TransferTimeout, kind(err))
	require.Less(t, time.Since(start), 10*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, _, err = takeLanded(ctx, d)
	require.ErrorIs(t, err, context.Canceled, "the caller's context")
	require.Equal(t, TransferCanceled, kind(err))
	sp.mu.Lock()
	require.Empty(t, sp.inUse, "the ranges went back")
	sp.mu.Unlock()

	// Once the work ends, the copy is waited for and the range taken (the
	// fake runs a stream's work when it is synchronized, as the owner's copy
	// queue does).
	unhang()
	require.NoError(t, owner.Synchronize())
	b, _, err := fetchLanded(context.Background(), d, nil)
	require.NoError(t, err)
	markClosed(sp) // the release sends no SPACE-FREE, and frees the region and its event
	require.NoError(t, b.Release())
	require.NoError(t, cs.Close())
	require.Eventually(t, region.Released, 10*time.Second, time.Millisecond, "the region freed once the session was released")
	require.NoError(t, owner.Close())
}

// Stream-ordered, a payload in receive space is handed out before the
// owner's copy into it ended, but every wait for that copy is bounded as the
// default's is: by the transfer timeout, and by the caller's context where
// there is one. Fetch, which copies the payload into the caller's buffer,
// gives up with an error and gives the range back when the owner's copy
// never ends (its event recorded behind work that does not).
func TestFetchStreamOrderedBoundsOwnersCopy(t *testing.T) {
	r := newHungSpaceRig(t, 19, TransferConfig{Timeout: 50 * time.Millisecond, StreamOrdered: true})
	cs, region, sp, d, owner, unhang := r.cs, r.region, r.sp, r.d, r.owner, r.unhang
	require.True(t, cs.IsClient(), "stream-ordered payloads are a client's")
	dst, err := r.gpu.Alloc(4096)
	require.NoError(t, err)
	defer dst.Release()
	inUse := func() int {
		sp.mu.Lock()
		defer sp.mu.Unlock()
		return len(sp.inUse)
	}

	kind := func(err error) TransferErrorKind {
		var te *TransferError
		require.ErrorAs(t, err, &te)
		return te.Kind
	}
	start := time.Now()
	_, err = Fetch(context.Background(), d, dst)
	require.ErrorIs(t, err, devicebuf.ErrNotArrived, "the transfer timeout")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, TransferTimeout, kind(err), "classed as the default path's wait")
	require.Less(t, time.Since(start), 10*time.Second)
	require.Zero(t, inUse(), "the range went back")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = Fetch(ctx, d, dst)
	require.ErrorIs(t, err, context.Canceled, "the caller's context")
	require.Equal(t, TransferCanceled, kind(err))
	require.Zero(t, inUse(), "the range went back")

	// The buffer itself, handed out Pending: its waits end the same way.
	b, _, err := fetchLanded(context.Background(), d, nil)
	require.NoError(t, err)
	require.True(t, b.Pending())
	require.ErrorIs(t, b.Wait(), devicebuf.ErrNotArrived)
	require.ErrorIs(t, devicebuf.Copy(dst, b), devicebuf.ErrNotArrived)
	require.ErrorIs(t, b.Await(ctx), context.Canceled)
	require.True(t, b.Pending(), "a wait that gave up leaves the buffer Pending")
	unhang()
	require.NoError(t, owner.Synchronize())
	require.NoError(t, b.Wait())
	require.False(t, b.Pending())
	markClosed(sp) // the release sends no SPACE-FREE, and frees the region and its event
	require.NoError(t, b.Release())
	require.NoError(t, cs.Close())
	require.Eventually(t, region.Released, 10*time.Second, time.Millisecond, "the region freed once the session was released")
	require.NoError(t, owner.Close())
}

// A descriptor naming advertised space gets an error for every range the
// receiver cannot vouch for, and the space is left as it was.
func TestFetchLandedRefusesBadRanges(t *testing.T) {
	cs, _ := tcpPair(t)
	owner, other := cs.Peer().ID, transport.ID{2}
	mem := make([]byte, 64<<10)
	sp := makeSpace(7, cs, devicebuf.HostFromBytes(mem), PathRDMA)
	spaces.Store(sp.id, sp)
	t.Cleanup(func() { spaces.Delete(sp.id) }) // the last release below frees the region
	d := func(id, off, n uint64, path Path, from transport.ID) Descriptor {
		return Descriptor{Owner: from, Token: Token{1}, Length: n, Kind: devicebuf.Host, Device: -1, Space: id, SpaceOffset: off, SpacePath: path}
	}

	held, _, err := fetchLanded(context.Background(), d(7, 4096, 4096, PathRDMA, owner), nil)
	require.NoError(t, err)
	for name, bad := range map[string]Descriptor{
		"unknown space":         d(8, 0, 16, PathRDMA, owner),
		"another owner":         d(7, 0, 16, PathRDMA, other),
		"another path":          d(7, 0, 16, PathCUDAIPC, owner),
		"past the end":          d(7, 64<<10-8, 16, PathRDMA, owner),
		"offset past the end":   d(7, 1<<40, 16, PathRDMA, owner),
		"wrapping":              d(7, 8, ^uint64(0), PathRDMA, owner),
		"empty":                 d(7, 0, 0, PathRDMA, owner),
		"covers a held range":   d(7, 0, 3*4096, PathRDMA, owner),
		"unaligned":             d(7, 12<<10+8, 16, PathRDMA, owner),
		"the same range, twice": d(7, 4096, 4096, PathRDMA, owner),
		"ends in a held range":  d(7, 0, 4097, PathRDMA, owner),
		"an event never offered": func() Descriptor {
			x := d(7, 0, 16, PathRDMA, owner)
			x.SpaceEvent = 1
			return x
		}(),
	} {
		b, _, err := fetchLanded(context.Background(), bad, nil)
		require.Error(t, err, name)
		require.Nil(t, b, name)
	}
	require.Equal(t, map[uint64]heldRange{4096: {4096, 4096, 0}}, sp.inUse)

	// Neighbours of a held range are fine.
	for _, off := range []uint64{0, 8192} {
		b, _, err := fetchLanded(context.Background(), d(7, off, 4096, PathRDMA, owner), nil)
		require.NoError(t, err)
		require.NoError(t, b.Release())
	}
	// A call notes what it takes; once it ended (its CALL-ENDED gone out),
	// it takes nothing: the range is the owner's to take back.
	call := &Call{ID: 3}
	b, _, err := fetchLanded(context.Background(), d(7, 8192, 4096, PathRDMA, owner), call)
	require.NoError(t, err)
	require.Equal(t, []spaceRange{{7, 8192, 0}}, call.took)
	require.NoError(t, b.Release())
	call.ended = true
	_, _, err = fetchLanded(context.Background(), d(7, 16384, 4096, PathRDMA, owner), call)
	require.ErrorIs(t, err, errCallEnded)
	require.Equal(t, map[uint64]heldRange{4096: {4096, 4096, 0}}, sp.inUse)
	// Releasing gives the range back (the session is closed: no message).
	markClosed(sp)
	require.NoError(t, held.Release())
	require.Empty(t, sp.inUse)
	_, _, err = fetchLanded(context.Background(), d(7, 0, 16, PathRDMA, owner), nil)
	require.ErrorContains(t, err, "closed")
}

func TestDescriptorSpaceFields(t *testing.T) {
	d := descriptorOf(10)
	d.SpacePath = PathRDMA
	require.Error(t, d.Validate(), "a path without a space")
	d.SpacePath, d.SpaceOffset = PathNone, 5
	require.Error(t, d.Validate(), "an offset without a space")
	d.Space, d.SpaceOffset = 3, 0
	require.Error(t, d.Validate(), "a space without a path")
	for _, p := range []Path{PathStream, PathStaged, PathLocal, PathRDMA | PathCUDAIPC} {
		d.SpacePath = p
		require.Error(t, d.Validate(), "space written by %v", p)
	}
	for _, p := range []Path{PathRDMA, PathCUDAIPC} {
		d.SpacePath = p
		require.NoError(t, d.Validate())
	}
	d.SpaceEvent = 1
	require.NoError(t, d.Validate(), "an event of a CUDA IPC space")
	d.SpaceEvent = maxSpaceEvents + 1
	require.Error(t, d.Validate(), "an event past those a SPACE may offer")
	d.SpacePath, d.SpaceEvent = PathRDMA, 1
	require.Error(t, d.Validate(), "an event of a space written by puts")
	d.Space, d.SpacePath = 0, PathNone
	require.Error(t, d.Validate(), "an event without a space")
}

// A SPACE carries its events through the wire; events are for CUDA IPC
// spaces only, and bounded.
func TestSpaceMessage(t *testing.T) {
	m := &spaceMsg{rtr: rtr{Req: 3, Length: 1 << 20, Offers: PathCUDAIPC, IPCOffset: 4096, IPCDevice: "GPU-1"}}
	m.IPC[0] = 9
	for i := range 3 {
		var h devicebuf.IPCEventHandle
		h[0], h[63] = byte(i+1), 0xee
		m.Events = append(m.Events, h)
	}
	got, err := parseSpace(m.marshal())
	require.NoError(t, err)
	require.Equal(t, m, got)

	m.Events = m.Events[:0]
	got, err = parseSpace(m.marshal())
	require.NoError(t, err)
	require.Empty(t, got.Events)

	r := &spaceMsg{rtr: rtr{Req: 3, Length: 1 << 20, Offers: PathRDMA, RAddr: 4096, RKey: []byte{1}}, Events: make([]devicebuf.IPCEventHandle, 1)}
	_, err = parseSpace(r.marshal())
	require.Error(t, err, "events for a space written by puts")
	m.Events = make([]devicebuf.IPCEventHandle, maxSpaceEvents+1)
	_, err = parseSpace(m.marshal())
	require.Error(t, err, "too many events")
	m.Events = m.Events[:2]
	_, err = parseSpace(m.marshal()[:len(m.marshal())-1])
	require.Error(t, err, "a short event")
	got, err = parseSpace(m.rtr.marshal())
	require.NoError(t, err, "an older sender's SPACE, without events")
	require.Empty(t, got.Events)
}

// SPACE messages a session must not take: from an untrusted peer, on a
// client's session, after the session closed (the state of closed sessions
// is shared), a second with the same id, or more than maxSpaces.
func TestSpaceRefused(t *testing.T) {
	m := &spaceMsg{rtr: rtr{Req: 9, Length: 1 << 20, Offers: PathRDMA, RAddr: 4096, RKey: []byte{1}}}
	cs, ss := tcpPair(t) // peers not trusted
	for _, s := range []*transport.Session{cs, ss} {
		handleSpace(s, m.marshal())
		require.Empty(t, peerSpacesOf(s))
	}
	// The same message on a trusted server's session is taken, once.
	_, ts := tcpPair(t, transport.WithTrustPeers(true))
	handleSpace(ts, m.marshal())
	require.Len(t, peerSpacesOf(ts), 1)
	require.Equal(t, uint64(9), peerSpacesOf(ts)[0].id)
	handleSpace(ts, m.marshal())
	require.Len(t, peerSpacesOf(ts), 1, "the same id twice")
	for id := uint64(10); id < 10+maxSpaces; id++ {
		m2 := *m
		m2.Req = id
		handleSpace(ts, m2.marshal())
	}
	require.Len(t, peerSpacesOf(ts), maxSpaces, "at most maxSpaces per session")
	require.Equal(t, uint64(10+maxSpaces-2), peerSpacesOf(ts)[0].id, "newest first")
	require.NotNil(t, peerSpaceByID(ts, 9))
	require.Nil(t, peerSpaceByID(ts, 10+maxSpaces-1))

	require.NoError(t, ts.Close())
	handleSpace(ts, m.marshal())
	require.Empty(t, peerSpacesOf(ts))
	require.Empty(t, closedState.space.peer)
}

// An owner answers a withdrawal only once the writes into the space under
// way ended, and takes no range after it.
func TestSpaceWithdrawWaitsForWrites(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	m := &spaceMsg{rtr: rtr{Req: 5, Length: 1 << 20, Offers: PathRDMA, RAddr: 4096, RKey: []byte{1}}}
	handleSpace(ss, m.marshal())
	ps := peerSpaceByID(ss, 5)
	require.NotNil(t, ps)
	off, gen, ok := ps.take(4096, 0) // a write under way
	require.True(t, ok)

	answers := make(chan uint64, 1)
	intercept(t, ctlSpaceWithdrawn, cs, func(p []byte) {
		id, _, _, err := parseRangeNotice(p, "SPACE-WITHDRAWN")
		require.NoError(t, err)
		answers <- id
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		handleSpaceWithdraw(ss, rangeNotice(5, 0, 0))
	}()
	var endWrite sync.Once
	t.Cleanup(func() {
		endWrite.Do(ps.writers.Done) // should the test fail first
		<-done
	})
	require.Eventually(t, func() bool {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		return ps.closed
	}, 10*time.Second, time.Millisecond)
	_, _, ok = ps.take(4096, 0)
	require.False(t, ok, "a range taken while withdrawing")
	select {
	case <-done:
		t.Fatal("the withdrawal was answered with a write under way")
	case <-answers:
		t.Fatal("the withdrawal was answered with a write under way")
	default:
	}
	require.False(t, ps.endWrite(off, gen, false)) // the write failed: its range is free
	endWrite.Do(ps.writers.Done)                   // the write ends
	select {
	case id := <-answers:
		require.Equal(t, uint64(5), id)
	case <-time.After(10 * time.Second):
		t.Fatal("no answer to the withdrawal")
	}
}

// A space's memory goes back at once when its owner answered the
// withdrawal (it writes no more), and otherwise (its session died) only
// once the session's connections are released, so that a write the owner
// began before the end does not land in what the allocator hands out next.
func TestSpaceFreedAfterOwnerStopped(t *testing.T) {
	cs, ss := tcpPair(t, transport.WithTrustPeers(true))
	region := func() *devicebuf.Buffer {
		b, err := devicebuf.NewHostAllocator().Alloc(1 << 20)
		require.NoError(t, err)
		return b
	}
	withdrawn := makeSpace(1, ss, region(), PathRDMA)
	withdrawn.withdrawnOnce.Do(func() { close(withdrawn.withdrawn) })
	withdrawn.close()
	require.True(t, withdrawn.region.Released(), "an answered withdrawal frees the space at once")

	died := makeSpace(2, ss, region(), PathRDMA)
	died.close()
	require.False(t, died.region.Released(), "freed while the session's connections may still take a write")
	require.NoError(t, cs.Close())
	<-ss.Released()
	require.Eventually(t, died.region.Released, 10*time.Second, time.Millisecond, "freed once the session was released")
}

// Growing spaces hold four payloads of the size of the pull that prompted
// them, at least DefaultReceiveSpace or a quarter of their limit; a session
// advertises another only when its spaces cannot hold two payloads of a
// pull's size, within the limit, and a configured size once.
func TestDefaultSpace(t *testing.T) {
	const mib, lim = 1 << 20, DefaultReceiveSpaceLimit
	for _, tt := range []struct{ n, total, limit, want int }{
		{1, 0, lim, DefaultReceiveSpace},
		{mib, 0, lim, DefaultReceiveSpace},
		{16 * mib, 0, lim, DefaultReceiveSpace},
		{64 * mib, 0, lim, 256 * mib},
		{256 * mib, 0, lim, 1 << 30},
		{1 << 30, 0, lim, 0}, // two would not fit
		{256 * mib, 320 * mib, lim, 704 * mib},
		{256 * mib, 600 * mib, lim, 0},
		{mib, 0, 16 * mib, 4 * mib}, // a quarter of a small limit
		{3 * mib, 4 * mib, 16 * mib, 12 * mib},
		{5 * mib, 4 * mib, 16 * mib, 12 * mib},
		{7 * mib, 4 * mib, 16 * mib, 0}, // two would not fit in what is left
		{mib, 0, 1, 0},
		{0, 32 * mib, 16 * mib, 0}, // over a limit lowered since: none
	} {
		require.Equal(t, tt.want, defaultSpace(tt.n, tt.total, tt.limit), "after a pull of %d bytes, %d of %d advertised", tt.n, tt.total, tt.limit)
	}
	region := func(n int) *space { return &space{region: devicebuf.HostFromBytes(make([]byte, n))} }
	st := &spaceState{}
	require.Equal(t, DefaultReceiveSpace, st.nextSize(0, lim, mib))
	st.own = append(st.own, region(64<<10)) // small stand-ins for 64 MiB
	require.Equal(t, 0, st.nextSize(0, lim, 32<<10), "two payloads fit")
	require.Equal(t, DefaultReceiveSpace, st.nextSize(0, lim, 33<<10), "two payloads do not fit: another space")
	require.Equal(t, 0, st.nextSize(8*mib, 0, mib), "a configured size: the first space only")
	st.own = nil
	require.Equal(t, 8*mib, st.nextSize(8*mib, 0, mib))
	require.Equal(t, 0, st.nextSize(8*mib, 0, 5*mib), "a payload over half the configured space")
	for range maxSpaces {
		st.own = append(st.own, region(1))
	}
	require.Equal(t, 0, st.nextSize(0, lim, mib), "at most maxSpaces")
}

// The bound of all spaces defaults to DefaultSpaceBytes, or to a session's
// configured space where that is larger; a set bound is kept.
func TestSpaceBytesDefault(t *testing.T) {
	require.Equal(t, int64(DefaultSpaceBytes), TransferConfig{}.withDefaults().Limits.SpaceBytes)
	require.Equal(t, int64(8<<30), TransferConfig{ReceiveSpace: 8 << 30}.withDefaults().Limits.SpaceBytes)
	require.Equal(t, int64(6<<30), TransferConfig{ReceiveSpaceLimit: 6 << 30}.withDefaults().Limits.SpaceBytes)
	require.Equal(t, int64(1<<20), TransferConfig{ReceiveSpace: 8 << 30, Limits: Limits{SpaceBytes: 1 << 20}}.withDefaults().Limits.SpaceBytes)
}

// reserveSpace refuses what would go over the bound, and a bound below what
// other engines' spaces already take, without overflowing.
func TestReserveSpace(t *testing.T) {
	require.Equal(t, int64(0), ReadStats().SpaceBytes, "spaces of an earlier test left")
	require.True(t, reserveSpace(4<<20, 6<<20))
	require.False(t, reserveSpace(4<<20, 6<<20))
	require.False(t, reserveSpace(1, 2<<20), "already over a smaller bound")
	require.False(t, reserveSpace(math.MaxInt64, math.MaxInt64))
	require.False(t, reserveSpace(0, 6<<20))
	require.True(t, reserveSpace(2<<20, 6<<20))
	require.Equal(t, int64(6<<20), ReadStats().SpaceBytes)
	unreserveSpace(6 << 20)
	require.Equal(t, int64(0), ReadStats().SpaceBytes)
}

// Which sessions' spaces grow, and within what: a client's by default, a
// server's only with a limit, none with a configured size or none at all.
func TestSpaceLimit(t *testing.T) {
	for _, tt := range []struct {
		c              TransferConfig
		client, server int
	}{
		{TransferConfig{}, DefaultReceiveSpaceLimit, 0},
		{TransferConfig{ReceiveSpaceLimit: 32 << 20}, 32 << 20, 32 << 20},
		{TransferConfig{ReceiveSpaceLimit: -1}, 0, 0},
		{TransferConfig{ReceiveSpace: 8 << 20, ReceiveSpaceLimit: 32 << 20}, 0, 0},
		{TransferConfig{ReceiveSpace: -1}, 0, 0},
	} {
		require.Equal(t, tt.client, tt.c.spaceLimit(true), "%+v, client", tt.c)
		require.Equal(t, tt.server, tt.c.spaceLimit(false), "%+v, server", tt.c)
	}
}

// A CALL-ENDED is the word of one session's peer about its own calls: it
// frees only what this side wrote for that call number over that session
// (another client's call of the same number keeps its write), and malformed
// ones change nothing.
func TestCallEndedPerSession(t *testing.T) {
	_, ss1 := tcpPair(t, transport.WithTrustPeers(true))
	_, ss2 := tcpPair(t, transport.WithTrustPeers(true))
	written := map[*transport.Session]*peerSpace{}
	for i, ss := range []*transport.Session{ss1, ss2} {
		written[ss], _, _ = writtenForCall(t, ss, uint64(5+i), 7)
	}
	for _, bad := range [][]byte{nil, {1}, callEnded(0, nil, false), append(callEnded(7, nil, false), 1)} {
		handleCallEnded(ss1, bad)
	}
	require.Len(t, written[ss1].taken, 1, "malformed CALL-ENDEDs free nothing")
	handleCallEnded(ss1, callEnded(7, nil, false))
	require.Empty(t, written[ss1].taken)
	require.Len(t, written[ss2].taken, 1, "the other session's call 7")
	require.True(t, stateOf(ss1).space.callEnded(7))
	require.False(t, stateOf(ss2).space.callEnded(7))
	off, gen, ok := written[ss1].take(4096, 7)
	require.True(t, ok, "take itself does not refuse: land checks callEnded after it")
	require.False(t, written[ss1].endWrite(off, gen, false))
	written[ss1].writers.Done()
}

// writtenForCall takes the space id the peer of ss advertises (a SPACE
// handled on ss) and writes a range of it for client call: the owner's side
// of a response written into receive space.
func writtenForCall(t *testing.T, ss *transport.Session, id, call uint64) (ps *peerSpace, off, gen uint64) {
	t.Helper()
	m := &spaceMsg{rtr: rtr{Req: id, Length: 1 << 20, Offers: PathRDMA, RAddr: 4096, RKey: []byte{1}}}
	handleSpace(ss, m.marshal())
	ps = peerSpaceByID(ss, m.Req)
	require.NotNil(t, ps)
	off, gen, ok := ps.take(4096, call)
	require.True(t, ok)
	require.True(t, ps.endWrite(off, gen, true))
	ps.writers.Done()
	return ps, off, gen
}

// A CALL-ENDED that cannot name what its call holds takes back no range of
// the call's, but withdraws what was sent for it and nobody pulled, and
// nothing more is written for it.
func TestCallEndedUnknownTakesNothingBack(t *testing.T) {
	_, ss := tcpPair(t, transport.WithTrustPeers(true))
	ps, off, gen := writtenForCall(t, ss, 9, 44)
	d := Offer(Source{Bytes: bytes.Repeat([]byte{7}, 64<<10)}, OfferOptions{})
	t.Cleanup(func() { Withdraw(d.Token) })
	var flow Flow
	require.NoError(t, flow.Send(testContext(t), ss, 44, []Token{d.Token}))

	handleCallEnded(ss, callEnded(44, nil, true))
	require.Contains(t, ps.taken, off, "the call may hold the range")
	require.False(t, Offered(d.Token), "what nobody pulled is withdrawn")
	require.True(t, stateOf(ss).space.callEnded(44))
	require.True(t, ps.give(off, 4096, gen), "the client gives the range back itself")
}

func FuzzParseCallEnded(f *testing.F) {
	f.Add(callEnded(42, []spaceRange{{1, 0, 5}, {2, 4096, 6}}, false))
	f.Add(callEnded(42, nil, true))
	f.Fuzz(func(t *testing.T, b []byte) {
		id, took, unknown, err := parseCallEnded(b)
		if err != nil {
			return
		}
		require.NotZero(t, id)
		require.LessOrEqual(t, len(took), maxCallTaken)
		if unknown {
			require.Empty(t, took)
		}
	})
}

// A call names in its CALL-ENDED the ranges it holds, not those it gave
// back, however many it took; one that holds more than a CALL-ENDED names
// names none and says so; one that ended takes nothing more.
func TestCallEndedNamesHeldRanges(t *testing.T) {
	cs, _ := tcpPair(t)
	owner := cs.Peer().ID
	const ranges = 8 + maxCallTaken + 1 // eight for the first call, one more than a CALL-ENDED names for the second
	sp := makeSpace(11, cs, devicebuf.HostFromBytes(make([]byte, ranges*spaceAlign)), PathRDMA)
	spaces.Store(sp.id, sp)
	var held []*devicebuf.Buffer
	t.Cleanup(func() {
		markClosed(sp) // the releases send no SPACE-FREE; the last frees the region
		for _, b := range held {
			require.NoError(t, b.Release())
		}
		spaces.Delete(sp.id)
	})
	gen := uint64(0) // the owner numbers its writes
	take := func(call *Call, i int) (*devicebuf.Buffer, spaceRange, error) {
		gen++
		d := Descriptor{Owner: owner, Token: Token{1}, Length: spaceAlign, Kind: devicebuf.Host, Device: -1,
			Space: sp.id, SpaceOffset: uint64(i) * spaceAlign, SpacePath: PathRDMA, SpaceGen: gen}
		b, _, err := fetchLanded(context.Background(), d, call)
		return b, spaceRange{sp.id, d.SpaceOffset, gen}, err
	}
	hold := func(call *Call, i int) spaceRange {
		b, r, err := take(call, i)
		require.NoError(t, err)
		held = append(held, b)
		return r
	}
	ended := func(call *Call) (map[spaceRange]bool, bool) {
		msg, first := call.end()
		require.True(t, first)
		_, again := call.end()
		require.False(t, again, "a call ends once")
		id, took, unknown, err := parseCallEnded(msg)
		require.NoError(t, err)
		require.Equal(t, call.ID, id)
		return took, unknown
	}

	// Two ranges held from the start and two taken last; in between, more
	// than a call notes without looking over what it gave back (2,048),
	// each given back at once.
	call := &Call{ID: 5}
	want := map[spaceRange]bool{hold(call, 0): true, hold(call, 1): true}
	for i := range 2*maxCallNoted + 10 {
		b, _, err := take(call, 2+i%6)
		require.NoError(t, err)
		require.NoError(t, b.Release())
	}
	want[hold(call, 2)], want[hold(call, 3)] = true, true
	took, unknown := ended(call)
	require.False(t, unknown)
	require.Equal(t, want, took, "the ranges still held, and only those")
	_, _, err := take(call, 4) // a later write into a range given back
	require.ErrorIs(t, err, errCallEnded)

	// Held, all of them: more than a CALL-ENDED names.
	call = &Call{ID: 6}
	for i := 8; i < ranges; i++ {
		hold(call, i)
	}
	took, unknown = ended(call)
	require.True(t, unknown)
	require.Empty(t, took)
}

// A space whose IPC handle does not open (garbage from the peer) is not
// opened again for every payload: the failure stands for mapRetry, then the
// open is tried again.
func TestSpaceMappingFailureRemembered(t *testing.T) {
	devicebuftest.Install(t, 1)
	c, _ := pipePair(t)
	p := &peerSpace{id: 1, free: []span{{0, 1 << 20}}, taken: map[uint64]*write{}, eventOf: map[uint64]int{}}
	p.tmpl.Offers, p.tmpl.Length = PathCUDAIPC, 1<<20
	for i := range p.tmpl.IPC {
		p.tmpl.IPC[i] = byte(i*13 + 5)
	}
	_, first := p.mapped(c)
	require.Error(t, first)
	_, again := p.mapped(c)
	require.True(t, first == again, "the remembered failure, not another open: %v", again)
	p.mu.Lock()
	p.openedAt = p.openedAt.Add(-mapRetry)
	p.mu.Unlock()
	_, retried := p.mapped(c)
	require.Error(t, retried)
	require.False(t, first == retried, "tried again after mapRetry")
}

// A descriptor naming receive space is taken only from a message of the
// peer the space was advertised to: another peer that learned the space's
// id takes nothing from it, and the range stays the owner's.
func TestSpaceDescriptorFromAnotherPeer(t *testing.T) {
	owner, toOwner := pipePair(t)
	other, toOther := pipePair(t)
	_, ownerConn := transporttest.Conns(t, owner, toOwner)
	_, otherConn := transporttest.Conns(t, other, toOther)
	mem := make([]byte, 64<<10)
	for i := range mem {
		mem[i] = byte(i)
	}
	sp := makeSpace(11, toOwner, devicebuf.HostFromBytes(mem), PathRDMA)
	spaces.Store(sp.id, sp)
	t.Cleanup(func() { spaces.Delete(sp.id) })
	d := Descriptor{Owner: toOwner.PeerID(), Token: Token(newToken()), Length: 4096, Kind: devicebuf.Host, Device: -1,
		Space: sp.id, SpaceOffset: 8192, SpacePath: PathRDMA}
	alloc := func(int) (*devicebuf.Buffer, error) {
		t.Error("nothing is allocated")
		return nil, errors.New("no")
	}

	fromOther := peer.NewContext(context.Background(), &peer.Peer{Addr: otherConn.RemoteAddr()})
	b, _, err := FetchNew(fromOther, d, alloc)
	require.Nil(t, b)
	var te *TransferError
	require.ErrorAs(t, err, &te)
	require.Equal(t, TransferInvalid, te.Kind)
	require.ErrorContains(t, err, "came from")
	d.SpaceGen = 1 << 62
	Discard(fromOther, d) // nor freed, nor marked given back
	d.SpaceGen = 0
	sp.mu.Lock()
	require.Empty(t, sp.inUse, "nothing taken")
	require.Empty(t, sp.pending, "nothing given back")
	require.Empty(t, sp.last, "no write marked stale")
	sp.mu.Unlock()

	fromOwner := peer.NewContext(context.Background(), &peer.Peer{Addr: ownerConn.RemoteAddr()})
	b, path, err := FetchNew(fromOwner, d, alloc)
	require.NoError(t, err)
	require.Equal(t, PathRDMA, path)
	got, err := b.HostBytes()
	require.NoError(t, err)
	require.Equal(t, mem[8192:8192+4096], got)
	markClosed(sp) // the release sends no SPACE-FREE
	require.NoError(t, b.Release())
}

// The blocks a space marks as held agree with the ranges the application
// holds: a landed payload overlaps a held range exactly when its blocks
// meet a marked one, across word boundaries, as ranges come and go.
func TestHeldBlocks(t *testing.T) {
	const blocks = 300 // a few words of bits, the last one partial
	sp := &space{id: 1, region: devicebuf.HostFromBytes(make([]byte, blocks*spaceAlign-100)), inUse: map[uint64]heldRange{}}
	t.Cleanup(func() { require.NoError(t, sp.region.Release()) })
	overlaps := func(off, n uint64) bool {
		for o, h := range sp.inUse {
			if off < o+h.n && o < off+n {
				return true
			}
		}
		return false
	}
	rng := rand.New(rand.NewPCG(1, 2))
	size := uint64(sp.region.Len())
	randomRange := func() (uint64, uint64) {
		off := rng.Uint64N(blocks) * spaceAlign
		n := 1 + rng.Uint64N(80*spaceAlign)
		if rng.IntN(2) == 0 { // a length at a block's edge: one short, on it, one past
			k := rng.Int64N(70)
			n = uint64(max(1, k*spaceAlign+rng.Int64N(3)-1))
		}
		return off, min(n, size-off)
	}
	for range 20000 {
		off, n := randomRange()
		require.Equal(t, overlaps(off, n), sp.anyHeldLocked(off, n), "[%d, +%d)", off, n)
		switch held := len(sp.inUse); {
		case held > 0 && rng.IntN(2) == 0:
			for o, h := range sp.inUse { // let one go
				delete(sp.inUse, o)
				sp.markHeldLocked(h.off, h.n, false)
				break
			}
		case !overlaps(off, n):
			sp.inUse[off] = heldRange{off, n, 0}
			sp.markHeldLocked(off, n, true)
		}
	}
	for o, h := range sp.inUse {
		delete(sp.inUse, o)
		sp.markHeldLocked(h.off, h.n, false)
	}
	require.Equal(t, make([]uint64, len(sp.heldBlocks)), sp.heldBlocks, "every bit cleared")
}

// A payload may not land in any block of a range the application holds,
// its last included, and once the range is given back every block of it
// takes payloads again: what fetchLanded and a release mark and clear.
func TestFetchLandedMultiBlockHeld(t *testing.T) {
	cs, _ := tcpPair(t)
	sp := makeSpace(13, cs, devicebuf.HostFromBytes(make([]byte, 64<<10)), PathRDMA)
	spaces.Store(sp.id, sp)
	t.Cleanup(func() { spaces.Delete(sp.id) })
	d := func(off, n uint64) Descriptor {
		return Descriptor{Owner: cs.Peer().ID, Token: Token{1}, Length: n, Kind: devicebuf.Host, Device: -1, Space: sp.id, SpaceOffset: off, SpacePath: PathRDMA}
	}
	held, _, err := fetchLanded(context.Background(), d(4*spaceAlign, 2*spaceAlign+1), nil) // blocks 4 to 6
	require.NoError(t, err)
	for _, b := range []uint64{4, 5, 6} {
		_, _, err = fetchLanded(context.Background(), d(b*spaceAlign, spaceAlign), nil)
		require.ErrorIs(t, err, errNotInSpace, "block %d of the held range", b)
	}
	require.NoError(t, held.Release())
	var again []*devicebuf.Buffer
	for _, b := range []uint64{4, 5, 6} {
		buf, _, err := fetchLanded(context.Background(), d(b*spaceAlign, spaceAlign), nil)
		require.NoError(t, err, "block %d, given back", b)
		again = append(again, buf)
	}
	markClosed(sp) // the releases send no SPACE-FREE; the last frees the region
	for _, buf := range again {
		require.NoError(t, buf.Release())
	}
}
