package oob

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

// DefaultLease bounds how long an outbox entry lives when nobody withdraws it.
const DefaultLease = 2 * time.Minute

// Source is a payload an owner serves from its outbox: a devicebuf.Buffer (host or
// device memory) or plain Go bytes.
type Source struct {
	Buffer *devicebuf.Buffer
	Bytes  []byte
}

// Len returns the payload length.
func (s Source) Len() int {
	if s.Buffer != nil {
		return s.Buffer.Len()
	}
	return len(s.Bytes)
}

// kind returns the kind of memory the source is in.
func (s Source) kind() devicebuf.Kind {
	if s.Buffer != nil {
		return s.Buffer.Kind()
	}
	return devicebuf.Host
}

// OfferOptions say how long an outbox entry lives.
type OfferOptions struct {
	// Held entries stay until Withdraw (or the lease) however many receivers pulled
	// them: a call that may be retried holds its request payloads. Entries not held
	// leave after their first completed pull.
	Held bool
	// Lease is the backstop. If zero, DefaultLease.
	Lease time.Duration
	// Call is, for OfferTo, the number the client gave the call the message
	// answers (its CallHeader), or 0: a client that ends the call without
	// taking the message gets the receive space back (CALL-ENDED).
	Call uint64
}

type outboxEntry struct {
	src   Source
	held  bool
	pulls int // completed pulls
	// uses are the pulls under way, each reading src until it checks in or
	// the entry leaves; the source is freed once none is left.
	uses   map[*sourceUse]struct{}
	dead   bool          // left the outbox
	freed  bool          // src was freed (freeLocked)
	left   chan struct{} // closed once the entry left and no pull reads src any more
	timer  *time.Timer
	lease  time.Duration
	toward *transport.ID // the process the descriptor was sent to (SentToward), if known
	flow   *Flow         // the call whose message named it (Flow.Send), if any
	call   uint64        // that peer's number for the call (Flow.Send), or 0
	// waiter is the call whose message names it while the message waits
	// to be sent (Flow.Send): the entry's leaving wakes it.
	waiter *Flow
}

// sourceUse is one pull's use of an outbox entry's source. The entry's
// leaving ends it: the pull's context is cancelled, which cuts short a write
// under way, the leaving waits for the read of the source under way (read)
// to return, and later reads fail with errWithdrawn. So once Withdraw
// returns, nothing reads a Bytes source the application may reuse.
type sourceUse struct {
	cancel context.CancelCauseFunc // the pull's; nil for a copy that is not cut short
	mu     sync.Mutex              // held while the pull reads the source
	ended  bool                    // guarded by mu
}

// errWithdrawn fails a pull whose outbox entry left while it was under way.
var errWithdrawn = errors.New("the payload was withdrawn during its transfer")

// read runs fn, which reads the source, unless the use ended.
func (u *sourceUse) read(fn func() error) error {
	if err := u.begin(); err != nil {
		return err
	}
	defer u.finish()
	return fn()
}

// begin starts a read of the source, which finish ends; it fails once the
// use ended.
func (u *sourceUse) begin() error {
	u.mu.Lock()
	if u.ended {
		u.mu.Unlock()
		return errWithdrawn
	}
	return nil
}

// finish ends the read begin started.
func (u *sourceUse) finish() { u.mu.Unlock() }

// end cancels the pull and waits for its read of the source under way.
func (u *sourceUse) end() {
	if u.cancel != nil {
		u.cancel(errWithdrawn)
	}
	u.mu.Lock()
	u.ended = true
	u.mu.Unlock()
}

// withdrawn reports whether the use ended before the pull checked in: what
// the pull sent may then be cut short, and it must not report success.
func (u *sourceUse) withdrawn() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.ended
}

type outbox struct {
	mu      sync.Mutex
	entries map[Token]*outboxEntry
	// leaving are the entries that left the outbox while pulls still used
	// them, until those uses ended: a Withdraw of their token waits for that.
	leaving map[Token]*outboxEntry
	toward  map[transport.ID]*sentEntries // entries by the process they were sent to
	waiting int                           // Flow.Sends waiting for room
	// sent are the payload bytes of all peers' sentEntries: what
	// Limits.TotalUnpulledBytes bounds. totalWaiters are the messages first
	// in their peer's waiters and within its bound that wait for room within
	// it, first come first served as a peer's waiters are.
	sent         int64
	totalWaiters []*peerWaiter
}

// sentEntries are the outbox entries sent toward one process and not yet
// pulled: what Limits.PeerUnpulledBytes bounds, and what a CALL-ENDED of
// that process names by call.
type sentEntries struct {
	tokens map[Token]struct{}
	bytes  int64                         // their payloads' bytes
	calls  map[uint64]map[Token]struct{} // those sent for a numbered call, by number
	// waiters are the messages waiting for room within
	// Limits.PeerUnpulledBytes, first come first served: only the first is
	// woken, once it fits, so a message is neither starved by smaller ones
	// nor are all woken at each pull.
	waiters []*peerWaiter
}

// peerWaiter is a message waiting in sentEntries.waiters, and in
// outbox.totalWaiters once it is first there and fits its peer's bound.
type peerWaiter struct {
	n, limit int64         // its payloads' bytes; the peer's bound of its session
	total    int64         // the process's bound of its session (Limits.TotalUnpulledBytes)
	ready    chan struct{} // closed when it is first and fits
}

// fitsTotalLocked reports whether a message of n bytes fits within limit
// beside what all peers hold: a message larger than the limit fits once
// nothing is held. box.mu is held.
func (b *outbox) fitsTotalLocked(n, limit int64) bool {
	return b.sent == 0 || b.sent+n <= limit
}

// wakeTotalLocked wakes the first of totalWaiters once it fits. box.mu is
// held.
func (b *outbox) wakeTotalLocked() {
	if len(b.totalWaiters) == 0 {
		return
	}
	if w := b.totalWaiters[0]; b.fitsTotalLocked(w.n, w.total) {
		w.wake()
	}
}

// wake closes w.ready unless it is closed. box.mu is held.
func (w *peerWaiter) wake() {
	select {
	case <-w.ready:
	default:
		close(w.ready)
	}
}

// fits reports whether a message of n bytes fits within limit beside what
// p holds: a message larger than the limit fits once p holds nothing.
func (p *sentEntries) fits(n, limit int64) bool {
	return p.bytes == 0 || p.bytes+n <= limit
}

// wakeLocked wakes the first waiter once it fits. box.mu is held.
func (p *sentEntries) wakeLocked() {
	if len(p.waiters) == 0 {
		return
	}
	if w := p.waiters[0]; p.fits(w.n, w.limit) {
		w.wake()
	}
}

// leaveTotalLocked takes w out of totalWaiters, if it is there, and wakes
// the next. box.mu is held.
func (b *outbox) leaveTotalLocked(w *peerWaiter) {
	if i := slices.Index(b.totalWaiters, w); i >= 0 {
		b.totalWaiters = slices.Delete(b.totalWaiters, i, i+1)
		b.wakeTotalLocked()
	}
}

// leaveQueueLocked takes w out of p's waiters and of totalWaiters, and wakes
// the next of each. box.mu is held.
func (b *outbox) leaveQueueLocked(peer transport.ID, p *sentEntries, w *peerWaiter) {
	b.leaveTotalLocked(w)
	if p == nil {
		return
	}
	if i := slices.Index(p.waiters, w); i >= 0 {
		p.waiters = slices.Delete(p.waiters, i, i+1)
	}
	p.wakeLocked()
	b.dropIfEmptyLocked(peer, p)
}

// dropIfEmptyLocked forgets p, peer's, once it holds nothing and nobody
// waits in it. box.mu is held.
func (b *outbox) dropIfEmptyLocked(peer transport.ID, p *sentEntries) {
	if len(p.tokens) == 0 && len(p.waiters) == 0 && b.toward[peer] == p {
		delete(b.toward, peer)
	}
}

// sentTo returns what the outbox holds sent toward peer, made if need be.
// box.mu is held.
func (b *outbox) sentTo(peer transport.ID) *sentEntries {
	p := b.toward[peer]
	if p == nil {
		p = &sentEntries{tokens: make(map[Token]struct{})}
		b.toward[peer] = p
	}
	return p
}

// A Flow counts the payloads of one call's messages that wait in the outbox
// for the peer to pull them, and holds the call's next message back while
// they would go over Limits.UnpulledBytes: as gRPC's flow control holds a
// stream's sender to a peer that does not read it, without holding the
// peer's other calls. A server stream's responses go through Send, which
// binds them to the client; a client stream's requests, whose connection
// gRPC picks after they are marshaled, are counted by Track and waited for
// by Wait. The zero value is ready to use; box.mu guards it.
type Flow struct {
	// bytes is written with box.mu held; Over reads it without.
	bytes atomic.Int64
	room  chan struct{} // closed when bytes fall; nil when nothing waits
}

// wake tells a waiting Send to look again.
func (f *Flow) wake() {
	if f.room != nil {
		close(f.room)
		f.room = nil
	}
}

var box = &outbox{entries: make(map[Token]*outboxEntry), leaving: make(map[Token]*outboxEntry), toward: make(map[transport.ID]*sentEntries)}

// Offer puts src in this process's outbox and returns the descriptor that names
// it. The outbox takes its own reference on a Buffer source and drops it when
// the entry leaves. A Bytes source must not be modified until then: until
// Withdraw of its token returned, which ends the pulls still reading it.
func Offer(src Source, opt OfferOptions) Descriptor {
	d := describe(src)
	if b := src.Buffer; b != nil {
		b.Retain()
	}
	lease := opt.Lease
	if lease <= 0 {
		lease = DefaultLease
	}
	e := &outboxEntry{src: src, held: opt.Held, uses: make(map[*sourceUse]struct{}), left: make(chan struct{}), lease: lease}
	tok := d.Token
	box.mu.Lock()
	box.entries[d.Token] = e
	// Set under the lock: a short lease may fire before Offer returns, and
	// Withdraw reads the timer once it holds the lock.
	e.timer = time.AfterFunc(lease, func() { Withdraw(tok) })
	box.mu.Unlock()
	return d
}

// describe returns a descriptor of src with a fresh token.
func describe(src Source) Descriptor {
	d := Descriptor{Owner: transport.LocalID(), Token: newToken(), Length: uint64(src.Len()), HostID: transport.LocalHostID(), Kind: devicebuf.Host, Device: -1}
	if b := src.Buffer; b != nil {
		d.Kind, d.Device, d.DeviceUUID = b.Kind(), b.Device(), b.DeviceUUID()
	}
	return d
}

// Offered reports whether the outbox holds t (neither withdrawn nor
// expired yet).
func Offered(t Token) bool {
	box.mu.Lock()
	defer box.mu.Unlock()
	_, ok := box.entries[t]
	return ok
}

// Withdraw removes an entry; pulls under way stop (they fail) and no longer
// read its source by the time Withdraw returns; later pulls of the token fail
// as unknown. Withdrawing an unknown token does nothing.
func Withdraw(t Token) {
	box.mu.Lock()
	e, ok := box.entries[t]
	if !ok {
		e = box.leaving[t] // another removal of t is ending its pulls
		box.mu.Unlock()
		if e != nil {
			<-e.left
		}
		return
	}
	uses := box.removeLocked(t, e)
	box.mu.Unlock()
	box.leave(t, e, uses)
}

func (e *outboxEntry) free() {
	if e.src.Buffer != nil {
		e.src.Buffer.Release()
	}
}

var errUnknownToken = errors.New("unknown or expired token")

// checkout starts a pull of t for length n. cancel ends the pull's
// context when the entry leaves before the pull checks in; nil for a pull
// that is not cut short (a local copy). The pull reads the source only
// through the returned use.
func (b *outbox) checkout(t Token, n uint64, cancel context.CancelCauseFunc) (*outboxEntry, *sourceUse, finStatus, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.entries[t]
	if !ok {
		return nil, nil, finUnknownToken, errUnknownToken
	}
	if uint64(e.src.Len()) != n {
		return nil, nil, finBadLength, fmt.Errorf("length %d asked, payload is %d bytes", n, e.src.Len())
	}
	u := &sourceUse{cancel: cancel}
	e.uses[u] = struct{}{}
	return e, u, finOK, nil
}

// checkin ends a pull and reports whether it completed: ok, and its use not
// ended by the entry's leaving. A completed pull of an entry that is not
// held releases it.
func (b *outbox) checkin(t Token, e *outboxEntry, u *sourceUse, ok bool) bool {
	b.mu.Lock()
	delete(e.uses, u)
	ok = ok && !u.withdrawn()
	if ok {
		e.pulls++
	}
	var uses []*sourceUse
	leave := ok && !e.held && !e.dead
	if leave {
		uses = b.removeLocked(t, e)
	}
	free := e.freeLocked()
	b.mu.Unlock()
	if leave {
		b.leave(t, e, uses)
	}
	if free {
		e.free()
	}
	return ok
}

// freeLocked reports, once, that e's source is to be freed: e left the
// outbox and no pull holds it.
func (e *outboxEntry) freeLocked() bool {
	if !e.dead || len(e.uses) > 0 || e.freed {
		return false
	}
	e.freed = true
	return true
}

// Stats is a snapshot of the engine in this process, for diagnostics and
// leak checks.
type Stats struct {
	Offered int // payloads in the outbox: offered, not yet withdrawn or expired
	// Waiting are the messages whose payloads wait in the outbox for the
	// peer to pull earlier ones (Limits.UnpulledBytes, PeerUnpulledBytes,
	// TotalUnpulledBytes).
	Waiting int
	// Unpulled are the payload bytes in the outbox sent toward peers and
	// not pulled, all peers together (Limits.TotalUnpulledBytes bounds them).
	Unpulled int64
	Pulls    int // pulls under way (their destinations not yet settled)
	Sessions int // sessions the engine serves
	Spaces   int // receive spaces this process advertised, alive (their session open, or ranges held)
	Landed   int // ranges of them the application holds
	// Making are the advertisements under way: receive spaces being made,
	// cleared and advertised after the pulls that prompted them.
	Making int
	// SpaceBytes are the bytes of those spaces and of spaces being made
	// (Limits.SpaceBytes bounds them).
	SpaceBytes int64
	// PeerSpaces are the receive spaces peers advertised to this process, of
	// open sessions; PeerTaken the ranges of them written and not given back.
	PeerSpaces, PeerTaken int
	// Parked are the payload bytes of requests whose handlers do not have
	// them yet, all sessions together (Park); ParkWaiting the requests
	// waiting for room to park theirs.
	Parked      int64
	ParkWaiting int
}

// ReadStats returns the current Stats.
func ReadStats() Stats {
	var st Stats
	box.mu.Lock()
	st.Offered = len(box.entries)
	st.Waiting = box.waiting
	st.Unpulled = box.sent
	box.mu.Unlock()
	pulls.Lock()
	st.Pulls = len(pulls.m)
	pulls.Unlock()
	sessions.Range(func(_, v any) bool {
		st.Sessions++
		b := &v.(*attached).bounds
		b.mu.Lock()
		st.Parked += b.parked
		st.ParkWaiting += len(b.parkQueue)
		b.mu.Unlock()
		for _, ps := range peerSpacesOfState(v.(*attached)) {
			st.PeerSpaces++
			ps.mu.Lock()
			st.PeerTaken += len(ps.taken)
			ps.mu.Unlock()
		}
		return true
	})
	st.Making = int(spacesMaking.Load())
	liveSpaces.Lock()
	st.SpaceBytes = liveSpaces.bytes
	for sp := range liveSpaces.m {
		st.Spaces++
		sp.mu.Lock()
		st.Landed += len(sp.inUse)
		sp.mu.Unlock()
	}
	liveSpaces.Unlock()
	return st
}

// removeLocked takes e, the entry of t, out of the outbox, and returns the
// uses of its source that leave must end.
func (b *outbox) removeLocked(t Token, e *outboxEntry) []*sourceUse {
	delete(b.entries, t)
	e.dead = true
	if f := e.flow; f != nil {
		f.bytes.Add(-int64(e.src.Len()))
		f.wake()
	}
	if f := e.waiter; f != nil {
		f.wake()
	}
	if e.toward != nil {
		if p := b.toward[*e.toward]; p != nil {
			delete(p.tokens, t)
			p.bytes -= int64(e.src.Len())
			b.sent -= int64(e.src.Len())
			if c := p.calls[e.call]; c != nil {
				delete(c, t)
				if len(c) == 0 {
					delete(p.calls, e.call)
				}
			}
			p.wakeLocked()
			b.wakeTotalLocked()
			b.dropIfEmptyLocked(*e.toward, p)
		}
	}
	b.leaving[t] = e
	uses := make([]*sourceUse, 0, len(e.uses))
	for u := range e.uses {
		uses = append(uses, u)
	}
	return uses
}

// leave ends uses, the pulls of e under way when it left the outbox
// (removeLocked), and waits for their reads of its source; the source is
// freed once no pull holds it any more (here, or at the last checkin).
func (b *outbox) leave(t Token, e *outboxEntry, uses []*sourceUse) {
	e.timer.Stop()
	for _, u := range uses {
		u.end()
	}
	b.mu.Lock()
	delete(b.leaving, t)
	free := e.freeLocked()
	b.mu.Unlock()
	close(e.left)
	if free {
		e.free()
	}
}

// SentToward records that the descriptors naming ts went to the peer of s (a
// server's response to the client that called). Those still in the outbox
// when no live session to that process remains leave it then, whatever their
// lease: nobody else holds their descriptors, and the process that does can
// no longer pull. Tokens that already left, or were bound already
// (Flow.Send), are ignored.
func SentToward(s *transport.Session, ts []Token) {
	peer := s.PeerID()
	box.mu.Lock()
	for _, t := range ts {
		if e := box.entries[t]; e != nil && e.toward == nil {
			box.bindLocked(t, e, peer, 0)
		}
	}
	if p := box.toward[peer]; p != nil && len(p.waiters) > 0 {
		// The peer's first message may no longer fit beside what was bound:
		// it waits for the peer's pulls, not ahead of other peers' messages.
		if w := p.waiters[0]; !p.fits(w.n, w.limit) {
			box.leaveTotalLocked(w)
		}
	}
	box.mu.Unlock()
	// The last session to the peer may have closed before the entries were
	// bound to it.
	releaseOrphans(peer)
}

// Send is SentToward for ts, the payloads of one message of f's call about
// to be sent to the peer of s, call being the peer's number for the call
// (oob.CallHeader; 0 if it gave none): a CALL-ENDED of the peer for that
// call withdraws what it has not pulled. The message waits, before it is
// sent, while it would take
//   - what f's earlier messages left unpulled over Limits.UnpulledBytes,
//     for the peer's pulls of them (as gRPC's flow control holds a stream's
//     sender to a client that does not read it), or
//   - what all messages sent toward the peer process left unpulled over
//     Limits.PeerUnpulledBytes, for the peer's pulls of any of them.
//
// It fails when ctx ends, s closes, or one of ts leaves the outbox (its
// lease ends) first. A message larger than a limit on its own goes once
// nothing the limit counts waits unpulled. The lease of ts starts again
// once they are bound: it bounds how long the peer has to pull them, not
// how long they waited. Send also fails if the peer ended the call.
func (f *Flow) Send(ctx context.Context, s *transport.Session, call uint64, ts []Token) error {
	peer := s.PeerID()
	lim := cfgOf(s).Limits
	var w *peerWaiter // once queued in the peer's waiters
	box.mu.Lock()
	fail := func(err error) error { // box.mu held
		f.disown(ts)
		if w != nil {
			box.leaveQueueLocked(peer, box.toward[peer], w)
		}
		box.mu.Unlock()
		return err
	}
	for {
		var n int64
		for _, t := range ts {
			e := box.entries[t]
			if e == nil {
				return fail(fmt.Errorf("oob: a payload of the message left the outbox (withdrawn or expired) while it waited to be sent"))
			}
			if e.toward == nil {
				n += int64(e.src.Len())
				e.waiter = f
			}
		}
		if n == 0 { // every payload is bound already: nothing more to count
			if w != nil {
				box.leaveQueueLocked(peer, box.toward[peer], w)
			}
			break
		}
		var peerRoom chan struct{} // nil: not waited on
		overCall := f.bytes.Load() > 0 && f.bytes.Load()+n > lim.UnpulledBytes
		if overCall && w != nil {
			// Its own call holds it back: it must not hold back the
			// peer's other calls meanwhile.
			box.leaveQueueLocked(peer, box.toward[peer], w)
			w = nil
		}
		overTotal := false
		if !overCall {
			// The call's own bound holds: the message takes its turn
			// among the peer's, then among all peers'.
			p := box.toward[peer]
			if w == nil && (p == nil || len(p.waiters) == 0 && p.fits(n, lim.PeerUnpulledBytes)) &&
				len(box.totalWaiters) == 0 && box.fitsTotalLocked(n, lim.TotalUnpulledBytes) {
				break
			}
			if w == nil {
				p = box.sentTo(peer)
				w = &peerWaiter{limit: lim.PeerUnpulledBytes, total: lim.TotalUnpulledBytes, ready: make(chan struct{})}
				p.waiters = append(p.waiters, w)
			}
			w.n = n
			i := slices.Index(box.totalWaiters, w)
			if p.waiters[0] == w && p.fits(w.n, w.limit) {
				// Its turn among the peer's. It stays first there while it
				// waits for room among all peers', so that none of the
				// peer's later messages passes it.
				if (i == 0 || i < 0 && len(box.totalWaiters) == 0) && box.fitsTotalLocked(w.n, w.total) {
					if i == 0 {
						box.totalWaiters = box.totalWaiters[1:]
					}
					p.waiters = p.waiters[1:] // the next of each is woken once it is bound
					w = nil
					break
				}
				if i < 0 {
					box.totalWaiters = append(box.totalWaiters, w)
				}
				overTotal = true
			} else {
				// It does not fit its peer's bound (any more: payloads bound
				// toward the peer without waiting, SentToward): it waits for
				// its peer's pulls, not ahead of other peers' messages.
				box.leaveTotalLocked(w)
			}
			select {
			case <-w.ready: // woken, and no longer fits: wait again
				w.ready = make(chan struct{})
			default:
			}
			peerRoom = w.ready
		}
		if f.room == nil {
			f.room = make(chan struct{})
		}
		room, unpulled, all := f.room, f.bytes.Load(), box.sent
		var sent int64
		if p := box.toward[peer]; p != nil {
			sent = p.bytes
		}
		box.waiting++
		box.mu.Unlock()
		var err error
		select {
		case <-room:
		case <-peerRoom:
		case <-ctx.Done():
			err = context.Cause(ctx)
		case <-s.Done():
		}
		if err == nil {
			select {
			case <-s.Done():
				// Also when room came with the close: the peer's unpulled
				// payloads leave with its last session, which wakes this
				// wait, but the message has no session to go over.
				err = errors.New("the session closed")
			default:
			}
		}
		box.mu.Lock()
		box.waiting--
		if err != nil {
			if overCall {
				return fail(fmt.Errorf("oob: the peer left %d bytes of this call's earlier payloads unpulled, and %d more would go over Limits.UnpulledBytes (%d): %w", unpulled, n, lim.UnpulledBytes, err))
			}
			if overTotal {
				return fail(fmt.Errorf("oob: peers left %d bytes unpulled in all (%d of them this peer's), and %d more would go over Limits.TotalUnpulledBytes (%d), or earlier messages wait for room: %w", all, sent, n, lim.TotalUnpulledBytes, err))
			}
			return fail(fmt.Errorf("oob: the peer left %d bytes unpulled (%d of them this call's), and %d more would go over Limits.PeerUnpulledBytes (%d), or earlier messages wait for room: %w", sent, unpulled, n, lim.PeerUnpulledBytes, err))
		}
	}
	for _, t := range ts {
		if e := box.entries[t]; e.toward == nil {
			box.bindLocked(t, e, peer, call)
			if prev := e.flow; prev != nil && prev != f {
				// Counted by another call (Track: the same message sent as a
				// client's request too): this call's now.
				prev.bytes.Add(-int64(e.src.Len()))
				prev.wake()
			}
			e.flow, e.waiter = f, nil
			f.bytes.Add(int64(e.src.Len()))
			if e.timer.Stop() { // else it fired: its Withdraw waits for the lock
				e.timer.Reset(e.lease)
			}
		}
	}
	if p := box.toward[peer]; p != nil {
		p.wakeLocked() // the next waiter, if it fits beside this message
	}
	box.wakeTotalLocked()
	box.mu.Unlock()
	// Checked once bound: a CALL-ENDED handled from here on finds them
	// (handleCallEnded notes the call, then withdraws what is bound to it).
	if stateOf(s).space.callEnded(call) {
		for _, t := range ts {
			Withdraw(t)
		}
		return fmt.Errorf("oob: the peer ended call %d before its message was sent", call)
	}
	releaseOrphans(peer)
	return nil
}

// Track counts in f the payloads of ts still in the outbox that no peer is
// known to hold the descriptors of (a client's requests: gRPC picks their
// connection after they are marshaled) until they leave it, for Wait. Held
// payloads (OfferOptions.Held) stay after their pulls and are not counted;
// nor is one counted by a Flow already.
func (f *Flow) Track(ts []Token) {
	box.mu.Lock()
	defer box.mu.Unlock()
	for _, t := range ts {
		if e := box.entries[t]; e != nil && !e.held && e.flow == nil && e.toward == nil {
			e.flow = f
			f.bytes.Add(int64(e.src.Len()))
		}
	}
}

// Over reports whether the payloads f counts that wait in the outbox add up
// to more than Limits.UnpulledBytes (of the engine serving s, or the
// process's when s is nil): whether Wait would wait.
func (f *Flow) Over(s *transport.Session) bool {
	n := f.bytes.Load() // no lock: a stream's every send asks
	return n > 0 && n > cfgOf(s).Limits.UnpulledBytes
}

// Wait returns once the payloads f counts that wait in the outbox for the
// peer's pulls add up to at most Limits.UnpulledBytes (of the engine serving
// s, or the process's when s is nil), or fails when ctx ends, or s or its
// gRPC conn closes, first: a client stream's next message waits here for the server's pulls
// of the earlier ones (Track), as Send holds a server stream's.
func (f *Flow) Wait(ctx context.Context, s *transport.Session) error {
	limit := cfgOf(s).Limits.UnpulledBytes
	var closed, connClosed <-chan struct{} // nil: no session to watch
	if s != nil {
		closed, connClosed = s.Done(), s.ConnClosed()
	}
	box.mu.Lock()
	defer box.mu.Unlock()
	for f.bytes.Load() > limit {
		if f.room == nil {
			f.room = make(chan struct{})
		}
		room, unpulled := f.room, f.bytes.Load()
		box.waiting++
		box.mu.Unlock()
		var err error
		select {
		case <-room:
		case <-ctx.Done():
			err = context.Cause(ctx)
		case <-closed:
			err = errors.New("the session closed")
		case <-connClosed:
			// The session may linger for the peer's pulls, but the call's
			// stream went with the connection: no message of it will go.
			err = errors.New("the session's gRPC connection closed")
		}
		box.mu.Lock()
		box.waiting--
		if err != nil {
			return fmt.Errorf("oob: the peer left %d bytes of this call's earlier payloads unpulled, over Limits.UnpulledBytes (%d): %w", unpulled, limit, err)
		}
	}
	return nil
}

// disown undoes what a failed Send of ts set: their entries not sent are
// no longer f's. box.mu is held.
func (f *Flow) disown(ts []Token) {
	for _, t := range ts {
		if e := box.entries[t]; e != nil && e.waiter == f {
			e.waiter = nil
		}
	}
}

// bindLocked binds e, the entry of t, to peer, the process its descriptor
// went to, for the peer's call (0: none named).
func (b *outbox) bindLocked(t Token, e *outboxEntry, peer transport.ID, call uint64) {
	e.toward, e.call = &peer, call
	p := b.sentTo(peer)
	p.tokens[t] = struct{}{}
	p.bytes += int64(e.src.Len())
	b.sent += int64(e.src.Len())
	if call != 0 {
		if p.calls == nil {
			p.calls = make(map[uint64]map[Token]struct{})
		}
		c := p.calls[call]
		if c == nil {
			c = make(map[Token]struct{})
			p.calls[call] = c
		}
		c[t] = struct{}{}
	}
}

// Unpulled returns the payload bytes this process's outbox holds, sent
// toward peer and not pulled.
func Unpulled(peer transport.ID) int64 {
	box.mu.Lock()
	defer box.mu.Unlock()
	if p := box.toward[peer]; p != nil {
		return p.bytes
	}
	return 0
}

// withdrawCall withdraws what the outbox holds sent toward peer for its
// call id and not pulled: the peer ended the call (CALL-ENDED) and will
// pull none of it.
func withdrawCall(peer transport.ID, id uint64) {
	withdrawSent(peer, func(p *sentEntries) map[Token]struct{} { return p.calls[id] })
}

// withdrawSent withdraws the entries sent toward peer that pick names.
func withdrawSent(peer transport.ID, pick func(*sentEntries) map[Token]struct{}) {
	box.mu.Lock()
	var ts []Token
	if p := box.toward[peer]; p != nil {
		for t := range pick(p) {
			ts = append(ts, t)
		}
	}
	box.mu.Unlock()
	for _, t := range ts {
		Withdraw(t)
	}
}

// releaseOrphans withdraws the entries sent to peer when no live session to
// it remains.
func releaseOrphans(peer transport.ID) {
	if len(liveSessions(peer)) > 0 {
		return
	}
	withdrawSent(peer, func(p *sentEntries) map[Token]struct{} { return p.tokens })
}

// releaseSentTo runs when s closes: the entries sent to its peer go when s
// was the last session to it.
func releaseSentTo(s *transport.Session) { releaseOrphans(s.PeerID()) }

// newToken returns a fresh random token.
func newToken() Token {
	var t Token
	_, _ = rand.Read(t[:]) // never fails (crypto/rand)
	return t
}
