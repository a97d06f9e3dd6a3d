package oob

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"runtime/trace"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// Advertised receive space. A receiver that trusts its peer sets aside a
// region of the memory its pulls over a session land in (made by the same
// allocator, after the first pull by rdma or cuda-ipc), registers or exports
// it once, and sends the peer its key or CUDA IPC handle (SPACE). When that
// peer then sends a payload over the session (a server's response, a message
// of a server stream), it writes the payload into a free range of the region
// while it marshals the message, and the descriptor names the range instead
// of a token to pull: the rendezvous (RTR, push, FIN, after the message
// arrived) leaves the call's path. The receiver hands the range to the
// application as the received buffer and gives it back (SPACE-FREE) when the
// buffer is released. A payload that does not fit the free space, a message
// whose session the owner does not know at marshal time, and a write that
// fails take the rendezvous. A descriptor naming a range this process cannot
// vouch for fails its transfer. A session may hold a few spaces, each way:
// a receiver whose spaces grow (a client's by default, a server's with a
// limit) adds one when its payloads outgrow those it has.

// DefaultReceiveSpace is the floor of a space a session advertises when its
// spaces grow with the payloads (TransferConfig.ReceiveSpace zero), or a
// quarter of their limit where that is less: a space has room for
// spacePayloads payloads of the size of the pull that prompted it, and at
// least the floor, unless less of the limit is left.
const DefaultReceiveSpace = 64 << 20

// With growing spaces, a space holds this many payloads of the size of the
// pull that prompted it: the next payload lands while the receiver still
// holds the last, or before its SPACE-FREE arrived. A session whose spaces
// cannot hold two payloads of a pull's size advertises another, while all of
// its spaces together stay within the limit: DefaultReceiveSpaceLimit for a
// client's sessions unless configured (TransferConfig.ReceiveSpaceLimit).
const (
	spacePayloads            = 4
	DefaultReceiveSpaceLimit = 1 << 30
)

// maxSpaces bounds the spaces of one session, either way.
const maxSpaces = 4

// defaultSpace is the space a session whose spaces add up to total bytes
// advertises after a pull of n bytes, its spaces growing within limit bytes;
// 0 when none is due.
func defaultSpace(n, total, limit int) int {
	size := min(max(min(DefaultReceiveSpace, limit/4), spacePayloads*n), limit-total)
	if size <= 0 || size < 2*n {
		return 0
	}
	return size
}

// spaceAlign aligns the ranges an owner picks (GPU copies and NIC writes run
// faster from aligned addresses).
const spaceAlign = 4096

// spaceEvents is how many CUDA IPC events a receiver offers with a CUDA IPC
// space. An owner marks each copy it does not wait for with one, a free one
// while there is one; once every event marks a range still held, the copies
// share them (peerSpace.eventForLocked).
const spaceEvents = 32

// space is receive memory this process advertised to the peer of s.
type space struct {
	id       uint64
	region   *devicebuf.Buffer
	path     Path // how the owner writes into it: PathRDMA or PathCUDAIPC
	unexpose func()
	s        *transport.Session
	// events are the CUDA IPC events offered with a CUDA IPC space: an
	// owner records one after a copy into a range that may still run, and
	// the range's payload is in place once it completes.
	events []*devicebuf.Event

	mu    sync.Mutex
	inUse map[uint64]heldRange // offset -> the ranges the application holds
	// heldBlocks has a bit per spaceAlign bytes of the space, set where a
	// range in inUse lies: a landed payload's check against what the
	// application holds looks at its own blocks, not at every held range.
	// Made at the first range taken.
	heldBlocks []uint64
	closed     bool // the session ended: nothing more lands; freed once inUse empties

	withdrawn     chan struct{} // closed when the owner answered the withdrawal
	withdrawnOnce sync.Once

	// Ranges given back and not yet sent to the owner, and the goroutine
	// that sends them (started at the first, it lives until close, so that
	// a release never waits for the control lane and no release starts a
	// goroutine): kick wakes it, stop ends it. pendingAt indexes pending by
	// offset: a range keeps only its latest write's notice (the owner takes
	// an earlier one for a write it ended already), so what a peer that
	// stops reading its control stream leaves queued is bounded by the
	// space's size however many writes it names.
	pending   []heldRange
	pendingAt map[uint64]int
	started   bool // the sender runs
	held      bool // notices stay queued (tests look at them)
	kick      chan struct{}
	stop      chan struct{}
	// last is, per aligned offset (off/spaceAlign), the number of the last
	// write there that was given back: a descriptor naming that write or an
	// earlier one is stale (a request gRPC replays after the server took
	// its payload, or after the client's call ended). Made at the first
	// give-back; 8 bytes per 4 KiB of space.
	last []uint64
}

// heldRange is a range of this process's space that a payload took: where,
// how long, and the owner's number for the write (Descriptor.SpaceGen), which
// its SPACE-FREE names.
type heldRange struct{ off, n, gen uint64 }

// spaceWithdrawBound bounds how long a session winding down waits for its
// owner to answer the withdrawal of its space: an owner that took the space
// answers at once, one that never did (an older gdrpc) never writes into it.
const spaceWithdrawBound = time.Second

// spaces maps the ids of this process's advertised spaces to them, until
// their session ends; liveSpaces holds them until they are freed, and the
// bytes they and the spaces being made take (Limits.SpaceBytes).
var (
	spaces     sync.Map // uint64 -> *space
	liveSpaces = struct {
		sync.Mutex
		m     map[*space]struct{}
		bytes int64
	}{m: map[*space]struct{}{}}
)

// reserveSpace takes n bytes of the process's receive space for a space about
// to be made, and reports false when that would go over limit bytes.
func reserveSpace(n, limit int64) bool {
	liveSpaces.Lock()
	defer liveSpaces.Unlock()
	// A sum, not a difference: the bytes are the process's, and an engine
	// with a smaller limit than another's may see them over its own.
	if n <= 0 || n > limit-liveSpaces.bytes {
		return false
	}
	liveSpaces.bytes += n
	return true
}

// unreserveSpace gives back n bytes that reserveSpace took for a space that
// was not made.
func unreserveSpace(n int64) {
	liveSpaces.Lock()
	liveSpaces.bytes -= n
	liveSpaces.Unlock()
}

// peerSpace is the receive space a peer advertised to this process, as the
// owner that writes into it sees it.
type peerSpace struct {
	id   uint64
	tmpl rtr // where the region is: offers, key or IPC handle; Length is its size

	mu    sync.Mutex
	free  []span            // free ranges, by offset, none adjacent
	taken map[uint64]*write // offset -> the write into the range, until it is given back
	gens  uint64            // the last write's number
	// mapping is the space's allocation opened through its CUDA IPC handle,
	// once, for the session's life: an open and a close cost more than a
	// copy of megabytes, and more the larger the allocation.
	mapping *devicebuf.Buffer
	// openErr is why the mapping did not open, at openedAt: the next open is
	// tried no sooner than mapRetry after, so that a handle that does not open
	// (another host's, or garbage from the peer) costs no driver call per
	// payload.
	openErr  error
	openedAt time.Time
	closed   bool           // withdrawn, or the session ended: no more writes, no mapping
	writers  sync.WaitGroup // writes under way (take, until land ends)

	// Copies that may still run when their message goes: the receiver's
	// events (handles, and those opened), how many held ranges each marks
	// (0: free) and which marks each range, the event a copy shares next
	// when none is free, and the stream the copies queue on.
	events     []devicebuf.IPCEventHandle
	opened     []*devicebuf.Event
	eventUses  []int
	eventOf    map[uint64]int // range offset -> event index
	nextShared int
	eventsOff  bool // the receiver's events do not open here: copies are waited for
	copies     *copyQueue
}

type span struct{ off, n uint64 }

// write is a range of a peer's space taken for a payload: its length, its
// number (Descriptor.SpaceGen: notices about the range name it), the client
// call it answers (0: a call without a number), and whether the write is
// under way and whether its call ended meanwhile (the write's end then gives
// the range back).
type write struct {
	n, gen, call      uint64
	writing, orphaned bool
	// once is the outbox token of a request's payload that no replay will
	// pull (a stream without a retry policy): it leaves the outbox once the
	// receiver gave the range back, having taken the payload.
	once Token
}

// spaceState is a session's advertised spaces, both ways.
type spaceState struct {
	// advertising is held while this side makes a space and sends its
	// SPACE: one at a time, and a withdrawal waits for it, so it never
	// overtakes the SPACE.
	advertising sync.Mutex

	mu          sync.Mutex
	failed      bool // making one failed: no more
	withdrawing bool // the session winds down: no more spaces
	// peerWithdrawing: the peer began withdrawing its spaces. Control
	// messages are handled concurrently, so a SPACE sent before the first
	// SPACE-WITHDRAW may be handled after it; a peer that withdraws never
	// advertises again, so a SPACE handled from then on is refused, never
	// written into after this side answered that nothing is.
	peerWithdrawing bool
	own             []*space     // advertised to the peer, oldest first
	peer            []*peerSpace // the peer's, oldest first
	stopped         bool         // the session ended
	ended           endedCalls   // the peer's calls that ended (CALL-ENDED): nothing more lands for them
}

// nextSize is the size of the space to advertise after a pull of n bytes
// (st.mu held), 0 for none: configured (above zero), the first space only;
// otherwise one sized after n when the spaces so far cannot hold two
// payloads of n bytes, within limit bytes together.
func (st *spaceState) nextSize(configured, limit, n int) int {
	if len(st.own) >= maxSpaces {
		return 0
	}
	if configured > 0 {
		if len(st.own) > 0 || n > configured/2 {
			return 0
		}
		return configured
	}
	total := 0
	for _, sp := range st.own {
		if sp.region.Len() >= 2*n {
			return 0
		}
		total += sp.region.Len()
	}
	return defaultSpace(n, total, limit)
}

// spaceLimit is the bound of the growing spaces of a session on the client
// side or not (TransferConfig.ReceiveSpaceLimit): 0 when they do not grow.
func (c *TransferConfig) spaceLimit(client bool) int {
	switch {
	case c.ReceiveSpace != 0 || c.ReceiveSpaceLimit < 0:
		return 0
	case c.ReceiveSpaceLimit > 0:
		return c.ReceiveSpaceLimit
	case client:
		return DefaultReceiveSpaceLimit
	}
	return 0
}

// maybeAdvertise advertises receive space to the peer of s after a pull over
// s took path into dst, which alloc made, where s's peer is trusted and the
// owner wrote into dst directly: a space of the configured size once per
// session or, where the spaces grow (a client's by default, a server's with
// a limit), one sized after the pull whenever the session's spaces cannot
// hold two such payloads (within the limit). The space is made, cleared and
// advertised on a goroutine of its own, off the pull's path: clearing a
// host space of a gigabyte touches each of its pages first.
func maybeAdvertise(s *transport.Session, path Path, dst *devicebuf.Buffer, alloc devicebuf.Allocator) {
	c := cfgOf(s)
	// A server advertises only when configured to (a size or a limit): it
	// would set space aside for every client connection.
	limit := c.spaceLimit(s.IsClient())
	if c.ReceiveSpace < 0 || c.ReceiveSpace == 0 && limit == 0 || !s.TrustsPeer() || path != PathRDMA && path != PathCUDAIPC {
		return
	}
	a := stateOf(s)
	if a.link == nil {
		return
	}
	st := &a.space
	if !st.advertising.TryLock() {
		return // another pull is advertising
	}
	st.mu.Lock()
	size := 0
	if !st.failed && !st.stopped && !st.withdrawing {
		size = st.nextSize(c.ReceiveSpace, limit, dst.Len())
	}
	st.mu.Unlock()
	if size == 0 {
		st.advertising.Unlock()
		return
	}
	if !reserveSpace(int64(size), c.Limits.SpaceBytes) {
		st.advertising.Unlock()
		c.Logger.Debug("no receive space advertised: the process's spaces are at Limits.SpaceBytes", "session", s.ID(), "size", size, "limit", c.Limits.SpaceBytes)
		return
	}
	if dst.Kind() == devicebuf.CUDA && ipcAllowed(s) && c.Paths&PathCUDAIPC != 0 {
		// Into GPU memory on this host the owner copies through the
		// space's CUDA IPC mapping, opened once: faster than UCX's
		// cuda_ipc lane, which the rendezvous prefers on one device (the
		// README's performance table).
		path = PathCUDAIPC
	}
	like := spaceLike{kind: dst.Kind(), uuid: dst.DeviceUUID()}
	spacesMaking.Add(1)
	made := func() {
		st.advertising.Unlock() // withdrawSpace waits for it
		spacesMaking.Add(-1)
	}
	// The session's Close joins it: the space's memory may go away after
	// that (a UCX context's).
	if !a.bounds.spawn(func() {
		defer made()
		advertise(s, st, path, like, alloc, size)
	}) {
		unreserveSpace(int64(size))
		made()
	}
}

// spacesMaking counts the advertisements under way (Stats.Making).
var spacesMaking atomic.Int64

// spaceLike is what a space has in common with the pull's destination that
// prompted it: its kind of memory and device.
type spaceLike struct {
	kind devicebuf.Kind
	uuid string
}

// advertise makes a space of size bytes (reserved) like the pull's
// destination, and advertises it to the peer of s, whose spaces st holds
// (st.advertising held).
func advertise(s *transport.Session, st *spaceState, path Path, like spaceLike, alloc devicebuf.Allocator, size int) {
	c := cfgOf(s)
	sp, m, err := newSpace(s, path, like, alloc, size)
	if err != nil {
		unreserveSpace(int64(size))
		st.mu.Lock()
		st.failed = true // not again for every pull
		st.mu.Unlock()
		c.Logger.Debug("no receive space advertised", "session", s.ID(), "err", err)
		return
	}
	st.mu.Lock()
	stopped := st.stopped || st.withdrawing
	if !stopped {
		st.own = append(st.own, sp)
		spaces.Store(sp.id, sp)
	}
	st.mu.Unlock()
	if stopped {
		sp.close()
		return
	}
	ctx, cancel := context.WithTimeout(sessionContext(s), c.Timeout)
	defer cancel()
	if err := sendControl(ctx, s, ctlSpace, m.marshal()); err != nil {
		c.Logger.Debug("receive space not advertised", "session", s.ID(), "err", err)
	}
}

// newSpace makes a region of n bytes with alloc, like the pull's
// destination, clears it and exposes it to the owner the way path wrote
// into that destination. A descriptor may name a range of the space that
// nothing was written into, and the allocator's memory may hold another
// transfer's bytes, another peer's: what reaches the application is bytes
// that arrived, or zeros (clearDestination).
func newSpace(s *transport.Session, path Path, like spaceLike, alloc devicebuf.Allocator, n int) (*space, *spaceMsg, error) {
	region, err := alloc.Alloc(n)
	if err != nil {
		return nil, nil, err
	}
	if region.Kind() != like.kind || region.DeviceUUID() != like.uuid || region.Len() != n {
		region.Release()
		return nil, nil, errors.New("the allocator made different memory for the space than for the pull")
	}
	if err := clearSpace(region, makingStopped(s)); err != nil {
		region.Release()
		return nil, nil, fmt.Errorf("clear: %w", err)
	}
	sp := makeSpace(newSpaceID(), s, region, path)
	m := &spaceMsg{rtr: rtr{Req: sp.id, Length: uint64(n), Offers: path}}
	switch path {
	case PathCUDAIPC:
		h, off, err := devicebuf.ExportIPC(region)
		if err != nil {
			region.Release()
			return nil, nil, fmt.Errorf("export IPC handle: %w", err)
		}
		m.IPC, m.IPCOffset, m.IPCDevice = h, uint64(off), region.DeviceUUID()
		// Without events the owner waits for each copy before its message
		// goes: slower, never wrong.
		for range spaceEvents {
			ev, h, err := devicebuf.NewIPCEvent(region.Device())
			if err != nil {
				cfgOf(s).Logger.Debug("receive space without events", "session", s.ID(), "err", err)
				break
			}
			sp.events = append(sp.events, ev)
			m.Events = append(m.Events, h)
		}
	case PathRDMA:
		rc := s.RDMAContext()
		if rc == nil {
			region.Release()
			return nil, nil, errors.New("no UCX context")
		}
		mem, off, release, err := exposeDestination(rc, region, true)
		if err != nil {
			region.Release()
			return nil, nil, fmt.Errorf("register: %w", err)
		}
		key, err := packedKey(mem)
		if err != nil {
			release()
			region.Release()
			return nil, nil, fmt.Errorf("pack key: %w", err)
		}
		sp.unexpose = release
		m.RAddr, m.RKey = uint64(mem.Addr())+uint64(off), key
		if mem.Type() == rdma.MemoryCUDA {
			m.RMemory = 1
		}
	}
	liveSpaces.Lock()
	liveSpaces.m[sp] = struct{}{}
	liveSpaces.Unlock()
	return sp, m, nil
}

// spaceClearPiece is the most of a host space cleared between two looks at
// whether its session ended.
const spaceClearPiece = 64 << 20

// makingStopped returns what says why a space of s's being made is no
// longer wanted: s ended, or it is winding down (withdrawSpace waits for the
// making, then withdraws what it made).
func makingStopped(s *transport.Session) func() error {
	return func() error {
		if err := sessionContext(s).Err(); err != nil {
			return err
		}
		st := &stateOf(s).space
		st.mu.Lock()
		defer st.mu.Unlock()
		if st.stopped || st.withdrawing {
			return errors.New("the session is winding down")
		}
		return nil
	}
}

// clearSpace clears region, a new space's memory, unless stopped says why
// not first: a host space in pieces (its clear touches each page first:
// 43 ms a piece on a 2-core VM), so that a session closing or winding down
// meanwhile does not wait for the whole of it; GPU memory in one memset on
// the device.
func clearSpace(region *devicebuf.Buffer, stopped func() error) error {
	if region.Kind() != devicebuf.Host {
		return clearDestination(region)
	}
	for off := 0; off < region.Len(); off += spaceClearPiece {
		if err := stopped(); err != nil {
			return err
		}
		piece, err := region.Slice(off, min(spaceClearPiece, region.Len()-off))
		if err != nil {
			return err
		}
		err = clearDestination(piece)
		piece.Release()
		if err != nil {
			return err
		}
	}
	return nil
}

// makeSpace returns the record of a space of s's, id, in region, written by
// path: nothing held, nothing exposed yet.
func makeSpace(id uint64, s *transport.Session, region *devicebuf.Buffer, path Path) *space {
	return &space{
		id: id, region: region, path: path, s: s,
		inUse: map[uint64]heldRange{}, unexpose: func() {},
		withdrawn: make(chan struct{}), kick: make(chan struct{}, 1), stop: make(chan struct{}),
	}
}

func newSpaceID() uint64 {
	var b [8]byte
	for {
		_, _ = rand.Read(b[:])
		if id := binary.BigEndian.Uint64(b[:]); id != 0 {
			return id
		}
	}
}

// close ends sp's advertisement: no payload lands any more, and the region
// is freed once the application gave back every range it holds.
func (sp *space) close() {
	spaces.Delete(sp.id)
	sp.mu.Lock()
	already := sp.closed // by the session's end and a refusal both: freed once
	sp.markClosedLocked()
	free := !already && len(sp.inUse) == 0
	sp.mu.Unlock()
	if free {
		sp.free()
	}
}

// markClosedLocked marks sp closed and ends its sender (sp.mu held): nothing
// more lands, no notice goes.
func (sp *space) markClosedLocked() {
	if !sp.closed {
		close(sp.stop)
	}
	sp.closed = true
}

// free gives sp's memory back. A space whose owner never said it writes
// into it no more (its session died, or the owner did not answer the
// withdrawal in time) may still take a write the owner began before the
// end: its memory goes back once the session's connections are released
// (no UCX put lands after its endpoint closed) and every copy the owner
// recorded on its events completed, within the transfer timeout, so that a
// late write does not land in what the allocator hands out next. An
// owner's direct copy into a host space (rdma's, over shared memory) is not
// a UCX put: it issues no new piece once the owner sees the session end,
// which may come after this, and the pieces under way complete (the
// README's Security says so).
func (sp *space) free() {
	select {
	case <-sp.withdrawn:
	default:
		if sp.s != nil {
			timeout := cfgOf(sp.s).Timeout // the engine's, while it may still serve s
			go func() {
				<-sp.s.Released()
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				for _, ev := range sp.events {
					_ = ev.Await(ctx) // a dead owner's copy may never complete: bounded
				}
				sp.release()
			}()
			return
		}
	}
	sp.release()
}

// release frees sp's events, registration and memory.
func (sp *space) release() {
	for _, ev := range sp.events {
		_ = ev.Close()
	}
	sp.unexpose()
	n := int64(sp.region.Len())
	sp.region.Release()
	liveSpaces.Lock()
	if _, ok := liveSpaces.m[sp]; ok {
		delete(liveSpaces.m, sp)
		liveSpaces.bytes -= n
	}
	liveSpaces.Unlock()
}

// landedSpace returns the space of this process's that d names, once the
// range d names is one this process can vouch for: in a space it advertised
// to d's owner, written by the path it offered, aligned and inside.
func landedSpace(d Descriptor) (*space, error) {
	v, ok := spaces.Load(d.Space)
	if !ok {
		return nil, fmt.Errorf("the descriptor names receive space %#x, which this process does not advertise (any more): %w", d.Space, errNotInSpace)
	}
	sp := v.(*space)
	off, n := d.SpaceOffset, d.Length
	switch {
	case sp.s.PeerID() != d.Owner:
		return nil, fmt.Errorf("receive space %#x was advertised to another process", d.Space)
	case d.SpacePath != sp.path:
		return nil, fmt.Errorf("receive space %#x is written by %v, the descriptor says %v", d.Space, sp.path, d.SpacePath)
	case off%spaceAlign != 0:
		return nil, fmt.Errorf("range at %d of receive space %#x is not aligned to %d bytes", off, d.Space, spaceAlign)
	case n == 0 || off > uint64(sp.region.Len()) || n > uint64(sp.region.Len())-off:
		return nil, fmt.Errorf("range [%d, +%d) outside receive space %#x of %d bytes", off, n, d.Space, sp.region.Len())
	case int(d.SpaceEvent) > len(sp.events):
		return nil, fmt.Errorf("receive space %#x offered %d events, the descriptor names event %d", d.Space, len(sp.events), d.SpaceEvent)
	}
	return sp, nil
}

// heldOverlapLocked returns an error when [off, +n) overlaps a range the
// application holds (sp.mu held).
func (sp *space) heldOverlapLocked(off, n uint64) error {
	if sp.closed {
		return fmt.Errorf("receive space %#x closed with its session: %w", sp.id, errNotInSpace)
	}
	if !sp.anyHeldLocked(off, n) {
		return nil
	}
	for o, h := range sp.inUse {
		if off < o+h.n && o < off+n {
			return fmt.Errorf("range [%d, +%d) of receive space %#x overlaps [%d, +%d), which the application holds: %w", off, n, sp.id, o, h.n, errNotInSpace)
		}
	}
	return fmt.Errorf("range [%d, +%d) of receive space %#x overlaps a range the application holds: %w", off, n, sp.id, errNotInSpace)
}

// heldWords calls f with each word of sp.heldBlocks that has bits of the
// blocks of [off, +n), an aligned range inside the space, and the mask of
// those bits, until f returns false (sp.mu held).
func (sp *space) heldWords(off, n uint64, f func(w *uint64, mask uint64) bool) {
	lo, hi := off/spaceAlign, (off+n-1)/spaceAlign // blocks, hi included
	for w := lo / 64; w <= hi/64; w++ {
		mask := ^uint64(0)
		if w == lo/64 {
			mask &= ^uint64(0) << (lo % 64)
		}
		if w == hi/64 {
			mask &= ^uint64(0) >> (63 - hi%64)
		}
		if !f(&sp.heldBlocks[w], mask) {
			return
		}
	}
}

// anyHeldLocked reports whether a held range lies in [off, +n), an aligned
// range inside the space (sp.mu held).
func (sp *space) anyHeldLocked(off, n uint64) bool {
	if sp.heldBlocks == nil {
		return false
	}
	found := false
	sp.heldWords(off, n, func(w *uint64, mask uint64) bool {
		found = *w&mask != 0
		return !found
	})
	return found
}

// markHeldLocked sets (held) or clears the blocks of [off, +n), an aligned
// range inside the space (sp.mu held).
func (sp *space) markHeldLocked(off, n uint64, held bool) {
	if sp.heldBlocks == nil {
		blocks := (uint64(sp.region.Len()) + spaceAlign - 1) / spaceAlign
		sp.heldBlocks = make([]uint64, (blocks+63)/64)
	}
	sp.heldWords(off, n, func(w *uint64, mask uint64) bool {
		if held {
			*w |= mask
		} else {
			*w &^= mask
		}
		return true
	})
}

// staleLocked reports whether write gen into the range at off was given
// back already, or an earlier one than the last given back there (sp.mu
// held). Writes numbered 0 (an older owner's) are never stale.
func (sp *space) staleLocked(off, gen uint64) bool {
	i := off / spaceAlign
	return gen != 0 && i < uint64(len(sp.last)) && gen <= sp.last[i]
}

// errNotInSpace marks a descriptor whose payload is not (or no longer) in
// this process's receive space where it says, though it may be elsewhere: a
// request gRPC replayed to another server or after it was taken, whose
// token its owner still holds. The receiver pulls it instead.
var errNotInSpace = errors.New("the payload is not in receive space")

// fetchLanded returns the payload d names in this process's advertised
// space as a buffer of its own, for call (nil: none); releasing it gives the
// range back.
func fetchLanded(ctx context.Context, d Descriptor, call *Call) (*devicebuf.Buffer, *space, error) {
	sp, err := landedSpace(d)
	if err != nil {
		return nil, nil, err
	}
	off, n := d.SpaceOffset, d.Length
	h := heldRange{off, n, d.SpaceGen}
	sp.mu.Lock()
	if err := sp.heldOverlapLocked(off, n); err != nil {
		sp.mu.Unlock()
		return nil, nil, err
	}
	if sp.staleLocked(off, d.SpaceGen) {
		sp.mu.Unlock()
		return nil, nil, fmt.Errorf("write %d into range [%d, +%d) of receive space %#x was taken or given back already: %w", d.SpaceGen, off, n, d.Space, errNotInSpace)
	}
	if !call.note(spaceRange{d.Space, off, d.SpaceGen}) {
		// The call's CALL-ENDED, which does not name this write, is out;
		// the SPACE-FREE makes sure, should the owner have forgotten the
		// call (a stale one frees nothing: it names the write).
		sp.queueFreeLocked(h)
		sp.mu.Unlock()
		return nil, nil, errCallEnded
	}
	sp.inUse[off] = h
	sp.markHeldLocked(off, n, true)
	sp.mu.Unlock()
	call.tidy(false)
	ptr, release := sp.region.Ptr()+uintptr(off), func() { sp.giveBack(off) }
	if d.SpaceEvent == 0 {
		return devicebuf.Wrap(ptr, int(n), sp.region.Kind(), sp.region.Device(), release), sp, nil
	}
	ev := sp.events[d.SpaceEvent-1]
	if cfgOf(sp.s).StreamOrdered && sp.s.IsClient() {
		// A client's option: a server's request is in place before its
		// handler runs, so a client's call never returns while its request's
		// copy still runs (unless the server never took it).
		return devicebuf.WrapArriving(ptr, int(n), sp.region.Device(), release, ev, cfgOf(sp.s).Timeout), sp, nil
	}
	if err := awaitOwner(ctx, ev, cfgOf(sp.s).Timeout); err != nil {
		release()
		return nil, nil, fmt.Errorf("waiting for the owner's copy into receive space %#x: %w", d.Space, err)
	}
	return devicebuf.Wrap(ptr, int(n), sp.region.Kind(), sp.region.Device(), release), sp, nil
}

// awaitOwner waits for ev, an event the owner recorded after its copy, within
// ctx and timeout: an owner whose copy never ends (queued behind work that
// does not, or on a device that stopped) must not hold the receiver.
func awaitOwner(ctx context.Context, ev *devicebuf.Event, timeout time.Duration) error {
	if done, err := ev.Query(); done || err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return ev.Await(ctx)
}

// giveBack returns the range at off to the owner. The SPACE-FREE goes out
// on the space's sender, which the release wakes (it lives until the space
// closes) and which sends what was given back meanwhile too.
func (sp *space) giveBack(off uint64) {
	sp.mu.Lock()
	h, ok := sp.inUse[off]
	if !ok {
		// Not held (given back already): nothing to free, and no notice,
		// which would name no range.
		sp.mu.Unlock()
		return
	}
	delete(sp.inUse, off)
	sp.markHeldLocked(h.off, h.n, false)
	free := sp.closed && len(sp.inUse) == 0 // the last range held: freed once
	sp.queueFreeLocked(h)
	sp.mu.Unlock()
	if free {
		sp.free()
	}
}

// queueFreeLocked queues the SPACE-FREE of h unless the session ended, and
// wakes the goroutine that sends them, starting it the first time (sp.mu
// held).
func (sp *space) queueFreeLocked(h heldRange) {
	if h.gen != 0 {
		if sp.last == nil {
			sp.last = make([]uint64, (sp.region.Len()+spaceAlign-1)/spaceAlign)
		}
		if i := h.off / spaceAlign; i < uint64(len(sp.last)) {
			sp.last[i] = max(sp.last[i], h.gen)
		}
	}
	if sp.closed {
		return
	}
	if i, ok := sp.pendingAt[h.off]; ok {
		if h.gen >= sp.pending[i].gen {
			sp.pending[i] = h
		}
	} else {
		if sp.pendingAt == nil {
			sp.pendingAt = map[uint64]int{}
		}
		sp.pendingAt[h.off] = len(sp.pending)
		sp.pending = append(sp.pending, h)
	}
	if !sp.started {
		sp.started = true
		go sp.sendFrees()
	}
	select {
	case sp.kick <- struct{}{}:
	default: // a wake-up is due already
	}
}

// sendFrees sends the pending SPACE-FREEs whenever some are queued, until sp
// closes (the session ended: the owner takes nothing back any more).
func (sp *space) sendFrees() {
	c := cfgOf(sp.s)
	for {
		select {
		case <-sp.kick:
		case <-sp.stop:
			return
		}
		sp.mu.Lock()
		if sp.held {
			sp.mu.Unlock()
			continue
		}
		batch := sp.pending
		sp.pending = nil
		clear(sp.pendingAt)
		closed := sp.closed
		sp.mu.Unlock()
		if closed {
			return
		}
		for _, r := range batch {
			ctx, cancel := context.WithTimeout(sessionContext(sp.s), c.Timeout)
			err := sendControl(ctx, sp.s, ctlSpaceFree, freeNotice(sp.id, r.off, r.n, r.gen))
			cancel()
			if err != nil {
				c.Logger.Debug("receive space range not given back", "session", sp.s.ID(), "err", err)
			}
		}
	}
}

// handleSpace takes the receive space the peer of s advertised.
func handleSpace(s *transport.Session, payload []byte) {
	m, err := parseSpace(payload)
	if err == nil && (m.Offers != PathRDMA && m.Offers != PathCUDAIPC || m.Length == 0 || m.Req == 0) {
		err = fmt.Errorf("malformed SPACE: paths %v, %d bytes, id %#x", m.Offers, m.Length, m.Req)
	}
	if err != nil {
		dropControl(s, err)
		return
	}
	a := stateOf(s)
	if a.link == nil {
		return // a closed session's (closedState is shared)
	}
	if !s.TrustsPeer() {
		// A peer this side would not write into with puts it cannot bound.
		refuseSpace(s, m.Req, "the peer is not trusted")
		return
	}
	st := &a.space
	st.mu.Lock()
	if slices.ContainsFunc(st.peer, func(p *peerSpace) bool { return p.id == m.Req }) {
		st.mu.Unlock()
		// Not answered: the answer would end the space of that id, which
		// this side took.
		cfgOf(s).Logger.Debug("receive space refused: its id is taken", "session", s.ID(), "space", m.Req)
		return
	}
	if len(st.peer) >= maxSpaces || st.stopped || st.peerWithdrawing {
		st.mu.Unlock()
		refuseSpace(s, m.Req, "too many, the session ends, or the peer withdraws its spaces")
		return
	}
	defer st.mu.Unlock()
	ps := &peerSpace{id: m.Req, tmpl: m.rtr, free: []span{{0, m.Length}}, taken: map[uint64]*write{}, events: m.Events, eventOf: map[uint64]int{}}
	ps.opened = make([]*devicebuf.Event, len(m.Events))
	ps.eventUses = make([]int, len(m.Events))
	st.peer = append(st.peer, ps)
}

// refuseSpace answers a SPACE this side does not take with a SPACE-WITHDRAWN
// of its id: its receiver gives the space's memory back at once, and
// advertises no more over s, where it would otherwise keep the space, never
// written into, until the session ends. (A receiver of an earlier release
// takes the answer as the end of a withdrawal it never began, and keeps the
// space.)
func refuseSpace(s *transport.Session, id uint64, why string) {
	cfgOf(s).Logger.Debug("receive space refused", "session", s.ID(), "space", id, "why", why)
	sendWithdrawn(s, id)
}

// sendWithdrawn tells the receiver of space id over s that this side writes
// into it no more (SPACE-WITHDRAWN), within spaceWithdrawBound.
func sendWithdrawn(s *transport.Session, id uint64) {
	ctx, cancel := context.WithTimeout(sessionContext(s), spaceWithdrawBound)
	defer cancel()
	_ = sendControl(ctx, s, ctlSpaceWithdrawn, rangeNotice(id, 0, 0))
}

// handleSpaceFree takes back a range of the space this process wrote into.
func handleSpaceFree(s *transport.Session, payload []byte) {
	id, off, n, gen, err := parseFreeNotice(payload)
	if err != nil {
		dropControl(s, err)
		return
	}
	ps := peerSpaceByID(s, id)
	if ps == nil || !ps.give(off, n, gen) {
		// A range taken back at the call's end (CALL-ENDED handled first) and
		// maybe written again since: not the write this notice is about.
		cfgOf(s).Logger.Debug("SPACE-FREE of a write not taken", "session", s.ID(), "space", id, "offset", off, "length", n, "write", gen)
	}
}

// peerSpacesOf returns the spaces the peer of s advertised, newest first.
func peerSpacesOf(s *transport.Session) []*peerSpace { return peerSpacesOfState(stateOf(s)) }

func peerSpacesOfState(a *attached) []*peerSpace {
	a.space.mu.Lock()
	defer a.space.mu.Unlock()
	ps := slices.Clone(a.space.peer)
	slices.Reverse(ps)
	return ps
}

// peerSpaceByID returns the space of id the peer of s advertised, or nil.
func peerSpaceByID(s *transport.Session, id uint64) *peerSpace {
	for _, ps := range peerSpacesOf(s) {
		if ps.id == id {
			return ps
		}
	}
	return nil
}

// ownSpaceByID returns the space of id this side advertised over the
// session of a, or nil.
func ownSpaceByID(a *attached, id uint64) *space {
	a.space.mu.Lock()
	defer a.space.mu.Unlock()
	for _, sp := range a.space.own {
		if sp.id == id {
			return sp
		}
	}
	return nil
}

// take picks a free range of n bytes for a payload of client call (0: a
// call without a number), first fit, and returns it with the write's number;
// the write is under way until the caller calls p.endWrite and
// p.writers.Done.
func (p *peerSpace) take(n, call uint64) (off, gen uint64, ok bool) {
	need := roundUp(n, spaceAlign)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, 0, false
	}
	for i, f := range p.free {
		if f.n < need {
			continue
		}
		if f.n == need {
			p.free = slices.Delete(p.free, i, i+1)
		} else {
			p.free[i] = span{f.off + need, f.n - need}
		}
		p.gens++
		p.taken[f.off] = &write{n: need, gen: p.gens, call: call, writing: true}
		p.writers.Add(1)
		return f.off, p.gens, true
	}
	return 0, 0, false
}

// withdraw stops writes into the space and waits for those under way; then
// the mapping closes.
func (p *peerSpace) withdraw() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.writers.Wait()
	p.mu.Lock()
	mapping, copies, opened := p.mapping, p.copies, p.opened
	p.mapping, p.copies, p.opened = nil, nil, nil
	p.mu.Unlock()
	if copies != nil {
		copies.close() // waits for the copies still running
	}
	for _, ev := range opened {
		if ev != nil {
			_ = ev.Close()
		}
	}
	if mapping != nil {
		mapping.Release()
	}
}

// withdrawSpace withdraws the spaces this side advertised over the session
// of a, which is winding down, and waits (bounded, for all together) until
// the owner writes into them no more: a space's memory goes back to its
// allocator once the session closed, and a write after that would land in
// whatever it holds next.
func withdrawSpace(a *attached) {
	st := &a.space
	st.mu.Lock()
	st.withdrawing = true
	st.mu.Unlock()
	st.advertising.Lock() // a SPACE on its way goes first
	st.advertising.Unlock()
	st.mu.Lock()
	own := slices.Clone(st.own)
	st.mu.Unlock()
	if len(own) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(sessionContext(a.s), spaceWithdrawBound)
	defer cancel()
	for _, sp := range own {
		if err := sendControl(ctx, a.s, ctlSpaceWithdraw, rangeNotice(sp.id, 0, 0)); err != nil {
			return
		}
	}
	for _, sp := range own {
		select {
		case <-sp.withdrawn:
		case <-ctx.Done():
			return
		}
	}
}

// handleSpaceWithdraw answers a receiver's withdrawal once no write into its
// space is under way, or at once when this side holds no such space.
func handleSpaceWithdraw(s *transport.Session, payload []byte) {
	id, _, _, err := parseRangeNotice(payload, "SPACE-WITHDRAW")
	if err != nil {
		dropControl(s, err)
		return
	}
	if a := stateOf(s); a.link != nil { // not closedState, which all closed sessions share
		a.space.mu.Lock()
		a.space.peerWithdrawing = true // before the lookup: a SPACE handled later is refused
		a.space.mu.Unlock()
	}
	if ps := peerSpaceByID(s, id); ps != nil {
		ps.withdraw()
	}
	sendWithdrawn(s, id)
}

// handleSpaceWithdrawn takes the owner's answer to a withdrawal.
func handleSpaceWithdrawn(s *transport.Session, payload []byte) {
	id, _, _, err := parseRangeNotice(payload, "SPACE-WITHDRAWN")
	if err != nil {
		dropControl(s, err)
		return
	}
	a := stateOf(s)
	sp := ownSpaceByID(a, id)
	if sp == nil {
		return
	}
	sp.withdrawnOnce.Do(func() { close(sp.withdrawn) })
	st := &a.space
	st.mu.Lock()
	asked := st.withdrawing
	if !asked {
		// Unasked: the owner refused the space (refuseSpace), or says it
		// writes into it no more. Nothing lands in it from here on, its
		// memory goes back once the application gave back what it holds,
		// and no other space is advertised over s.
		st.own = slices.DeleteFunc(st.own, func(o *space) bool { return o == sp })
		st.failed = true
	}
	st.mu.Unlock()
	if !asked {
		cfgOf(s).Logger.Debug("receive space refused by its owner", "session", s.ID(), "space", id)
		sp.close()
	}
}

// give returns the range at off, of n bytes as taken, written by write gen
// (0: any write, for a receiver that names none); it reports false for a
// range that was not taken, or taken again since.
func (p *peerSpace) give(off, n, gen uint64) bool {
	p.mu.Lock()
	w, ok := p.taken[off]
	if !ok || w.writing || roundUp(n, spaceAlign) != w.n || gen != 0 && gen != w.gen {
		p.mu.Unlock()
		return false // a receiver learns of a range only once its write ended
	}
	p.giveLocked(off)
	p.mu.Unlock()
	if w.once != (Token{}) {
		Withdraw(w.once)
	}
	return true
}

// endWrite ends write gen into the range at off: the range stays written
// where keep is and its call has not ended meanwhile (endWrite then reports
// true); otherwise it is free again.
func (p *peerSpace) endWrite(off, gen uint64, keep bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	w, ok := p.taken[off]
	if !ok || w.gen != gen {
		return false // not this write's any more; nothing frees a range while it is written
	}
	w.writing = false
	if keep && !w.orphaned {
		return true
	}
	p.giveLocked(off)
	return false
}

// reclaimCall takes back the ranges written for client call id, which ended,
// except the writes it took: a range still being written goes when its write
// ends.
func (p *peerSpace) reclaimCall(id uint64, took map[spaceRange]bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for off, w := range p.taken {
		switch {
		case w.call != id || took[spaceRange{p.id, off, w.gen}]:
		case w.writing:
			w.orphaned = true
		default:
			p.giveLocked(off)
		}
	}
}

// giveLocked frees the range taken at off (p.mu held).
func (p *peerSpace) giveLocked(off uint64) {
	got := p.taken[off].n
	delete(p.taken, off)
	p.dropEventLocked(off)
	i, _ := slices.BinarySearchFunc(p.free, off, func(f span, o uint64) int { return cmp.Compare(f.off, o) })
	p.free = slices.Insert(p.free, i, span{off, got})
	// Merge with the neighbours.
	if i+1 < len(p.free) && p.free[i].off+p.free[i].n == p.free[i+1].off {
		p.free[i].n += p.free[i+1].n
		p.free = slices.Delete(p.free, i+1, i+2)
	}
	if i > 0 && p.free[i-1].off+p.free[i-1].n == p.free[i].off {
		p.free[i-1].n += p.free[i].n
		p.free = slices.Delete(p.free, i, i+1)
	}
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case b:
		return -1
	}
	return 1
}

// OfferTo is Offer for a payload whose message goes to the peer of s (a
// server's response): where that peer advertised receive space with room for
// it, the payload is written there now and the descriptor names where, so the
// receiver has nothing to pull; otherwise as Offer.
func OfferTo(s *transport.Session, src Source, opt OfferOptions) Descriptor {
	if s != nil {
		if d, ok := land(context.Background(), s, src, opt.Call); ok {
			return d
		}
	}
	return Offer(src, opt)
}

// OfferRequest is Offer for the payload of a client's request (a unary
// call's, or a client stream's message) over s: where
// the server advertised receive space with room for it, the payload is also
// written there now and the descriptor names where, so the server has
// nothing to pull. The payload stays in the outbox under the descriptor's
// token as well: gRPC may replay the marshaled request to another server, or
// to this one after it took the payload, and those pull it. Once the call
// is over, WritesEnded gives back what the server never took.
func OfferRequest(ctx context.Context, s *transport.Session, src Source, opt OfferOptions) Descriptor {
	d := Offer(src, opt)
	if s == nil {
		return d
	}
	l, ok := land(ctx, s, src, 0)
	if !ok {
		return d
	}
	d.Space, d.SpaceOffset, d.SpacePath, d.SpaceEvent, d.SpaceGen = l.Space, l.SpaceOffset, l.SpacePath, l.SpaceEvent, l.SpaceGen
	if !opt.Held {
		// Pulled at most once, if ever (a replay of a stream that never
		// reached the server): the token goes with the range.
		if ps := peerSpaceByID(s, d.Space); ps != nil {
			ps.tie(d.SpaceOffset, d.SpaceGen, d.Token)
		}
	}
	return d
}

// tie makes t leave the outbox once write gen into the range at off is
// given back by the receiver.
func (p *peerSpace) tie(off, gen uint64, t Token) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w, ok := p.taken[off]; ok && w.gen == gen {
		w.once = t
	}
}

// Reclaim gives back the receive space that d, a descriptor OfferTo returned
// for a message over s, names: the message was never sent, so the receiver
// will not. Other descriptors are ignored.
func Reclaim(s *transport.Session, d Descriptor) {
	if d.Space == 0 || s == nil {
		return
	}
	if ps := peerSpaceByID(s, d.Space); ps != nil {
		ps.give(d.SpaceOffset, d.Length, d.SpaceGen)
	}
}

// Discard gives back the range of this process's receive space that d
// names, for a payload the receiver refuses without taking it (over a size
// limit, in a message it cannot decode): the owner may write there again.
// ctx is the context of the call whose message named d: only a message of
// the space's own peer gives its range back (another that learned the
// space's id must not free, or mark stale, the owner's writes). Other
// descriptors, and ranges this process cannot vouch for, are ignored; what
// is ignored goes back when the call ends.
func Discard(ctx context.Context, d Descriptor) {
	if d.Space == 0 {
		return
	}
	if arrived := transport.SessionFromContext(ctx); arrived == nil || arrived.PeerID() != d.Owner {
		return
	}
	sp, err := landedSpace(d)
	if err != nil {
		return
	}
	sp.mu.Lock()
	if sp.heldOverlapLocked(d.SpaceOffset, d.Length) == nil && !sp.staleLocked(d.SpaceOffset, d.SpaceGen) {
		sp.queueFreeLocked(heldRange{d.SpaceOffset, d.Length, d.SpaceGen})
	}
	sp.mu.Unlock()
}

// land writes src, a payload of the peer's call (0: a call without a
// number), into a receive space the peer of s advertised: the newest with
// room for it, within the transfer timeout and the life of s and of
// callCtx (a request's call). Nothing lands for a call the peer ended.
func land(callCtx context.Context, s *transport.Session, src Source, call uint64) (Descriptor, bool) {
	all := peerSpacesOf(s)
	if len(all) == 0 || src.Len() == 0 {
		return Descriptor{}, false
	}
	c := cfgOf(s)
	n := uint64(src.Len())
	// Between hosts over UCX's tcp alone the stream path outruns puts of
	// host memory into a host space where streamFirst says so.
	stream := src.kind() == devicebuf.Host && streamFirst(s, n, true)
	var ps *peerSpace
	var off, gen uint64
	offers := PathNone
	for _, p := range all {
		if p.tmpl.Offers&c.Paths == 0 || stream && p.tmpl.RMemory == 0 {
			continue // this side does not write by that path, or not this payload
		}
		offers |= p.tmpl.Offers
		if o, g, ok := p.take(n, call); ok {
			ps, off, gen = p, o, g
			break
		}
	}
	if ps == nil {
		if offers != PathNone {
			c.Metrics.Fallback(offers, PathNone, "advertised receive space full or withdrawn")
		}
		return Descriptor{}, false
	}
	defer ps.writers.Done()
	if stateOf(s).space.callEnded(call) {
		// Checked after take, which noted the call: a CALL-ENDED handled
		// meanwhile reclaims the range, one handled before stops the write.
		ps.endWrite(off, gen, false)
		return Descriptor{}, false
	}
	m := ps.tmpl
	m.Length, m.RAddr, m.IPCOffset = n, m.RAddr+off, m.IPCOffset+off
	defer busy(s)()
	start := time.Now()
	path, event, err := pushInto(callCtx, s, ps, &m, off, gen, src)
	c.Metrics.Transfer(TransferInfo{Path: path, Bytes: int64(n), Elapsed: time.Since(start), Err: err, Memory: src.kind(), Advertised: true, Queued: event != 0})
	if !ps.endWrite(off, gen, err == nil) {
		if err != nil {
			c.Metrics.Fallback(path, PathNone, "write into advertised receive space: "+err.Error())
		}
		return Descriptor{}, false
	}
	d := describe(src)
	d.Space, d.SpaceOffset, d.SpacePath = ps.id, off, ps.tmpl.Offers // staged on this side or not, a put is what arrives
	d.SpaceEvent, d.SpaceGen = event, gen
	return d, true
}

// pushInto writes src where m says (the range at off of the space), by the
// path the receiver advertised and nothing else. A copy that may still run
// when pushInto returns names the receiver's event that marks its end. Puts
// are bounded by the transfer timeout and the lives of s and callCtx; a
// device-to-device copy is the GPU's to finish and needs no bound, so it
// makes no timer (a call's marshal waits for that copy to be queued).
func pushInto(callCtx context.Context, s *transport.Session, ps *peerSpace, m *rtr, off, gen uint64, src Source) (Path, uint32, error) {
	if m.Offers == PathCUDAIPC {
		if !ipcAllowed(s) {
			return PathCUDAIPC, 0, errors.New("CUDA IPC is for trusted peers on this host")
		}
		event, err := ps.copyInto(callCtx, s, m, off, gen, src)
		return PathCUDAIPC, event, err
	}
	ep, rc := s.Endpoint(), s.RDMAContext()
	if ep == nil || rc == nil {
		return PathRDMA, 0, errors.New("no UCX endpoint")
	}
	if src.kind() == devicebuf.CUDA && !gpuDirect(rc, ep) && m.RMemory != 0 {
		// Staging on this side would put host memory into the receiver's
		// GPU memory, which this session's lanes do not reach.
		return PathRDMA, 0, errors.New("UCX cannot move this GPU memory itself")
	}
	// GPU memory UCX cannot move goes staged into host space: the receiver
	// offered no chunk notices, so the puts are all it sees.
	ctx, cancel := context.WithTimeout(sessionContext(s), cfgOf(s).Timeout)
	defer cancel()
	defer context.AfterFunc(callCtx, cancel)()
	path, err := pushRDMA(ctx, s, ep, m, src)
	return path, 0, err
}

// copyInto copies src device to device where m says (the range at off),
// through the space's mapping, once src arrived (within ctx). A GPU source
// is copied on the space's stream, the message not waiting for it, and a
// receiver's event marks the copy's end: its number comes back. Otherwise
// the copy is complete when copyInto returns (0); once the space has a
// stream, such a copy runs on it too, after any copy still queued into the
// same range (one whose message was never sent, or whose receiver gave the
// range back without waiting).
func (p *peerSpace) copyInto(ctx context.Context, s *transport.Session, m *rtr, off, gen uint64, src Source) (uint32, error) {
	if b := src.Buffer; b != nil && b.Pending() {
		// A source still arriving (received stream-ordered, sent on) is
		// waited for once, here, within its bound and the call's life.
		if err := b.Await(ctx); err != nil {
			return 0, fmt.Errorf("the payload sent on did not arrive: %w", err)
		}
	}
	mapping, err := p.mapped(s)
	if err != nil {
		return 0, err
	}
	defer mapping.Release()
	q, ev, i := p.eventFor(s, off, gen, mapping.Device(), src)
	if ev != nil {
		err := q.copyInto(mapping, m, src.Buffer, ev)
		if err == nil {
			return uint32(i) + 1, nil
		}
		p.dropEvent(off, i)
		cfgOf(s).Logger.Debug("copy into receive space waited for", "session", s.ID(), "err", err)
	}
	var stream *devicebuf.Stream // nil: nothing was ever queued into this space
	if q != nil {
		stream = q.stream
	}
	return 0, copyIntoIPC(mapping, m, src, stream)
}

// eventFor returns the space's copy queue and, for a GPU source, a
// receiver's event (opened the first time) with its index, recorded as the
// range at off's. The queue is made with the first event taken: nil means
// nothing was ever queued. A nil event means the copy must be waited for.
func (p *peerSpace) eventFor(s *transport.Session, off, gen uint64, dev int, src Source) (*copyQueue, *devicebuf.Event, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, nil, 0
	}
	w := p.taken[off]
	if w == nil || w.gen != gen || src.Buffer == nil || src.kind() != devicebuf.CUDA || len(p.events) == 0 || p.eventsOff {
		return p.copies, nil, 0
	}
	p.dropEventLocked(off) // a range marked already (none is, today) lets go of its mark first
	i := p.eventForLocked()
	if p.opened[i] == nil {
		ev, err := devicebuf.OpenIPCEvent(p.events[i], dev)
		if err != nil {
			p.eventsOff = true
			cfgOf(s).Logger.Debug("receiver's event not opened", "session", s.ID(), "err", err)
			return p.copies, nil, 0
		}
		p.opened[i] = ev
	}
	if p.copies == nil {
		q, err := newCopyQueue(dev)
		if err != nil {
			cfgOf(s).Logger.Debug("no copy stream for the receive space", "session", s.ID(), "err", err)
			return nil, nil, 0
		}
		p.copies = q
	}
	p.takeEventLocked(off, i)
	return p.copies, p.opened[i], i
}

// eventForLocked picks the event to mark the next copy: the first free
// one, or, when every event marks a range still held, the next in turn,
// shared. A shared event is sound because all the copies of a space queue
// on its one stream, in order: recorded after a later copy, an event
// completes only once every earlier copy has, so a receiver waiting on it
// for an earlier one waits longer, never too little: until the later copy
// ends. No copy waits on anything but the device (a source still arriving
// is waited for before its copy is queued), so none holds the others up
// (p.mu held).
func (p *peerSpace) eventForLocked() int {
	if i := slices.Index(p.eventUses, 0); i >= 0 {
		return i
	}
	return p.nextShared % len(p.events)
}

// takeEventLocked records event i, which eventForLocked just picked, as the
// one marking the range at off, which no event marks (p.mu held).
func (p *peerSpace) takeEventLocked(off uint64, i int) {
	if p.eventUses[i] > 0 {
		p.nextShared = i + 1
	}
	p.eventUses[i]++
	p.eventOf[off] = i
}

// dropEventLocked lets go of the event marking the range at off, if one
// does; it is free once it marks no range (p.mu held).
func (p *peerSpace) dropEventLocked(off uint64) {
	if i, ok := p.eventOf[off]; ok {
		delete(p.eventOf, off)
		p.eventUses[i]--
	}
}

// dropEvent lets go of event i, taken for the range at off by a copy that
// failed.
func (p *peerSpace) dropEvent(off uint64, i int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if j, ok := p.eventOf[off]; ok && j == i {
		p.dropEventLocked(off)
	}
}

// mapped returns a reference to the space's mapping, opening it the first
// time.
func (p *peerSpace) mapped(s *transport.Session) (*devicebuf.Buffer, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, closedErr(s)
	}
	if p.mapping == nil {
		if p.openErr != nil && time.Since(p.openedAt) < mapRetry {
			return nil, p.openErr
		}
		if err := foreignIPC(s, p.tmpl.IPC); err != nil {
			return nil, err
		}
		b, err := openIPC(&p.tmpl)
		if err != nil {
			p.openErr, p.openedAt = err, time.Now()
			return nil, err
		}
		p.mapping, p.openErr = b, nil
	}
	return p.mapping.Retain(), nil
}

// mapRetry is how long a space whose mapping did not open is written into
// by other paths before its mapping is tried again.
const mapRetry = time.Second

// endSpaces ends the advertised spaces of a closing session: this side's
// space is freed once no range of it is held, and the mapping of the peer's
// closes once no copy uses it.
func endSpaces(a *attached) {
	st := &a.space
	st.mu.Lock()
	st.stopped = true
	own, peer := st.own, st.peer
	st.own, st.peer = nil, nil
	st.mu.Unlock()
	for _, sp := range own {
		sp.close()
	}
	for _, ps := range peer {
		ps.withdraw()
	}
}

// copyQueue is the stream of copies into a peer's space whose messages do
// not wait for them, and what lets go of their buffers (held by the stream)
// once they are complete: a goroutine, from the queue's making to its close,
// that synchronizes the stream whenever copies were queued since it last
// did. It is woken, not started, on a copy's path.
type copyQueue struct {
	stream *devicebuf.Stream
	// reaped is the reaper's own event: while copies come back to back it
	// waits for them by polling it between sleeps (SynchronizeBy), not
	// spinning in the driver beside the marshals that queue the next ones.
	reaped *devicebuf.Event
	kick   chan struct{} // buffered: copies were queued since the last synchronization began
	stop   chan struct{} // closed by close
	reaper sync.WaitGroup
}

func newCopyQueue(dev int) (*copyQueue, error) {
	st, err := devicebuf.NewCopyStream(dev)
	if err != nil {
		return nil, err
	}
	ev, err := devicebuf.NewEvent(dev)
	if err != nil {
		return nil, errors.Join(err, st.Close())
	}
	q := &copyQueue{stream: st, reaped: ev, kick: make(chan struct{}, 1), stop: make(chan struct{})}
	q.reaper.Add(1)
	go q.reap()
	return q, nil
}

// copyInto queues a copy of src into the range of mapping that m names and
// records ev after it.
func (q *copyQueue) copyInto(mapping *devicebuf.Buffer, m *rtr, src *devicebuf.Buffer, ev *devicebuf.Event) error {
	dst, err := ipcDestination(mapping, m)
	if err != nil {
		return err
	}
	defer dst.Release()
	defer trace.StartRegion(context.Background(), "gdrpc.ipc-copy-queue").End()
	// peerSpace.copyInto waited for a source still arriving (received
	// stream-ordered, sent on) within the call's context; the stream's
	// guard, within the source's bound: the stream is the space's, and a wait
	// on another process's event there would hold up every copy into the
	// space and its close for as long as that process's work runs.
	if err := src.Wait(); err != nil {
		return err
	}
	if err := devicebuf.CopyAsync(q.stream, dst, src); err != nil {
		return err
	}
	if err := q.stream.Record(ev); err != nil {
		// The copy runs unmarked: wait for it before the caller copies again.
		return errors.Join(err, q.stream.Synchronize())
	}
	select {
	case q.kick <- struct{}{}:
	default: // a synchronization is due already
	}
	return nil
}

// reap waits for the queued copies whenever some were queued. While copies
// are queued back to back (a kick came during the last wait) it polls its
// event between sleeps, which leaves the stream to the marshals queueing
// them; otherwise it waits in the driver, which lets go of a lone copy's
// buffers soonest and arms no timer.
func (q *copyQueue) reap() {
	defer q.reaper.Done()
	busy := false
	for {
		select {
		case <-q.kick:
		case <-q.stop:
			return // close waited for the copies
		}
		var err error
		if busy {
			err = q.stream.SynchronizeBy(q.reaped)
		} else {
			err = q.stream.Synchronize()
		}
		if errors.Is(err, net.ErrClosed) {
			return // close waited for the copies
		}
		// Another error (the device's) still let go of the copies' buffers;
		// the next copy's kick synchronizes again.
		busy = len(q.kick) > 0
	}
}

// close waits for the queued copies and ends the queue.
func (q *copyQueue) close() {
	_ = q.stream.Close()
	close(q.stop)
	q.reaper.Wait()
	_ = q.reaped.Close()
}
