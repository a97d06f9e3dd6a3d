package oob

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/sessionleak"
	"github.com/gdrpc/gdrpc/transport"
)

// FuzzControlSequence drives sequences of control messages, well-formed and
// not, from a hostile peer into a live session whose other end (the victim)
// holds real state: payloads in its outbox (held or not, bound toward the
// peer or to a call of its), pulls waiting for the peer's FIN and, with
// trusted peers, a receive space it advertised with a range the application
// holds, and the peer's own receive space with writes of the victim's in it
// (one still under way while the messages come). The messages name what the
// victim handed out (request ids, tokens and lengths, space ids, offsets
// and write numbers, call numbers) as often as made-up values, so that they
// reach the engine's tables, not only its parsers.
//
// Each run checks that the victim
//   - keeps its bookkeeping whole: the free and written ranges of the peer's
//     space tile it, and a range the application holds stays held;
//   - stays responsive: an RTR after the sequence is answered, unless the
//     session ended;
//   - never loses a payload to a message that does not name it: held
//     entries no call owns stay in the outbox while the session lives;
//   - ends every pull and closes the session within bounded waits;
//   - leaves nothing behind once the session closed: the entries sent toward
//     the peer left the outbox, and (once the test withdrew its own and the
//     application released what it held) no entry, pull, space, range,
//     session or goroutine of the engine, the sessions, yamux or gRPC.
//
// Input: a flags byte (fuzzTrusted, fuzzVictimClient, fuzzCloseFirst), then
// messages: a kind byte (fuzzKinds; at or above len(fuzzKinds), a raw
// message of the type the next byte names), a form byte (fuzzForm*; its
// bits 3 to 5 repeat the message 1, 2, 4, ... 128 times: storms) and the
// fields its builder reads (see buildControl); past the input's end every
// field reads 0.
func FuzzControlSequence(f *testing.F) {
	for _, seed := range controlSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		runControlSequence(t, data)
	})
}

// Flags of an input's first byte.
const (
	fuzzTrusted      = 1 << 0 // both sides trust each other: receive spaces both ways
	fuzzVictimClient = 1 << 1 // the victim dialed; otherwise the hostile peer did
	fuzzCloseFirst   = 1 << 2 // the sessions close before the victim's pulls are given up
)

// Forms of a message (a form byte's low 3 bits).
const (
	fuzzFormBuilt    = 0 // as its builder makes it (1 to 3 too)
	fuzzFormCut      = 4 // built, then cut short by the next byte (modulo its length)
	fuzzFormTrailing = 5 // built, then the next byte's count of input bytes appended
	fuzzFormRaw      = 6 // a length byte and that many input bytes
	fuzzFormEmpty    = 7 // no payload
)

// fuzzKinds are the control types a kind byte names, in this order.
var fuzzKinds = []byte{ctlRTR, ctlFIN, ctlChunk, ctlSpace, ctlSpaceFree, ctlSpaceWithdraw,
	ctlSpaceWithdrawn, ctlCallEnded, ctlWritesEnded, ctlHold, ctlRelease}

// Bounds of one run: messages sent in all, and how long any one wait of the
// test may take before the victim is taken to be stuck.
const (
	fuzzMaxMessages = 512
	fuzzBound       = 10 * time.Second
)

// The id and size of the space the hostile peer advertised to the victim,
// and the size of the victim's own.
const (
	fuzzPeerSpaceID  = 0x5ace
	fuzzPeerSpaceLen = 64 << 10
	fuzzOwnSpaceLen  = 64 << 10
)

// fuzzBytes reads an input's fields; past its end every read gives zeros.
type fuzzBytes struct{ b []byte }

func (r *fuzzBytes) more() bool { return len(r.b) > 0 }

func (r *fuzzBytes) u8() byte {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *fuzzBytes) take(n int) []byte {
	n = min(n, len(r.b))
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *fuzzBytes) u64() uint64 {
	var b [8]byte
	copy(b[:], r.take(8))
	return binary.BigEndian.Uint64(b[:])
}

// fuzzWrite is a write into a receive space that the victim knows of: the
// space, the range and the write's number, and the call it was for.
type fuzzWrite struct {
	space, off, n, gen, call uint64
}

// controlRig is one run's victim, its hostile peer, and what the victim
// handed out.
type controlRig struct {
	t               *testing.T
	listener        *transport.Listener
	victim, hostile *transport.Session

	offers []Descriptor // the victim's outbox entries
	held   []bool       // offers[i] is held
	bound  []bool       // offers[i] went toward the peer (SentToward, Flow.Send)
	calls  []uint64     // the peer's calls the victim knows of

	rtrs     chan *rtr // the victim's RTRs, as the peer gets them
	pullReqs []uint64  // their request ids
	pulls    []chan error
	cancel   context.CancelFunc // gives the victim's pulls up

	// Trusted runs: the victim's own space and the range of it the
	// application holds, and the writes into the peer's space (the last
	// one under way until endWrite).
	own        *space
	landed     []fuzzWrite
	holding    *devicebuf.Buffer
	peerSpace  *peerSpace
	peerWrites []fuzzWrite
	writing    *fuzzWrite

	sentReqs []uint64 // request ids of the peer's RTRs
	pingReq  uint64
	fins     chan uint64 // request ids of the FINs the peer got
}

func runControlSequence(t *testing.T, data []byte) {
	requireQuiet(t, "before the run")
	r := &fuzzBytes{b: data}
	flags := r.u8()
	rig := newControlRig(t, flags)
	rig.send(r, len(data))
	rig.finish(flags)
}

// requireQuiet waits, bounded, until the engine holds nothing and no
// goroutine of it, the sessions, yamux or gRPC is left.
func requireQuiet(t *testing.T, when string) {
	t.Helper()
	if err := leaktest.Poll(fuzzBound, quiet); err != nil {
		t.Fatalf("%s: %v", when, err)
	}
}

func quiet() error {
	if st := ReadStats(); st != (Stats{}) {
		return fmt.Errorf("the engine holds %+v", st)
	}
	if n := transport.ReadStats().Sessions; n != 0 {
		return fmt.Errorf("%d sessions registered", n)
	}
	left := append(leaktest.Goroutines("gdrpc/gdrpc/oob."), sessionleak.Goroutines()...)
	left = slices.DeleteFunc(left, func(g string) bool {
		// The test's own: the fuzz target's and the test main's.
		return strings.Contains(g, "oob.FuzzControlSequence") || strings.Contains(g, "oob.TestMain")
	})
	if len(left) > 0 {
		return fmt.Errorf("%d goroutines alive:\n%s", len(left), strings.Join(left, "\n\n"))
	}
	return nil
}

func newControlRig(t *testing.T, flags byte) *controlRig {
	t.Helper()
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	if flags&fuzzTrusted != 0 {
		opts = append(opts, transport.WithTrustPeers(true))
	}
	l, cs, ss, _, _ := lanePair(t, opts, opts)
	rig := &controlRig{t: t, listener: l, victim: ss, hostile: cs, rtrs: make(chan *rtr, 16), fins: make(chan uint64, fuzzMaxMessages+16), pingReq: 1<<62 | uint64(time.Now().UnixNano())>>2}
	if flags&fuzzVictimClient != 0 {
		rig.victim, rig.hostile = cs, ss
	}
	intercept(t, ctlRTR, rig.hostile, func(payload []byte) {
		if m, err := parseRTR(payload); err == nil {
			select {
			case rig.rtrs <- m:
			default:
			}
		}
	})
	intercept(t, ctlFIN, rig.hostile, func(payload []byte) {
		if f, err := parseFIN(payload); err == nil {
			select {
			case rig.fins <- f.Req:
			default:
			}
		}
	})
	if rig.victim.IsClient() {
		Receiving(rig.victim) // a call of the victim's is open
	}
	rig.offer()
	rig.pull()
	if flags&fuzzTrusted != 0 {
		rig.spaces()
	}
	return rig
}

// offer puts payloads in the victim's outbox: held or not, sent toward the
// peer or not, for a call of the peer's or not.
func (rig *controlRig) offer() {
	t := rig.t
	add := func(n int, held bool) Descriptor {
		d := Offer(Source{Bytes: make([]byte, n)}, OfferOptions{Held: held})
		rig.offers = append(rig.offers, d)
		rig.held = append(rig.held, held)
		rig.bound = append(rig.bound, false)
		return d
	}
	add(100, true)    // 0: held, never sent toward the peer
	add(5000, false)  // 1: leaves after its first pull
	add(0, true)      // 2: empty
	add(70<<10, true) // 3: sent toward the peer (SentToward)
	add(4096, true)   // 4: sent for the peer's call 7 (Flow.Send)
	add(3, false)     // 5: sent for the peer's call 7 too
	add(1<<20, true)  // 6: sent for the peer's call 8
	SentToward(rig.victim, []Token{rig.offers[3].Token})
	rig.bound[3] = true
	ctx, cancel := context.WithTimeout(context.Background(), fuzzBound)
	defer cancel()
	var flow7, flow8 Flow
	if err := flow7.Send(ctx, rig.victim, 7, []Token{rig.offers[4].Token, rig.offers[5].Token}); err != nil {
		t.Fatalf("send toward call 7: %v", err)
	}
	if err := flow8.Send(ctx, rig.victim, 8, []Token{rig.offers[6].Token}); err != nil {
		t.Fatalf("send toward call 8: %v", err)
	}
	rig.bound[4], rig.bound[5], rig.bound[6] = true, true, true
	rig.calls = append(rig.calls, 7, 8)
}

// pull starts two pulls of the victim's from the peer, which never answers
// them on its own, and waits for their RTRs.
func (rig *controlRig) pull() {
	t := rig.t
	ctx, cancel := context.WithCancel(context.Background())
	rig.cancel = cancel
	owner := rig.victim.PeerID()
	for i, n := range []int{64, 5000} {
		d := Descriptor{Owner: owner, Token: newToken(), Length: uint64(n), Kind: devicebuf.Host, Device: -1}
		done := make(chan error, 1)
		rig.pulls = append(rig.pulls, done)
		if i == 0 {
			go func() {
				_, err := FetchBytes(ctx, d, make([]byte, n))
				done <- err
			}()
			continue
		}
		go func() {
			b, _, err := FetchNew(ctx, d, func(n int) (*devicebuf.Buffer, error) { return devicebuf.HostFromBytes(make([]byte, n)), nil })
			if err == nil {
				_ = b.Release()
			}
			done <- err
		}()
	}
	timer := time.NewTimer(fuzzBound)
	defer timer.Stop()
	for range rig.pulls {
		select {
		case m := <-rig.rtrs:
			rig.pullReqs = append(rig.pullReqs, m.Req)
		case <-timer.C:
			t.Fatal("the victim's RTRs did not come")
		}
	}
}

// spaces sets up receive space both ways over a trusted session: the
// victim's own, as it advertises one after a pull (made of Go memory here:
// a TCP session has no UCX context to register it with), with a range the
// application holds and one it gave back; and the peer's, which the victim
// took, with writes of the victim's for the peer's calls 7 and 8, and one of
// no call, still under way.
func (rig *controlRig) spaces() {
	t := rig.t
	v := rig.victim
	c := cfgOf(v)
	if !reserveSpace(fuzzOwnSpaceLen, c.Limits.SpaceBytes) {
		t.Fatal("no room for the victim's space")
	}
	sp := makeSpace(newSpaceID(), v, devicebuf.HostFromBytes(make([]byte, fuzzOwnSpaceLen)), PathRDMA)
	liveSpaces.Lock()
	liveSpaces.m[sp] = struct{}{}
	liveSpaces.Unlock()
	st := &stateOf(v).space
	st.mu.Lock()
	st.own = append(st.own, sp)
	spaces.Store(sp.id, sp)
	st.mu.Unlock()
	rig.own = sp
	m := &spaceMsg{rtr: rtr{Req: sp.id, Length: fuzzOwnSpaceLen, Offers: PathRDMA, RAddr: 4096, RKey: []byte{1}}}
	ctx, cancel := context.WithTimeout(context.Background(), fuzzBound)
	defer cancel()
	if err := sendControl(ctx, v, ctlSpace, m.marshal()); err != nil {
		t.Fatalf("advertise the victim's space: %v", err)
	}
	// The peer wrote two payloads there; the application took both and
	// holds the first.
	call := NewCall()
	for i, w := range []fuzzWrite{{space: sp.id, off: 0, n: 4096, gen: 1}, {space: sp.id, off: 8192, n: 8192, gen: 2}} {
		d := Descriptor{Owner: v.PeerID(), Token: newToken(), Length: w.n, Kind: devicebuf.Host, Device: -1,
			Space: w.space, SpaceOffset: w.off, SpacePath: PathRDMA, SpaceGen: w.gen}
		b, _, err := fetchLanded(ctx, d, call)
		if err != nil {
			t.Fatalf("take a payload from the victim's space: %v", err)
		}
		rig.landed = append(rig.landed, w)
		if i == 0 {
			rig.holding = b
		} else {
			_ = b.Release()
		}
	}

	pm := &spaceMsg{rtr: rtr{Req: fuzzPeerSpaceID, Length: fuzzPeerSpaceLen, Offers: PathRDMA, RAddr: 1 << 20, RKey: []byte{2, 3}}}
	handleSpace(v, pm.marshal())
	ps := peerSpaceByID(v, fuzzPeerSpaceID)
	if ps == nil {
		t.Fatal("the victim did not take the peer's space")
	}
	rig.peerSpace = ps
	for i, w := range []struct{ n, call uint64 }{{4096, 7}, {8192, 8}, {4096, 7}, {12288, 0}} {
		off, gen, ok := ps.take(w.n, w.call)
		if !ok {
			t.Fatal("no room in the peer's space")
		}
		fw := fuzzWrite{space: ps.id, off: off, n: w.n, gen: gen, call: w.call}
		rig.peerWrites = append(rig.peerWrites, fw)
		if i == 3 {
			rig.writing = &rig.peerWrites[3]
			continue
		}
		ps.endWrite(off, gen, true)
		ps.writers.Done()
	}
}

// endWrite ends the victim's write into the peer's space still under way.
func (rig *controlRig) endWrite() {
	if w := rig.writing; w != nil {
		rig.writing = nil
		rig.peerSpace.endWrite(w.off, w.gen, true)
		rig.peerSpace.writers.Done()
	}
}

// send sends the messages of r from the hostile peer. Sends that find the
// control stream blocked give up after a while: a victim handling what
// waits for its own write (a SPACE-WITHDRAW) may rightly stop reading.
func (rig *controlRig) send(r *fuzzBytes, size int) {
	sent := 0
	half := size / 2
	for r.more() && sent < fuzzMaxMessages {
		if rig.writing != nil && len(r.b) <= half {
			rig.endWrite() // halfway through
		}
		typ, payload, repeat := rig.buildControl(r)
		for range repeat {
			if sent == fuzzMaxMessages {
				break
			}
			sent++
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			err := sendControl(ctx, rig.hostile, typ, payload)
			cancel()
			if err != nil {
				rig.endWrite()
				return
			}
		}
	}
	rig.endWrite()
}

// buildControl reads one message from r: its type, payload and how many
// times it goes.
func (rig *controlRig) buildControl(r *fuzzBytes) (typ byte, payload []byte, repeat int) {
	kind, form := r.u8(), r.u8()
	repeat = 1 << (form >> 3 & 7)
	if int(kind) >= len(fuzzKinds) {
		typ = r.u8()
	} else {
		typ = fuzzKinds[kind]
	}
	switch form & 7 {
	case fuzzFormRaw:
		return typ, slices.Clone(r.take(int(r.u8()))), repeat
	case fuzzFormEmpty:
		return typ, nil, repeat
	}
	payload = rig.build(typ, r)
	switch form & 7 {
	case fuzzFormCut:
		if len(payload) > 0 {
			payload = payload[:int(r.u8())%len(payload)]
		}
	case fuzzFormTrailing:
		payload = append(payload, r.take(int(r.u8()))...)
	}
	return typ, payload, repeat
}

// build makes a message of type typ from the fields r gives. Fields:
//
//	RTR:             req, token, length, paths [, key length]
//	FIN:             req, status, path, text length
//	CHUNK:           req, offset, length (4 KiB units)
//	SPACE:           space, length, paths, events
//	SPACE-FREE:      write, length, write number
//	SPACE-WITHDRAW:  space
//	SPACE-WITHDRAWN: space
//	CALL-ENDED:      call, count (0xff: unknown), write ...
//	WRITES-ENDED:    count, write ...
//	HOLD, RELEASE:   sequence
//
// Any other type gets a length byte and that many input bytes.
func (rig *controlRig) build(typ byte, r *fuzzBytes) []byte {
	switch typ {
	case ctlRTR:
		m := &rtr{Req: rig.req(r)}
		tsel := r.u8()
		m.Token = rig.token(tsel, r)
		m.Length = rig.length(tsel, r)
		m.Offers = Path(r.u8()) & (PathCUDAIPC | PathRDMA | PathStream | PathStaged)
		if m.Offers&PathRDMA != 0 {
			m.RAddr, m.RKey = 1<<20, make([]byte, int(r.u8())*16)
		}
		if m.Offers&PathCUDAIPC != 0 {
			m.IPCDevice = "GPU-fuzz"
		}
		rig.sentReqs = append(rig.sentReqs, m.Req)
		return m.marshal()
	case ctlFIN:
		f := &fin{Req: rig.req(r), Status: finStatus(r.u8() % 8), Path: Path(r.u8())}
		f.Msg = strings.Repeat("x", int(r.u8())*8)
		b := f.marshal()
		if f.Status > finBusy { // marshal writes any status; parse refuses it
			b[10] = byte(f.Status)
		}
		return b
	case ctlChunk:
		return rangeNotice(rig.req(r), uint64(r.u8())*4096, uint64(r.u8())*4096)
	case ctlSpace:
		m := &spaceMsg{rtr: rtr{Req: rig.spaceID(r), Length: uint64(r.u8()) * 4096}}
		m.Offers = Path(r.u8()) & (PathCUDAIPC | PathRDMA | PathStream | PathStaged)
		if m.Offers&PathRDMA != 0 {
			m.RAddr, m.RKey = 1<<20, []byte{4, 5, 6}
		}
		if m.Offers&PathCUDAIPC != 0 {
			m.IPCDevice = "GPU-fuzz"
		}
		for range r.u8() % (maxSpaceEvents + 2) {
			m.Events = append(m.Events, devicebuf.IPCEventHandle{})
		}
		return m.marshal()
	case ctlSpaceFree:
		w := rig.write(r)
		n := w.n
		if l := r.u8(); l != 0 {
			n = uint64(l) * 1024
		}
		gen := w.gen
		if g := r.u8(); g != 0 {
			gen = uint64(g - 1) // 0: any write
		}
		return freeNotice(w.space, w.off, n, gen)
	case ctlSpaceWithdraw, ctlSpaceWithdrawn:
		return rangeNotice(rig.spaceID(r), 0, 0)
	case ctlCallEnded:
		id := rig.call(r)
		count := r.u8()
		if count == 0xff {
			return callEnded(id, nil, true)
		}
		var took []spaceRange
		for range fuzzCount(count) {
			w := rig.write(r)
			took = append(took, spaceRange{w.space, w.off, w.gen})
		}
		return callEnded(id, took, false)
	case ctlWritesEnded:
		count := r.u8()
		var ws []spaceWrite
		for range fuzzCount(count) {
			w := rig.write(r)
			ws = append(ws, spaceWrite{spaceRange{w.space, w.off, w.gen}, w.n})
		}
		return writesEnded(ws)
	case ctlHold, ctlRelease:
		sel := r.u8()
		switch sel % 4 {
		case 0, 1:
			return lingerMsg(uint64(sel >> 2))
		case 2:
			return lingerMsg(1<<63 | uint64(sel))
		}
		return lingerMsg(r.u64() &^ (1 << 63))
	}
	return slices.Clone(r.take(int(r.u8())))
}

// fuzzCount is the count of ranges a count byte asks for: itself below
// 0xf0, and from 0xf0 on up to the bound of one message and past it.
func fuzzCount(b byte) int {
	if b < 0xf0 {
		return int(b)
	}
	return maxCallTaken + int(b) - 0xf8
}

// req picks a request id: a pull of the victim's, one of the peer's RTRs,
// a small number, or any.
func (rig *controlRig) req(r *fuzzBytes) uint64 {
	sel := r.u8()
	i := int(sel >> 2)
	switch sel % 4 {
	case 0:
		return rig.pullReqs[i%len(rig.pullReqs)]
	case 1:
		if len(rig.sentReqs) > 0 {
			return rig.sentReqs[i%len(rig.sentReqs)]
		}
		return uint64(i)
	case 2:
		return uint64(i)
	}
	return r.u64()
}

// token picks a token by sel: an offer's, a pull's of the victim (not the
// victim's to serve), a made-up one, or none.
func (rig *controlRig) token(sel byte, r *fuzzBytes) Token {
	i := int(sel >> 2)
	switch sel % 4 {
	case 0, 1:
		return rig.offers[i%len(rig.offers)].Token
	case 2:
		var t Token
		copy(t[:], r.take(len(t)))
		return t
	}
	return Token{}
}

// length picks a length for the token sel picked: its payload's, one off,
// none, or any.
func (rig *controlRig) length(sel byte, r *fuzzBytes) uint64 {
	n := uint64(0)
	if sel%4 < 2 {
		n = rig.offers[int(sel>>2)%len(rig.offers)].Length
	}
	switch r.u8() % 4 {
	case 0, 1:
		return n
	case 2:
		return n + 1
	}
	return r.u64() >> (r.u8() % 64)
}

// spaceID picks a space id: the peer's space the victim took, the victim's
// own, a small number (0 among them), or any.
func (rig *controlRig) spaceID(r *fuzzBytes) uint64 {
	sel := r.u8()
	switch sel % 4 {
	case 0:
		return fuzzPeerSpaceID
	case 1:
		if rig.own != nil {
			return rig.own.id
		}
		return fuzzPeerSpaceID + 1
	case 2:
		return uint64(sel >> 2)
	}
	return r.u64()
}

// call picks a call number: one the victim sent toward or wrote for, a small
// number (0 among them), or any.
func (rig *controlRig) call(r *fuzzBytes) uint64 {
	sel := r.u8()
	switch sel % 4 {
	case 0, 1:
		return rig.calls[int(sel>>2)%len(rig.calls)]
	case 2:
		return uint64(sel >> 2)
	}
	return r.u64()
}

// write picks a write: one of the victim's into the peer's space, one the
// victim's own space took from the peer, a made-up aligned one, or any.
func (rig *controlRig) write(r *fuzzBytes) fuzzWrite {
	sel := r.u8()
	i := int(sel >> 2)
	switch sel % 4 {
	case 0:
		if len(rig.peerWrites) > 0 {
			return rig.peerWrites[i%len(rig.peerWrites)]
		}
	case 1:
		if len(rig.landed) > 0 {
			return rig.landed[i%len(rig.landed)]
		}
	case 2:
		id := uint64(fuzzPeerSpaceID)
		if i&1 == 1 && rig.own != nil {
			id = rig.own.id
		}
		return fuzzWrite{space: id, off: uint64(i>>1) * spaceAlign, n: spaceAlign, gen: uint64(i)}
	}
	return fuzzWrite{space: r.u64(), off: r.u64(), n: r.u64(), gen: r.u64()}
}

// finish checks the victim after the sequence, closes the session and
// checks that nothing is left.
func (rig *controlRig) finish(flags byte) {
	t := rig.t
	rig.checkSpaces()
	rig.ping()
	rig.checkOffers(false)
	if flags&fuzzCloseFirst == 0 {
		rig.cancel()
		rig.awaitPulls()
	}
	rig.close()
	rig.cancel()
	rig.awaitPulls()
	rig.checkOffers(true)
	if rig.holding != nil {
		_ = rig.holding.Release() // the application is done with it
	}
	if rig.victim.IsClient() {
		Received(rig.victim)
	}
	for _, d := range rig.offers {
		Withdraw(d.Token)
	}
	requireQuiet(t, "left after the session closed")
}

// checkSpaces checks the victim's receive space bookkeeping: the free and
// written ranges of the peer's space tile it without overlap, and the range
// the application holds in its own space is still held.
func (rig *controlRig) checkSpaces() {
	t := rig.t
	if ps := rig.peerSpace; ps != nil {
		ps.mu.Lock()
		type tile struct {
			off, n uint64
			what   string
		}
		var all []tile
		for _, f := range ps.free {
			all = append(all, tile{f.off, f.n, "free"})
		}
		for off, w := range ps.taken {
			all = append(all, tile{off, w.n, fmt.Sprintf("write %d (call %d)", w.gen, w.call)})
		}
		ps.mu.Unlock()
		slices.SortFunc(all, func(a, b tile) int { return cmp.Compare(a.off, b.off) })
		at := uint64(0)
		for _, s := range all {
			if s.off != at || s.n == 0 {
				t.Fatalf("the peer's space is torn at %d: %s at [%d, +%d); ranges %+v", at, s.what, s.off, s.n, all)
			}
			at += s.n
		}
		if at != fuzzPeerSpaceLen && !(len(all) == 0 && psClosed(ps)) {
			t.Fatalf("the peer's space covers %d bytes of %d: %+v", at, fuzzPeerSpaceLen, all)
		}
	}
	if sp := rig.own; sp != nil {
		sp.mu.Lock()
		h, ok := sp.inUse[rig.landed[0].off]
		sp.mu.Unlock()
		if !ok || h.gen != rig.landed[0].gen {
			t.Fatalf("the range the application holds was taken from it: %+v, %v", h, ok)
		}
	}
}

func psClosed(ps *peerSpace) bool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return ps.closed
}

// ping sends an RTR of no known token and waits for its FIN: the victim
// still reads and answers its control stream, unless the session ended.
func (rig *controlRig) ping() {
	t := rig.t
	ctx, cancel := context.WithTimeout(context.Background(), fuzzBound)
	defer cancel()
	m := &rtr{Req: rig.pingReq, Token: newToken(), Length: 1, Offers: PathStream}
	if err := sendControl(ctx, rig.hostile, ctlRTR, m.marshal()); err != nil {
		if rig.ended() {
			return
		}
		t.Fatalf("the victim's control stream is stuck: %v\n%s", err, allStacks())
	}
	for {
		select {
		case req := <-rig.fins:
			if req == rig.pingReq {
				return
			}
		case <-rig.victim.Done():
			return
		case <-ctx.Done():
			t.Fatalf("the victim did not answer an RTR after the sequence\n%s", allStacks())
		}
	}
}

// ended reports whether the session ended.
func (rig *controlRig) ended() bool {
	select {
	case <-rig.victim.Done():
		return true
	case <-rig.hostile.Done():
		return true
	default:
		return false
	}
}

// checkOffers checks the victim's outbox: held entries no call of the peer
// owns stay while the session lives; once it closed, those sent toward the
// peer left.
func (rig *controlRig) checkOffers(closed bool) {
	t := rig.t
	for i, d := range rig.offers {
		switch {
		case closed && rig.bound[i] && Offered(d.Token):
			t.Fatalf("offer %d, sent toward the peer, outlived the session", i)
		case !rig.ended() && rig.held[i] && !rig.bound[i] && !Offered(d.Token):
			t.Fatalf("held offer %d, which no call owns, left the outbox while the session lives", i)
		}
	}
}

// awaitPulls waits for the victim's pulls to return.
func (rig *controlRig) awaitPulls() {
	t := rig.t
	timer := time.NewTimer(fuzzBound)
	defer timer.Stop()
	for i, done := range rig.pulls {
		if done == nil {
			continue
		}
		select {
		case err := <-done:
			rig.pulls[i] = nil
			var te *TransferError
			if err == nil || !errors.As(err, &te) {
				t.Fatalf("pull %d ended with %v, want a failed transfer", i, err)
			}
		case <-timer.C:
			t.Fatalf("pull %d did not return\n%s", i, allStacks())
		}
	}
}

// close closes both sessions, bounded.
func (rig *controlRig) close() {
	t := rig.t
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = rig.listener.Close()
		var wg sync.WaitGroup
		for _, s := range []*transport.Session{rig.victim, rig.hostile} {
			wg.Go(func() { _ = s.Close() })
		}
		wg.Wait()
	}()
	select {
	case <-done:
	case <-time.After(fuzzBound):
		t.Fatalf("the sessions did not close\n%s", allStacks())
	}
}

func allStacks() string {
	buf := make([]byte, 1<<20)
	return string(buf[:runtime.Stack(buf, true)])
}

// controlSeq is an input: flags, then messages (controlMsg).
func controlSeq(flags byte, msgs ...[]byte) []byte {
	return slices.Concat(append([][]byte{{flags}}, msgs...)...)
}

// controlMsg is a message of an input: of control type typ (a raw message
// of that type where typ is not one of fuzzKinds), in form, repeated
// 1<<rep times, its builder's fields next.
func controlMsg(typ, form, rep byte, fields ...[]byte) []byte {
	head := []byte{byte(len(fuzzKinds)), form | rep<<3, typ}
	if i := slices.Index(fuzzKinds, typ); i >= 0 {
		head = []byte{byte(i), form | rep<<3}
	}
	return slices.Concat(append([][]byte{head}, fields...)...)
}

// seedBytes are field bytes of a seed's message; seedU64 a field of 8.
func seedBytes(b ...byte) []byte { return b }

func seedU64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// Selector bytes of a seed: the i-th of the first kind of value a selector
// offers, what the victim handed out (seedPick; |1 for the second kind), a
// small number (seedSmall), or the u64 that follows (seedAny).
func seedPick(i byte) byte  { return i << 2 }
func seedSmall(i byte) byte { return i<<2 | 2 }

const seedAny = 3

// controlSeeds are the seed corpus: sequences that mean something.
func controlSeeds() [][]byte {
	const untrusted, trusted = 0, fuzzTrusted
	built, cut, trailing, raw, empty := byte(fuzzFormBuilt), byte(fuzzFormCut), byte(fuzzFormTrailing), byte(fuzzFormRaw), byte(fuzzFormEmpty)
	stream, rdma, ipc := byte(PathStream), byte(PathRDMA), byte(PathCUDAIPC)
	return [][]byte{
		// An RTR for a live token, then FIN and CHUNK noise about the
		// victim's pulls and the RTR's own request.
		controlSeq(untrusted,
			controlMsg(ctlRTR, built, 0, seedBytes(seedSmall(5), seedPick(1), 0, stream)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(0), byte(finOK), stream, 0)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(1), byte(finOK), rdma, 0)),
			controlMsg(ctlChunk, built, 0, seedBytes(seedPick(0), 0, 1)),
			controlMsg(ctlFIN, built, 4, seedBytes(1, byte(finUnknownToken), 0, 4)),
			controlMsg(ctlRTR, built, 0, seedBytes(seedSmall(6), seedPick(1), 0, stream)),
			controlMsg(ctlRTR, built, 0, seedBytes(seedSmall(7), seedPick(0), 2, stream|rdma, 8)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(1), byte(finBusy), stream, 200)),
		),
		// The same, the session closing before the victim gives its pulls
		// up, and the pulls answered with every status.
		controlSeq(fuzzCloseFirst,
			controlMsg(ctlRTR, built, 2, seedBytes(seedSmall(9), seedPick(4), 0, stream)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(0), byte(finFailed), 0, 1)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(1), byte(finBusy)+2, stream, 0)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(1), byte(finOK), stream, 0)),
		),
		// SPACE, then SPACE-FREE of ranges never written, of the victim's
		// writes with and without their numbers, and of made-up ones.
		controlSeq(trusted,
			controlMsg(ctlSpace, built, 0, seedBytes(seedSmall(7), 16, rdma, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedSmall(4), 0, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedSmall(5), 0, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedPick(0), 0, 1)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedPick(1), 0, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedPick(1), 0, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedPick(0)|1, 0, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedAny), seedU64(fuzzPeerSpaceID), seedU64(1<<63), seedU64(1<<63), seedU64(7), seedBytes(0, 0)),
			controlMsg(ctlSpace, built, 0, seedBytes(seedPick(0), 1, ipc, 40)),
		),
		// The same over an untrusted session: the victim refuses the
		// space.
		controlSeq(untrusted,
			controlMsg(ctlSpace, built, 0, seedBytes(seedSmall(9), 16, rdma, 0)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedSmall(18), 0, 0)),
			controlMsg(ctlSpaceWithdraw, built, 0, seedBytes(seedSmall(9))),
		),
		// CALL-ENDED storms: the victim's calls, naming what they took or
		// not, calls it never knew, and one that could not say.
		controlSeq(trusted,
			controlMsg(ctlCallEnded, built, 5, seedBytes(seedPick(0), 0)),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedPick(1), 2, seedPick(1), seedPick(0))),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedSmall(9), 0xff)),
			controlMsg(ctlCallEnded, built, 7, seedBytes(seedAny), seedU64(12345), seedBytes(0)),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedSmall(0), 0)),
			controlMsg(ctlRTR, built, 0, seedBytes(seedSmall(3), seedPick(4), 0, stream)),
		),
		controlSeq(untrusted|fuzzVictimClient,
			controlMsg(ctlCallEnded, built, 6, seedBytes(seedPick(0), 0xff)),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedPick(1), 0xf9)),
		),
		// HOLD and RELEASE flip-flops, out of order and malformed, to
		// either side.
		controlSeq(untrusted,
			controlMsg(ctlHold, built, 0, seedBytes(seedPick(1))),
			controlMsg(ctlRelease, built, 0, seedBytes(seedPick(2))),
			controlMsg(ctlHold, built, 3, seedBytes(seedPick(3))),
			controlMsg(ctlRelease, built, 3, seedBytes(seedPick(3))),
			controlMsg(ctlHold, built, 0, seedBytes(seedSmall(0))),
			controlMsg(ctlRelease, built, 0, seedBytes(seedAny), seedU64(1<<62)),
			controlMsg(ctlHold, cut, 0, seedBytes(seedPick(9), 4)),
			controlMsg(ctlHold, built, 0, seedBytes(seedPick(10))),
		),
		controlSeq(untrusted|fuzzVictimClient,
			controlMsg(ctlHold, built, 0, seedBytes(seedPick(1))),
			controlMsg(ctlRelease, built, 2, seedBytes(seedPick(1))),
			controlMsg(ctlHold, built, 0, seedBytes(seedPick(2))),
		),
		// A withdrawal of the peer's space while the victim writes into it,
		// WRITES-ENDED about the victim's own space, and its unasked
		// SPACE-WITHDRAWN.
		controlSeq(trusted,
			controlMsg(ctlSpaceWithdraw, built, 3, seedBytes(seedPick(0))),
			controlMsg(ctlWritesEnded, built, 0, seedBytes(3, seedPick(0)|1, seedPick(1)|1, seedSmall(3))),
			controlMsg(ctlSpaceWithdrawn, built, 0, seedBytes(seedPick(0)|1)),
			controlMsg(ctlSpaceFree, built, 0, seedBytes(seedPick(3), 0, 0)),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedPick(0), 0)),
			controlMsg(ctlSpace, built, 0, seedBytes(seedSmall(11), 2, rdma, 0)),
			controlMsg(ctlWritesEnded, built, 0, seedBytes(1, seedPick(0)|1)),
		),
		// Truncated, padded, raw and empty messages, types nobody handles,
		// and messages at and past their bounds.
		controlSeq(trusted|fuzzVictimClient,
			controlMsg(ctlRTR, cut, 0, seedBytes(seedPick(0), seedPick(3), 0, stream|rdma, 255, 20)),
			controlMsg(ctlFIN, trailing, 0, seedBytes(seedPick(0), 0, stream, 0, 3, 1, 2, 3)),
			controlMsg(ctlSpace, empty, 0),
			controlMsg(ctlCallEnded, raw, 0, seedBytes(11, 1, 0, 0, 0, 0, 0, 0, 0, 7, 0xff, 0xfe)),
			controlMsg(0x7f, raw, 2, seedBytes(3, 1, 2, 3)),
			controlMsg(0x00, empty, 0),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedPick(0), 0xf8)),
			controlMsg(ctlCallEnded, built, 0, seedBytes(seedPick(1), 0xf9)),
			controlMsg(ctlWritesEnded, built, 0, seedBytes(0xf9)),
			controlMsg(ctlSpace, built, 0, seedBytes(seedSmall(12), 255, ipc, 65)),
			controlMsg(ctlFIN, built, 0, seedBytes(seedPick(0), 0, stream, 255)),
			controlMsg(ctlChunk, trailing, 0, seedBytes(seedPick(1), 255, 255, 1, 9)),
		),
	}
}
