package oob

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/internal/wire"
	"github.com/gdrpc/gdrpc/transport"
)

// Control message types of the rendezvous, sent on a session's control stream.
const (
	ctlRTR byte = 0x10 // receiver -> owner: ready to receive token into a destination
	ctlFIN byte = 0x11 // owner -> receiver: the transfer of a request finished (status)
	// owner -> receiver: a staged chunk is in the receiver's host staging (remote
	// completion done), so its copy to the GPU can start before FIN.
	ctlChunk byte = 0x12
	// receiver -> owner: receive space the owner may write payloads into
	// (space.go); the body is an RTR's, its request id the space's id.
	ctlSpace byte = 0x13
	// receiver -> owner: a range of that space is free again (a range notice).
	ctlSpaceFree byte = 0x14
	// receiver -> owner, as its session winds down: write no more into the
	// space (a range notice of id, 0, 0); the owner answers with
	// ctlSpaceWithdrawn once no write into it is under way.
	ctlSpaceWithdraw  byte = 0x15
	ctlSpaceWithdrawn byte = 0x16
	// receiver -> owner: a call ended; the ranges the owner wrote for it
	// that it did not take are free (call.go).
	ctlCallEnded byte = 0x17
	// owner -> receiver: writes into the receiver's space for a call that
	// ended; those the receiver never took are free (writes.go).
	ctlWritesEnded byte = 0x18
	// either side -> the other, once its gRPC conn closed: calls of this
	// side that may still pull payloads over the session are open (a server
	// stream's last messages unread in gRPC's buffers), so keep the session
	// up until ctlRelease (engine.go, lingering). The body of either is
	// the version and a u64 sequence number, increasing per session and
	// sender: control messages are handled concurrently, and the latest one
	// counts (lingerMsg).
	ctlHold    byte = 0x19
	ctlRelease byte = 0x1a
)

const wireVersion = 1

// MaxPayload bounds the length a descriptor may announce: 1 TiB. A longer claim is
// treated as garbage.
const MaxPayload = 1 << 40

// Token is the one-time capability naming an outbox entry: 128 random bits.
type Token [16]byte

func (t Token) String() string { return hex.EncodeToString(t[:4]) + "…" }

// Descriptor names a payload held in an owner process's outbox. It is
// connection-agnostic: a receiver finds a live session to Owner through the
// registry and pulls the bytes through it.
type Descriptor struct {
	Owner      transport.ID
	Token      Token
	Length     uint64
	Kind       devicebuf.Kind
	Device     int          // the owner's CUDA ordinal (-1 for host memory)
	DeviceUUID string       // the owner's GPU UUID ("" for host memory)
	HostID     transport.ID // the owner's host

	// Space, when not zero, names the receive space the receiver advertised
	// (space.go) that the owner already wrote the payload into, at
	// SpaceOffset, by SpacePath (PathRDMA or PathCUDAIPC): there is nothing
	// to pull.
	Space       uint64
	SpaceOffset uint64
	SpacePath   Path
	// SpaceEvent, when not zero, says the owner's copy into the space may
	// still run: the payload is in place once the receiver's event number
	// SpaceEvent (counted from 1, of those its SPACE offered) completes.
	SpaceEvent uint32
	// SpaceGen is the owner's number for this write into the range (not 0):
	// the receiver's SPACE-FREE and CALL-ENDED name it, so that a notice
	// about an earlier write into the same range, overtaken by another, frees
	// nothing.
	SpaceGen uint64
}

// withoutSpace returns d naming its payload by token alone.
func (d Descriptor) withoutSpace() Descriptor {
	d.Space, d.SpaceOffset, d.SpacePath, d.SpaceEvent, d.SpaceGen = 0, 0, PathNone, 0, 0
	return d
}

// Validate reports whether d can name a payload at all.
func (d Descriptor) Validate() error {
	switch {
	case d.Owner == transport.ID{}:
		return errors.New("descriptor: empty owner")
	case d.Token == Token{}:
		return errors.New("descriptor: empty token")
	case d.Length > MaxPayload:
		return fmt.Errorf("descriptor: length %d exceeds %d", d.Length, uint64(MaxPayload))
	case d.Kind != devicebuf.Host && d.Kind != devicebuf.CUDA:
		return fmt.Errorf("descriptor: unknown kind %d", d.Kind)
	case len(d.DeviceUUID) > 64:
		return errors.New("descriptor: device uuid too long")
	case d.Space != 0 && d.SpacePath != PathRDMA && d.SpacePath != PathCUDAIPC:
		return fmt.Errorf("descriptor: receive space written by %v", d.SpacePath)
	case d.Space == 0 && (d.SpaceOffset != 0 || d.SpacePath != PathNone || d.SpaceEvent != 0 || d.SpaceGen != 0):
		return errors.New("descriptor: a receive space offset, path, event or write without a space")
	case d.SpaceEvent != 0 && (d.SpacePath != PathCUDAIPC || d.SpaceEvent > maxSpaceEvents):
		return fmt.Errorf("descriptor: receive space event %d of a space written by %v", d.SpaceEvent, d.SpacePath)
	}
	return nil
}

// Path names a way bytes move from the owner to the receiver.
type Path uint8

const (
	PathNone    Path = 0
	PathCUDAIPC Path = 1 << 0 // same host, destination in CUDA memory: device-to-device copy through a CUDA IPC handle
	PathRDMA    Path = 1 << 1 // UCX put into the receiver's registered memory
	PathStream  Path = 1 << 2 // the session's bulk stream
	PathStaged  Path = 1 << 3 // GPU data through registered host staging; offered with PathRDMA: send chunk notices
	PathLocal   Path = 1 << 4 // the owner is this process and no session to itself exists: a plain copy
)

func (p Path) String() string {
	switch p {
	case PathNone:
		return "none"
	case PathCUDAIPC:
		return "cuda-ipc"
	case PathRDMA:
		return "rdma"
	case PathStream:
		return "stream"
	case PathStaged:
		return "staged"
	case PathLocal:
		return "local"
	}
	return fmt.Sprintf("paths(%#x)", uint8(p))
}

// rtr is the receiver's ready-to-receive: it names the token it wants and the
// destinations the owner may write into.
type rtr struct {
	Req    uint64 // the receiver's request id, echoed in FIN and on a bulk stream
	Token  Token
	Length uint64
	Offers Path // the paths the receiver accepts (PathStream is always accepted)

	// PathRDMA: the destination's address in the receiver and its packed key.
	RAddr   uint64
	RKey    []byte
	RMemory uint8 // 0 host, 1 cuda

	// PathCUDAIPC: the destination allocation's IPC handle and the offset in it.
	IPC       devicebuf.IPCHandle
	IPCOffset uint64
	IPCDevice string // the destination GPU's UUID
}

const maxRKey = 4096

func (m *rtr) marshal() []byte {
	b := make([]byte, 0, 64+len(m.RKey)+len(m.IPC))
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint64(b, m.Req)
	b = append(b, m.Token[:]...)
	b = binary.BigEndian.AppendUint64(b, m.Length)
	b = append(b, byte(m.Offers))
	if m.Offers&PathRDMA != 0 {
		b = binary.BigEndian.AppendUint64(b, m.RAddr)
		b = append(b, m.RMemory)
		b = binary.BigEndian.AppendUint16(b, uint16(len(m.RKey)))
		b = append(b, m.RKey...)
	}
	if m.Offers&PathCUDAIPC != 0 {
		b = append(b, m.IPC[:]...)
		b = binary.BigEndian.AppendUint64(b, m.IPCOffset)
		b = append(b, byte(len(m.IPCDevice)))
		b = append(b, m.IPCDevice...)
	}
	return b
}

func parseRTR(b []byte) (*rtr, error) {
	r := &wire.Reader{B: b}
	m, err := readRTR(r)
	if err != nil {
		return nil, err
	}
	if err := r.Finish("RTR"); err != nil {
		return nil, err
	}
	return m, nil
}

// readRTR reads an RTR's fields from r, leaving what follows them.
func readRTR(r *wire.Reader) (*rtr, error) {
	if v := r.U8("u8"); r.Err == nil && v != wireVersion {
		return nil, fmt.Errorf("malformed RTR: version %d, want %d", v, wireVersion)
	}
	m := &rtr{Req: r.U64("u64")}
	copy(m.Token[:], r.Take(len(m.Token), "bytes"))
	m.Length = r.U64("u64")
	m.Offers = Path(r.U8("u8"))
	if m.Offers&^(PathCUDAIPC|PathRDMA|PathStream|PathStaged) != 0 {
		return nil, fmt.Errorf("malformed RTR: unknown paths %#x", uint8(m.Offers))
	}
	if m.Offers&PathRDMA != 0 {
		m.RAddr = r.U64("u64")
		m.RMemory = r.U8("u8")
		n := int(r.U16("u16"))
		if n > maxRKey {
			return nil, fmt.Errorf("malformed RTR: key of %d bytes", n)
		}
		m.RKey = append([]byte(nil), r.Take(n, "bytes")...)
		if m.RMemory > 1 {
			return nil, fmt.Errorf("malformed RTR: memory type %d", m.RMemory)
		}
	}
	if m.Offers&PathCUDAIPC != 0 {
		copy(m.IPC[:], r.Take(len(m.IPC), "bytes"))
		m.IPCOffset = r.U64("u64")
		m.IPCDevice = string(r.Take(int(r.U8("u8")), "device uuid"))
	}
	if r.Err != nil {
		return nil, fmt.Errorf("malformed RTR: %w", r.Err)
	}
	if m.Length > MaxPayload {
		return nil, fmt.Errorf("malformed RTR: length %d", m.Length)
	}
	return m, nil
}

// maxSpaceEvents bounds the events one SPACE may offer.
const maxSpaceEvents = 64

// spaceMsg is a receiver's SPACE: where its space is (as an RTR), and the
// CUDA IPC events (PathCUDAIPC only) an owner may record after a copy into
// it still runs, so the message need not wait for the copy.
type spaceMsg struct {
	rtr
	Events []devicebuf.IPCEventHandle
}

func (m *spaceMsg) marshal() []byte {
	b := m.rtr.marshal()
	b = append(b, byte(len(m.Events)))
	for _, h := range m.Events {
		b = append(b, h[:]...)
	}
	return b
}

func parseSpace(b []byte) (*spaceMsg, error) {
	r := &wire.Reader{B: b}
	m, err := readRTR(r)
	if err != nil {
		return nil, err
	}
	sm := &spaceMsg{rtr: *m}
	n := 0
	if len(r.B) > 0 { // an older sender offers no events
		n = int(r.U8("u8"))
	}
	if n > maxSpaceEvents || n > 0 && m.Offers != PathCUDAIPC {
		return nil, fmt.Errorf("malformed SPACE: %d events for paths %v", n, m.Offers)
	}
	for range n {
		var h devicebuf.IPCEventHandle
		r.Raw(h[:], "event handle")
		sm.Events = append(sm.Events, h)
	}
	if err := r.Finish("SPACE"); err != nil {
		return nil, err
	}
	return sm, nil
}

// finStatus is the owner's verdict on one request.
type finStatus uint8

const (
	finOK finStatus = iota
	finUnknownToken
	finBadLength
	finNoPath
	finFailed
	finBusy // the owner's queue for the session is full
)

type fin struct {
	Req    uint64
	Status finStatus
	Path   Path
	Msg    string
}

const maxFinMsg = 1024

func (m *fin) marshal() []byte {
	msg := m.Msg
	if len(msg) > maxFinMsg {
		msg = msg[:maxFinMsg]
	}
	b := make([]byte, 0, 16+len(msg))
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint64(b, m.Req)
	b = append(b, byte(m.Status), byte(m.Path))
	b = binary.BigEndian.AppendUint16(b, uint16(len(msg)))
	return append(b, msg...)
}

func parseFIN(b []byte) (*fin, error) {
	r := &wire.Reader{B: b}
	if v := r.U8("u8"); r.Err == nil && v != wireVersion {
		return nil, fmt.Errorf("malformed FIN: version %d, want %d", v, wireVersion)
	}
	m := &fin{Req: r.U64("u64"), Status: finStatus(r.U8("u8")), Path: Path(r.U8("u8"))}
	n := int(r.U16("u16"))
	if n > maxFinMsg {
		return nil, fmt.Errorf("malformed FIN: message of %d bytes", n)
	}
	m.Msg = string(r.Take(n, "bytes"))
	if err := r.Finish("FIN"); err != nil {
		return nil, err
	}
	if m.Status > finBusy {
		return nil, fmt.Errorf("malformed FIN: status %d", m.Status)
	}
	return m, nil
}

// bulk stream header: the request id and the byte count that follows.
const bulkHeaderLen = 1 + 8 + 8

func bulkHeader(req, n uint64) []byte {
	b := make([]byte, 0, bulkHeaderLen)
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint64(b, req)
	return binary.BigEndian.AppendUint64(b, n)
}

func parseBulkHeader(b []byte) (req, n uint64, err error) {
	r := &wire.Reader{B: b}
	if v := r.U8("u8"); r.Err == nil && v != wireVersion {
		return 0, 0, fmt.Errorf("malformed bulk header: version %d", v)
	}
	req, n = r.U64("u64"), r.U64("u64")
	return req, n, r.Finish("bulk header")
}

// bulk lane frame header: a piece of one transfer on the bulk lane (lane.go),
// or that transfer's abort.
const laneFrameLen = 1 + 1 + 4*8

const (
	laneData  = 0 // n bytes of the transfer, at off, follow
	laneAbort = 1 // the owner gave the transfer up: no more frames for it
)

type laneFrame struct {
	kind   uint8
	req    uint64 // the pull's request id
	total  uint64 // the transfer's length
	off, n uint64 // where the piece goes, and its length
}

func (f laneFrame) marshal() []byte {
	b := make([]byte, 0, laneFrameLen)
	b = append(b, wireVersion, f.kind)
	for _, v := range [...]uint64{f.req, f.total, f.off, f.n} {
		b = binary.BigEndian.AppendUint64(b, v)
	}
	return b
}

func parseLaneFrame(b []byte) (laneFrame, error) {
	r := &wire.Reader{B: b}
	var f laneFrame
	if v := r.U8("version"); r.Err == nil && v != wireVersion {
		return f, fmt.Errorf("malformed bulk lane frame: version %d", v)
	}
	f.kind = r.U8("kind")
	f.req, f.total, f.off, f.n = r.U64("req"), r.U64("total"), r.U64("offset"), r.U64("length")
	if err := r.Finish("bulk lane frame"); err != nil {
		return f, err
	}
	switch {
	case f.kind > laneAbort:
		return f, fmt.Errorf("malformed bulk lane frame: kind %d", f.kind)
	case f.total > MaxPayload:
		return f, fmt.Errorf("malformed bulk lane frame: length %d exceeds %d", f.total, uint64(MaxPayload))
	case f.off > f.total || f.n > f.total-f.off:
		return f, fmt.Errorf("malformed bulk lane frame: piece [%d, +%d) of a %d-byte transfer", f.off, f.n, f.total)
	case f.kind == laneAbort && f.n != 0:
		return f, fmt.Errorf("malformed bulk lane frame: abort with %d bytes", f.n)
	case f.kind == laneData && f.n == 0 && f.total != 0:
		return f, fmt.Errorf("malformed bulk lane frame: empty piece of a %d-byte transfer", f.total)
	case f.n > laneFrameMax:
		return f, fmt.Errorf("malformed bulk lane frame: piece of %d bytes exceeds %d", f.n, laneFrameMax)
	}
	return f, nil
}

// range notice: an id (a request's, a receive space's), then the offset and
// length of a range: a staged chunk now in staging (ctlChunk), a range of
// receive space free again (ctlSpaceFree).
func rangeNotice(req, off, n uint64) []byte {
	b := make([]byte, 0, 1+24)
	b = append(b, wireVersion)
	b = binary.BigEndian.AppendUint64(b, req)
	b = binary.BigEndian.AppendUint64(b, off)
	return binary.BigEndian.AppendUint64(b, n)
}

// freeNotice is a SPACE-FREE: a range notice and the owner's number for the
// write into the range (Descriptor.SpaceGen). An owner that numbers no writes
// (an older gdrpc, whose descriptors carry 0) gets the range notice alone,
// which is all it reads.
func freeNotice(req, off, n, gen uint64) []byte {
	if gen == 0 {
		return rangeNotice(req, off, n)
	}
	return binary.BigEndian.AppendUint64(rangeNotice(req, off, n), gen)
}

// parseFreeNotice reads a SPACE-FREE; one without the write's number (an
// older receiver's) names any write into the range (0).
func parseFreeNotice(b []byte) (req, off, n, gen uint64, err error) {
	if len(b) <= 1+24 {
		req, off, n, err = parseRangeNotice(b, "SPACE-FREE")
		return req, off, n, 0, err
	}
	req, off, n, err = parseRangeNotice(b[:1+24], "SPACE-FREE")
	r := &wire.Reader{B: b[1+24:]}
	gen = r.U64("write")
	if err == nil {
		err = r.Finish("SPACE-FREE")
	}
	return req, off, n, gen, err
}

func parseRangeNotice(b []byte, what string) (req, off, n uint64, err error) {
	r := &wire.Reader{B: b}
	if v := r.U8("version"); r.Err == nil && v != wireVersion {
		return 0, 0, 0, fmt.Errorf("malformed %s: version %d", what, v)
	}
	req, off, n = r.U64("id"), r.U64("offset"), r.U64("length")
	return req, off, n, r.Finish(what)
}

// lingerMsg is a HOLD or RELEASE: version, and the sender's sequence number
// (below 1<<63).
func lingerMsg(seq uint64) []byte {
	return binary.BigEndian.AppendUint64(append(make([]byte, 0, 9), wireVersion), seq)
}

func parseLinger(b []byte) (uint64, error) {
	r := &wire.Reader{B: b}
	if v := r.U8("version"); r.Err == nil && v != wireVersion {
		return 0, fmt.Errorf("malformed HOLD or RELEASE: version %d", v)
	}
	seq := r.U64("sequence")
	if r.Err == nil && seq >= 1<<63 {
		return 0, fmt.Errorf("malformed HOLD or RELEASE: sequence %d", seq)
	}
	return seq, r.Finish("HOLD or RELEASE")
}
