package oob

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/gdrpc/gdrpc/internal/wire"
	"github.com/gdrpc/gdrpc/transport"
)

// A server writes a response's payloads into the client's receive space
// before the response goes; the client gives each range back once it has
// decoded the response and released the buffer. A response the client never
// decodes (its call was cancelled or ran out of time first, or gRPC refused
// the message) leaves ranges nobody gives back. So a client numbers its calls
// (a stream in the gdrpc-call header, CallHeader; the gdr codec puts a unary
// call's number in its request's body, and a unary call whose messages
// cannot carry a payload needs none), notes the writes each call took, and, when a
// call ends without having taken every response, tells the server which
// writes the call still holds (CALL-ENDED): the server takes back the rest
// of what it wrote for that call, and writes nothing more for it (a call
// that holds more than a CALL-ENDED names says so, and the server then
// takes back nothing). Writes
// are named by range and number (Descriptor.SpaceGen), since control
// messages are handled concurrently: a notice about an earlier write into a
// range must not free a later one. The same notice withdraws from the
// server's outbox what it sent for the call and nobody pulled (Flow.Send
// notes the call), so a client sends one, space or none, whenever a
// response of the call may have gone.

// CallHeader is the metadata key that carries a client call's number to the
// server, in hexadecimal.
const CallHeader = "gdrpc-call"

// maxCallTaken bounds the ranges one CALL-ENDED names. A call names only the
// ranges it still holds (those given back need no naming: the owner takes
// them back either way, and a notice about a write it already ended frees
// nothing); a call that holds more (a long stream whose buffers the
// application keeps) sends a CALL-ENDED that names none and says so
// (takenUnknown): the owner then withdraws what it sent for the call and
// writes nothing more for it, but takes back no range, and the ranges the
// call never took stay with the client until the session ends.
const maxCallTaken = 1024

// maxCallNoted bounds the ranges a call notes before it sorts out those it
// gave back (Call.tidy): one that notes more without giving them back
// stops noting, and its CALL-ENDED names none.
const maxCallNoted = 2 * maxCallTaken

// takenUnknown is the count of a CALL-ENDED that names no range because the
// call could not name all it holds.
const takenUnknown = 0xffff

// maxEndedCalls bounds the numbers of ended calls a server remembers per
// session, so that it writes nothing for a call that ended before its
// response was marshaled.
const maxEndedCalls = 1024

// Call is a client call's record: its number, and the ranges of this
// process's receive spaces that its responses' payloads took.
type Call struct {
	ID uint64

	mu sync.Mutex
	// took are the writes the call took, less some it gave back since
	// (tidy): a CALL-ENDED needs only those it still holds.
	took []spaceRange
	// tidyAt is the length of took at which tidy looks for writes given
	// back next: twice what the last look kept, so that a call that keeps
	// what it took is not looked over on every fetch.
	tidyAt int
	// overflow: a range went unnoted (maxCallNoted): the call cannot name
	// all it holds.
	overflow bool
	ended    bool
}

// spaceRange is a write into a receive space: the space, the range's offset
// and the owner's number for the write.
type spaceRange struct{ space, off, gen uint64 }

var callNumbers atomic.Uint64

// NewCall returns the record of a client call about to start. Every call
// that may receive a payload gets one: a call made before the process
// advertised its first space (a stream whose first pull prompts the
// advertisement) may have later responses written into it.
func NewCall() *Call {
	return &Call{ID: callNumbers.Add(1)}
}

type callKey struct{}

// WithCall returns ctx carrying c: the pulls of the call's responses made
// with it (Fetch, FetchNew, FetchFrom) note what they took from receive space.
func WithCall(ctx context.Context, c *Call) context.Context {
	if c == nil {
		return ctx
	}
	return context.WithValue(ctx, callKey{}, c)
}

func callOf(ctx context.Context) *Call {
	c, _ := ctx.Value(callKey{}).(*Call)
	return c
}

// errCallEnded refuses a payload in receive space to a call that ended.
var errCallEnded = errors.New("the call ended before its payload in receive space was taken: the owner takes the range back")

// note records a range of space that a payload of the call takes. It
// reports false once the call ended: its CALL-ENDED, which did not name the
// range, leaves the range to the server (the SPACE-FREE the caller then
// queues makes sure), and the payload must not be handed out (a message
// decoded while the call was cancelled).
func (c *Call) note(r spaceRange) bool {
	if c == nil {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended {
		return false
	}
	if len(c.took) >= maxCallNoted {
		c.overflow = true
		return true
	}
	c.took = append(c.took, r)
	return true
}

// tidy forgets the ranges the call noted and gave back since: where all,
// every one of them; otherwise once it noted more than a CALL-ENDED names
// and twice what the last look kept. It takes no lock of a space while it
// holds c.mu (note runs under a space's lock and takes c.mu), and each
// space's lock once.
func (c *Call) tidy(all bool) {
	if c == nil {
		return
	}
	c.mu.Lock()
	if c.overflow || !all && len(c.took) <= max(maxCallTaken, c.tidyAt) {
		// Within what a CALL-ENDED names, or past naming anything.
		c.mu.Unlock()
		return
	}
	bySpace := map[uint64][]spaceRange{}
	for _, r := range c.took {
		bySpace[r.space] = append(bySpace[r.space], r)
	}
	c.mu.Unlock()
	gone := map[spaceRange]bool{}
	for id, rs := range bySpace {
		givenBack(id, rs, gone)
	}
	c.mu.Lock()
	c.took = slices.DeleteFunc(c.took, func(r spaceRange) bool { return gone[r] })
	// Looked over again once it has twice what it holds, and before note
	// stops noting.
	c.tidyAt = min(maxCallNoted-1, 2*len(c.took))
	c.mu.Unlock()
}

// givenBack adds to gone the writes of rs, into this process's space id,
// that the application no longer holds: given back, they stay so.
func givenBack(id uint64, rs []spaceRange, gone map[spaceRange]bool) {
	v, ok := spaces.Load(id)
	if !ok {
		for _, r := range rs {
			gone[r] = true // the space went with its session
		}
		return
	}
	sp := v.(*space)
	sp.mu.Lock()
	defer sp.mu.Unlock()
	for _, r := range rs {
		if h, ok := sp.inUse[r.off]; !ok || h.gen != r.gen {
			gone[r] = true
		}
	}
}

// Ended tells the server on s that the call ended, maybe without taking every
// response it was sent: the server takes back the ranges it wrote for the
// call that the call does not name (none, where it holds more than a
// CALL-ENDED names), and withdraws from its outbox what it
// sent for the call and nobody pulled. answered says whether a response
// message may have gone (its headers came, or the call gave up while they
// may have been on their way); if not, and no space was advertised over s,
// the server holds nothing for the call and nothing is sent. Only the first Ended of a call counts; it
// returns at once (the message goes on a goroutine).
func (c *Call) Ended(s *transport.Session, answered bool) { c.EndedOver(s, answered, nil) }

// EndedOver is Ended over s (none where nil), and over each of others
// whatever answered says: sessions over which an earlier attempt of the call
// was answered (an application's retry inside the codec's interceptor),
// whose servers may hold what they wrote for a response nothing decoded.
// The same CALL-ENDED goes over each.
func (c *Call) EndedOver(s *transport.Session, answered bool, others []*transport.Session) {
	if s != nil && !answered && !advertisesOver(s) {
		s = nil
	}
	if c == nil || (s == nil && len(others) == 0) {
		return
	}
	msg, first := c.end()
	if !first {
		return
	}
	for _, o := range others {
		stateOf(o).callEnds.add(o, msg)
	}
	if s != nil {
		stateOf(s).callEnds.add(s, msg)
	}
}

// callEnds are the CALL-ENDEDs of a session on their way: one goroutine
// sends them in turn, so that calls that end faster than the peer takes
// them (a server that stops reading its control stream) cost a queue entry
// each, not a goroutine waiting on the control stream. The queue holds at
// most maxCallEndBytes; past it a CALL-ENDED is dropped, and the server
// keeps what it sent for that call until its lease ends, as for a client
// that never says.
type callEnds struct {
	mu      sync.Mutex
	queue   [][]byte
	bytes   int
	sending bool
}

// maxCallEndBytes bounds the CALL-ENDEDs of a session waiting to go.
const maxCallEndBytes = 1 << 20

// add queues msg, a CALL-ENDED, to go over s, and starts the sender unless
// it runs.
func (q *callEnds) add(s *transport.Session, msg []byte) {
	q.mu.Lock()
	if q.bytes+len(msg) > maxCallEndBytes {
		q.mu.Unlock()
		cfgOf(s).Logger.Debug("call end dropped: too many wait to go", "session", s.ID(), "bytes", q.bytes)
		return
	}
	q.queue = append(q.queue, msg)
	q.bytes += len(msg)
	start := !q.sending
	q.sending = true
	q.mu.Unlock()
	if start && !stateOf(s).bounds.spawn(func() { q.send(s) }) {
		q.mu.Lock()
		q.queue, q.bytes, q.sending = nil, 0, false // the session is closing
		q.mu.Unlock()
	}
}

// send sends the queue's CALL-ENDEDs over s until it is empty.
func (q *callEnds) send(s *transport.Session) {
	for {
		q.mu.Lock()
		if len(q.queue) == 0 {
			q.sending = false
			q.mu.Unlock()
			return
		}
		msg := q.queue[0]
		q.queue[0] = nil
		q.queue = q.queue[1:]
		q.bytes -= len(msg)
		q.mu.Unlock()
		ctx, cancel := context.WithTimeout(sessionContext(s), cfgOf(s).Timeout)
		err := sendControl(ctx, s, ctlCallEnded, msg)
		cancel()
		if err != nil {
			cfgOf(s).Logger.Debug("call end not sent", "session", s.ID(), "err", err)
		}
	}
}

// end marks the call ended and returns its CALL-ENDED, or false if it ended
// before.
func (c *Call) end() ([]byte, bool) {
	c.tidy(true) // it names no more than it holds
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended {
		return nil, false
	}
	// From here on the call takes nothing (note). One that holds more than
	// a CALL-ENDED names says so instead.
	c.ended = true
	return callEnded(c.ID, c.took, c.overflow || len(c.took) > maxCallTaken), true
}

// AdvertisesOver reports whether this process advertised a receive space
// over s: a response that came over s may have written into it.
func AdvertisesOver(s *transport.Session) bool { return s != nil && advertisesOver(s) }

// advertisesOver reports whether this process advertised a space over s.
func advertisesOver(s *transport.Session) bool {
	a := stateOf(s)
	a.space.mu.Lock()
	defer a.space.mu.Unlock()
	return len(a.space.own) > 0
}

// callEnded is a CALL-ENDED: version, the call's number, and the writes it
// took (space id, offset and write number each), or, where unknown, the
// count takenUnknown and none.
func callEnded(id uint64, took []spaceRange, unknown bool) []byte {
	b := make([]byte, 0, 1+8+2+24*len(took))
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint64(b, id)
	if unknown {
		return binary.BigEndian.AppendUint16(b, takenUnknown)
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(took)))
	for _, r := range took {
		b = binary.BigEndian.AppendUint64(b, r.space)
		b = binary.BigEndian.AppendUint64(b, r.off)
		b = binary.BigEndian.AppendUint64(b, r.gen)
	}
	return b
}

// parseCallEnded returns a CALL-ENDED's call and the writes it took, or
// unknown where the call could not name them.
func parseCallEnded(b []byte) (id uint64, took map[spaceRange]bool, unknown bool, err error) {
	r := &wire.Reader{B: b}
	if v := r.U8("version"); r.Err == nil && v != wireVersion {
		return 0, nil, false, fmt.Errorf("malformed CALL-ENDED: version %d", v)
	}
	id = r.U64("call")
	n := int(r.U16("count"))
	if r.Err == nil && id == 0 {
		return 0, nil, false, errors.New("malformed CALL-ENDED: call 0")
	}
	if n == takenUnknown {
		if err := r.Finish("CALL-ENDED"); err != nil {
			return 0, nil, false, err
		}
		return id, nil, true, nil
	}
	if r.Err == nil && n > maxCallTaken {
		return 0, nil, false, fmt.Errorf("malformed CALL-ENDED: call %d, %d ranges (at most %d)", id, n, maxCallTaken)
	}
	took = make(map[spaceRange]bool, n)
	for range n {
		took[spaceRange{r.U64("space"), r.U64("offset"), r.U64("write")}] = true
	}
	if err := r.Finish("CALL-ENDED"); err != nil {
		return 0, nil, false, err
	}
	return id, took, false, nil
}

// handleCallEnded takes back what this side wrote into the peer's spaces for
// a call that ended, except the ranges the call took (nothing, where the
// call could not name them), withdraws what it sent for the call and nobody
// pulled, and remembers the call so that nothing more is written for it.
func handleCallEnded(s *transport.Session, payload []byte) {
	a := stateOf(s) // once: the session may close meanwhile
	if a == closedState {
		return // a closed session's: it has no spaces, and its state is shared
	}
	id, took, unknown, err := parseCallEnded(payload)
	if err != nil {
		dropControl(s, err)
		return
	}
	st := &a.space
	st.mu.Lock()
	st.ended.add(id)
	st.mu.Unlock()
	if !unknown { // a call that could not name what it holds leaves every range: none is safe to take
		for _, ps := range peerSpacesOf(s) {
			ps.reclaimCall(id, took)
		}
	}
	withdrawCall(s.PeerID(), id)
}

// callEnded reports whether the peer ended call id (st.mu not held).
func (st *spaceState) callEnded(id uint64) bool {
	if id == 0 {
		return false
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.ended.has(id)
}

// endedCalls is a bounded set of call numbers, the oldest forgotten first.
type endedCalls struct {
	set   map[uint64]struct{}
	order []uint64
}

func (e *endedCalls) add(id uint64) {
	if _, ok := e.set[id]; ok {
		return
	}
	if e.set == nil {
		e.set = map[uint64]struct{}{}
	}
	if len(e.order) == maxEndedCalls {
		delete(e.set, e.order[0])
		e.order = e.order[1:]
	}
	e.set[id] = struct{}{}
	e.order = append(e.order, id)
}

func (e *endedCalls) has(id uint64) bool {
	_, ok := e.set[id]
	return ok
}
