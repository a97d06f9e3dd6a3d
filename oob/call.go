package oob

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
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
// (the gdrpc-call header, CallHeader), notes the writes each call took, and,
// when a call ends without having taken every response, tells the server
// which writes the call did take (CALL-ENDED): the server takes back the rest
// of what it wrote for that call, and writes nothing more for it. Writes
// are named by range and number (Descriptor.SpaceGen), since control
// messages are handled concurrently: a notice about an earlier write into a
// range must not free a later one. The same notice withdraws from the
// server's outbox what it sent for the call and nobody pulled (Flow.Send
// notes the call), so a client sends one, space or none, whenever a
// response of the call may have gone.

// CallHeader is the metadata key that carries a client call's number to the
// server, in hexadecimal.
const CallHeader = "gdrpc-call"

// maxCallTaken bounds the ranges one CALL-ENDED names: a call that took more
// (a long stream whose buffers the application still holds) sends none, and
// what it left behind stays with the server until the session ends (in its
// outbox, until their lease ends at the latest).
const maxCallTaken = 1024

// maxEndedCalls bounds the numbers of ended calls a server remembers per
// session, so that it writes nothing for a call that ended before its
// response was marshaled.
const maxEndedCalls = 1024

// Call is a client call's record: its number, and the ranges of this
// process's receive spaces that its responses' payloads took.
type Call struct {
	ID uint64

	mu       sync.Mutex
	took     []spaceRange
	overflow bool
	ended    bool
}

// spaceRange is a write into a receive space: the space, the range's offset
// and the owner's number for the write.
type spaceRange struct{ space, off, gen uint64 }

var callNumbers atomic.Uint64

// NewCall returns the record of a client call about to start. Every call
// gets one: a call made before the process advertised its first space (a
// stream whose first pull prompts the advertisement) may have later
// responses written into it.
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
// range, gives the range back to the server, and the payload must not be
// handed out (a message decoded while the call was cancelled).
func (c *Call) note(r spaceRange) bool {
	if c == nil {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended {
		return false
	}
	if len(c.took) >= maxCallTaken {
		c.overflow = true
		return true
	}
	c.took = append(c.took, r)
	return true
}

// Ended tells the server on s that the call ended, maybe without taking every
// response it was sent: the server takes back the ranges it wrote for the
// call that the call did not take, and withdraws from its outbox what it
// sent for the call and nobody pulled. answered says whether a response
// message may have gone (its headers came, or the call gave up while they
// may have been on their way); if not, and no space was advertised over s,
// the server holds nothing for the call and nothing is sent. Only the first Ended of a call counts; it
// returns at once (the message goes on a goroutine).
func (c *Call) Ended(s *transport.Session, answered bool) {
	if c == nil || s == nil || (!answered && !advertisesOver(s)) {
		return
	}
	c.mu.Lock()
	if c.ended || c.overflow {
		c.mu.Unlock()
		return
	}
	c.ended = true // from here on the call takes nothing (note)
	msg := callEnded(c.ID, c.took)
	c.mu.Unlock()
	go func() {
		ctx, cancel := context.WithTimeout(sessionContext(s), cfgOf(s).Timeout)
		defer cancel()
		if err := sendControl(ctx, s, ctlCallEnded, msg); err != nil {
			cfgOf(s).Logger.Debug("call end not sent", "session", s.ID(), "call", c.ID, "err", err)
		}
	}()
}

// advertisesOver reports whether this process advertised a space over s.
func advertisesOver(s *transport.Session) bool {
	a := stateOf(s)
	a.space.mu.Lock()
	defer a.space.mu.Unlock()
	return len(a.space.own) > 0
}

// callEnded is a CALL-ENDED: version, the call's number, and the writes it
// took (space id, offset and write number each).
func callEnded(id uint64, took []spaceRange) []byte {
	b := make([]byte, 0, 1+8+2+24*len(took))
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint64(b, id)
	b = binary.BigEndian.AppendUint16(b, uint16(len(took)))
	for _, r := range took {
		b = binary.BigEndian.AppendUint64(b, r.space)
		b = binary.BigEndian.AppendUint64(b, r.off)
		b = binary.BigEndian.AppendUint64(b, r.gen)
	}
	return b
}

func parseCallEnded(b []byte) (id uint64, took map[spaceRange]bool, err error) {
	r := &wire.Reader{B: b}
	if v := r.U8("version"); r.Err == nil && v != wireVersion {
		return 0, nil, fmt.Errorf("malformed CALL-ENDED: version %d", v)
	}
	id = r.U64("call")
	n := int(r.U16("count"))
	if r.Err == nil && (n > maxCallTaken || id == 0) {
		return 0, nil, fmt.Errorf("malformed CALL-ENDED: call %d, %d ranges (at most %d)", id, n, maxCallTaken)
	}
	took = make(map[spaceRange]bool, n)
	for range n {
		took[spaceRange{r.U64("space"), r.U64("offset"), r.U64("write")}] = true
	}
	return id, took, r.Finish("CALL-ENDED")
}

// handleCallEnded takes back what this side wrote into the peer's spaces for
// a call that ended, except the ranges the call took, and remembers the call
// so that nothing more is written for it.
func handleCallEnded(s *transport.Session, payload []byte) {
	a := stateOf(s) // once: the session may close meanwhile
	if a == closedState {
		return // a closed session's: it has no spaces, and its state is shared
	}
	id, took, err := parseCallEnded(payload)
	if err != nil {
		cfgOf(s).Logger.Warn("dropping control message", "session", s.ID(), "err", err)
		return
	}
	st := &a.space
	st.mu.Lock()
	st.ended.add(id)
	st.mu.Unlock()
	for _, ps := range peerSpacesOf(s) {
		ps.reclaimCall(id, took)
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
