package oob

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/gdrpc/gdrpc/internal/wire"
	"github.com/gdrpc/gdrpc/transport"
)

// A client writes a request's payloads into the server's receive space
// (OfferRequest) before the request goes; the server gives each range back
// once its handler released the buffer. A request the server never took (the
// call failed first, gRPC sent it to another server, the server's request
// type has no such field) leaves ranges only the server can free, since only
// it knows what it took. So, once a call is over, the client names its writes
// (WRITES-ENDED): the server gives back those it never took, and remembers
// each as given back, so that a copy of the request still on its way is
// refused and pulled by token instead.

// WritesEnded tells the owner of the space that ds (descriptors OfferRequest
// returned for messages over s) name that the call they were written for is
// over: the owner gives back the ranges it never took. Descriptors that name
// no space, or a range given back already, are skipped; a long stream's go in
// several messages. It returns at once (they go on a goroutine).
func WritesEnded(s *transport.Session, ds []Descriptor) {
	if s == nil {
		return
	}
	var msgs [][]byte
	for chunk := range slices.Chunk(Outstanding(s, ds), maxCallTaken) {
		ws := make([]spaceWrite, 0, len(chunk))
		for _, d := range chunk {
			ws = append(ws, spaceWrite{spaceRange{d.Space, d.SpaceOffset, d.SpaceGen}, d.Length})
		}
		msgs = append(msgs, writesEnded(ws))
	}
	if len(msgs) == 0 {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(sessionContext(s), cfgOf(s).Timeout)
		defer cancel()
		for _, msg := range msgs {
			if err := sendControl(ctx, s, ctlWritesEnded, msg); err != nil {
				cfgOf(s).Logger.Debug("writes' end not sent", "session", s.ID(), "err", err)
				return
			}
		}
	}()
}

// Outstanding returns those of ds (descriptors OfferRequest returned for
// messages over s) whose writes the owner has not given back yet.
func Outstanding(s *transport.Session, ds []Descriptor) []Descriptor {
	byID := map[uint64]*peerSpace{}
	for _, ps := range peerSpacesOf(s) {
		byID[ps.id] = ps
	}
	var out []Descriptor
	for _, d := range ds {
		if ps := byID[d.Space]; ps != nil && ps.written(d.SpaceOffset, d.SpaceGen) {
			out = append(out, d)
		}
	}
	return out
}

// written reports whether write gen is in the range at off, its write over.
func (p *peerSpace) written(off, gen uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	w, ok := p.taken[off]
	return ok && w.gen == gen && !w.writing
}

// spaceWrite is a write into a receive space and its length.
type spaceWrite struct {
	spaceRange
	n uint64
}

// writesEnded is a WRITES-ENDED: version, a count, and the writes (space id,
// offset, length and write number each).
func writesEnded(ws []spaceWrite) []byte {
	b := make([]byte, 0, 1+2+32*len(ws))
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint16(b, uint16(len(ws)))
	for _, w := range ws {
		b = binary.BigEndian.AppendUint64(b, w.space)
		b = binary.BigEndian.AppendUint64(b, w.off)
		b = binary.BigEndian.AppendUint64(b, w.n)
		b = binary.BigEndian.AppendUint64(b, w.gen)
	}
	return b
}

func parseWritesEnded(b []byte) ([]spaceWrite, error) {
	r := &wire.Reader{B: b}
	if v := r.U8("version"); r.Err == nil && v != wireVersion {
		return nil, fmt.Errorf("malformed WRITES-ENDED: version %d", v)
	}
	n := int(r.U16("count"))
	if r.Err == nil && n > maxCallTaken {
		return nil, fmt.Errorf("malformed WRITES-ENDED: %d writes (at most %d)", n, maxCallTaken)
	}
	ws := make([]spaceWrite, 0, n)
	for range n {
		id, off, length, gen := r.U64("space"), r.U64("offset"), r.U64("length"), r.U64("write")
		if r.Err == nil && (id == 0 || gen == 0 || length == 0) {
			return nil, fmt.Errorf("malformed WRITES-ENDED: space %#x, write %d of %d bytes", id, gen, length)
		}
		ws = append(ws, spaceWrite{spaceRange{id, off, gen}, length})
	}
	return ws, r.Finish("WRITES-ENDED")
}

// handleWritesEnded gives back the writes a peer names, into spaces this side
// advertised over s, that this side never took.
func handleWritesEnded(s *transport.Session, payload []byte) {
	ws, err := parseWritesEnded(payload)
	if err != nil {
		dropControl(s, err)
		return
	}
	a := stateOf(s)
	for _, w := range ws {
		if sp := ownSpaceByID(a, w.space); sp != nil {
			sp.endUntaken(w)
		}
	}
}

// endUntaken gives back write w unless it was taken (held now, or given back
// already) or does not fit the space; a later descriptor naming it is stale.
// It costs the same whatever the space holds: a peer's message of 1,024
// writes is 1,024 lookups.
func (sp *space) endUntaken(w spaceWrite) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	size := uint64(sp.region.Len())
	if w.off%spaceAlign != 0 || w.off >= size || w.n > size-w.off || sp.staleLocked(w.off, w.gen) {
		return
	}
	if _, held := sp.inUse[w.off]; held {
		// Taken: its release gives it back. The writer's ranges do not
		// overlap while written, so a held range that overlaps w from
		// another offset is a peer's mistake, and freeing w costs this
		// side nothing.
		return
	}
	sp.queueFreeLocked(heldRange{w.off, w.n, w.gen})
}
