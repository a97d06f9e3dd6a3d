package transport

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"

	"github.com/gdrpc/gdrpc/internal/wire"
	"github.com/gdrpc/gdrpc/rdma"
)

// ID is a 16-byte identifier: a process id or a host id.
type ID [16]byte

// String returns the id in lower-case hex.
func (id ID) String() string { return hex.EncodeToString(id[:]) }

// IsZero reports whether the id is all zeros.
func (id ID) IsZero() bool { return id == ID{} }

// LocalID returns the id of this process: the id of LocalIdentity. It is
// fixed for the life of the process and proven to every peer in the
// handshake.
func LocalID() ID { return LocalIdentity().ID() }

var localHostID = sync.OnceValue(func() ID { return hostIDFrom(os.Getenv("GDRPC_HOST_ID")) })

// LocalHostID returns the id of this host: a hash of /etc/machine-id and the
// boot id, or of the environment variable GDRPC_HOST_ID when it is set (tests
// use it to emulate several hosts on one machine). Two peers with the same host
// id are on the same host (Peer.SameHost).
func LocalHostID() ID { return localHostID() }

func hostIDFrom(env string) ID {
	h := sha256.New()
	if env != "" {
		h.Write([]byte("env:"))
		h.Write([]byte(env))
	} else {
		for _, p := range []string{"/etc/machine-id", "/proc/sys/kernel/random/boot_id"} {
			b, _ := os.ReadFile(p)
			h.Write(bytes.TrimSpace(b))
			h.Write([]byte{0})
		}
		if name, err := os.Hostname(); err == nil {
			h.Write([]byte(name))
		}
	}
	var id ID
	copy(id[:], h.Sum(nil))
	return id
}

// Caps is what a process can do, exchanged in the handshake.
type Caps struct {
	UCX           bool     // UCX is usable in this process
	UCXVersion    string   // version of the loaded UCX library
	MemoryTypes   []string // memory types UCX can register: "host", "cuda"
	UCXTransports []string // UCX transports/devices ("tl/device"), best effort
	CUDADevices   []string // UUIDs of the CUDA devices present
	Codecs        []string // codecs this process speaks, e.g. "gdr"
	// Lanes: this process accepts (server) or opens (client) the gRPC
	// stream, the control stream and a bulk lane on connections of their own
	// (UCX endpoints or TCP connections, as the session) instead of
	// multiplexed streams. Both ends must announce it.
	Lanes bool
}

// HasCodec reports whether the codec is among c.Codecs.
func (c Caps) HasCodec(name string) bool {
	for _, n := range c.Codecs {
		if n == name {
			return true
		}
	}
	return false
}

// HasMemoryType reports whether t is among c.MemoryTypes.
func (c Caps) HasMemoryType(t string) bool {
	for _, n := range c.MemoryTypes {
		if n == t {
			return true
		}
	}
	return false
}

func (c Caps) clone() Caps {
	c.MemoryTypes = append([]string(nil), c.MemoryTypes...)
	c.UCXTransports = append([]string(nil), c.UCXTransports...)
	c.CUDADevices = append([]string(nil), c.CUDADevices...)
	c.Codecs = append([]string(nil), c.Codecs...)
	return c
}

// Peer is the other end of a session as its handshake described it. ID is
// proven (the peer signed the handshake with the key it is derived from);
// the rest is what the peer says of itself.
type Peer struct {
	ID        ID                // the peer's process id (its LocalID)
	PublicKey ed25519.PublicKey // the key ID is derived from (IDOf)
	HostID    ID                // the peer's host id (its LocalHostID)
	Caps      Caps              // what the peer can do
	SameHost  bool              // HostID equals LocalHostID()
}

// announcedCaps returns the capabilities this process announces in every
// handshake: the UCX fields from rdma.Default(); the codecs are the session's
// engine's (config.localCaps). Tests replace it.
var announcedCaps func() Caps = defaultLocalCaps

var defaultUCXCaps = sync.OnceValue(func() Caps {
	if rdma.Available() != nil {
		return Caps{}
	}
	c, err := rdma.Default()
	if err != nil {
		return Caps{}
	}
	return ucxCaps(c)
})

func ucxCaps(c *rdma.Context) Caps {
	info := c.Info()
	caps := Caps{UCX: true, UCXVersion: info.Version}
	for _, m := range info.MemoryTypes {
		caps.MemoryTypes = append(caps.MemoryTypes, m.String())
	}
	caps.UCXTransports = append(caps.UCXTransports, info.Transports...)
	return caps
}

func defaultLocalCaps() Caps { return defaultUCXCaps().clone() }

// Wire format of the handshake (all integers big-endian). Every message is a
// frame:
//
//	offset size
//	0      6    magic "GDRPC\x00"
//	6      2    protocol version (4)
//	8      4    body length n (at most 64 KiB)
//	12     n    body; its first byte is the kind (hello, welcome, proof, reject)
//
// hello (client to server): kind, process id [16], host id [16], requested
// mode u8, caps, public key [32], nonce [32]. welcome (server to client):
// kind, process id, host id, caps, transport u8, flags u8 (bit 0: the client
// may fall back to TCP if the UCX upgrade fails), UCX port u16, session token
// [16], public key [32], nonce [32], signature [64]. proof (client to
// server): kind, signature [64]. reject: kind, code u8, message string. caps:
// flags u8 (bit 0: UCX; bit 1: the gRPC stream may run on a UCX endpoint of
// its own), UCX version string, then four string lists (memory types, UCX
// transports, CUDA devices, codecs). A string is a u16 length and bytes (at
// most 1 KiB); a list a u16 count (at most 64) and strings. Nothing may follow
// the last field. The reject body is the same in every version, so a peer
// speaking another version can still say why.
//
// A process id is proven, not claimed: it is derived from the sender's
// ed25519 public key (IDOf), the nonces are fresh random bytes, and the
// welcome's signature and the proof's are the server's and the client's
// signatures of the handshake transcript (identity.go). The client checks the
// welcome before it answers with its proof; the server checks the proof
// before the session exists. A peer that fails either check never gets a
// session, so it never enters the registry. The proof covers the handshake,
// not what follows: the session's streams are neither signed nor encrypted,
// so a relay on the path that forwards the handshake unchanged can read and
// inject on the control and bulk streams afterwards (the gRPC stream is as
// safe as the credentials run inside it, NewCredentials).
//
// When the welcome offers UCX, the client (after its proof) dials the
// server's UCX listener (the IP it reached over TCP, the port in the
// welcome), sends the upgrade magic "GDRPCU" and the token on the UCX stream
// and waits for one ack byte; then it sends one decision byte over TCP: 'U'
// (the session runs over UCX, the TCP connection is closed by both) or 'T'
// (UCX failed, the session stays on TCP). The server acknowledges the
// endpoint only after it checked the proof, and its UCX listener may turn
// the connection request away until then: the client dials again.
//
// On a session whose two ends announced lanes, the client runs the control
// stream, the bulk frames of the stream path and the gRPC stream each on a
// connection of its own instead of multiplexed streams: for each it dials the
// listener the session runs on (the UCX listener, or the TCP one for a TCP
// session), sends "GDRPCL" (as long as the magic, which it replaces on TCP),
// the session token and the role byte ('C', 'B', 'G'), and waits for one ack
// byte (1: accepted). On a UCX session to another host that UCX reaches over
// tcp alone, it also opens a wide lane ('W') over the server's TCP listener,
// after the bulk lane and before the gRPC lane, for large bulk transfers
// (lane.go); a server that refuses it (an older one) leaves the session
// without. The multiplexer keeps the keepalive. Version 1 had no lanes;
// version 2 sent each transfer on the bulk lane as one frame, where version 3
// interleaves transfers in pieces (lane.go); version 4 proves process ids.
const (
	magic           = "GDRPC\x00"
	upgradeMagic    = "GDRPCU"
	laneMagic       = "GDRPCL"
	protocolVersion = 4
	frameHeaderLen  = len(magic) + 2 + 4
	maxBodyLen      = 64 << 10
	keyLen          = ed25519.PublicKeySize
	nonceLen        = 32
	signatureLen    = ed25519.SignatureSize

	kindHello   = 1
	kindWelcome = 2
	kindReject  = 3
	kindProof   = 4

	transportCodeUCX = 1
	transportCodeTCP = 2

	welcomeFallbackOK = 1 << 0

	decisionUCX = 'U'
	decisionTCP = 'T'

	upgradeAckOK = 1
	// upgradeAckTaken refuses a lane whose role another connection holds on
	// the session already (releases before it answered 0 there too).
	upgradeAckTaken = 2

	capUCX   = 1 << 0
	capLanes = 1 << 1
)

// Reject codes.
const (
	rejectVersion   = 1 // protocol version not spoken
	rejectMalformed = 2 // the hello did not parse
	rejectMode      = 3 // the requested transport cannot be provided
	rejectInternal  = 4
	rejectIdentity  = 5 // the peer did not prove its process id
	rejectBusy      = 6 // the server keeps no more sessions from the client's host
)

// Handshake errors. Dial, Listen and the New*Session functions return them
// wrapped with the operation ("gdrpc: dial host:port: handshake: ...").
var (
	// ErrNotGDRPC reports that the peer did not start with the gdrpc magic.
	ErrNotGDRPC = errors.New("peer is not a gdrpc endpoint (bad magic)")
	// ErrVersion reports a protocol version mismatch; the error is a *VersionError.
	ErrVersion = errors.New("protocol version mismatch")
	// ErrMalformed reports a handshake message that does not parse.
	ErrMalformed = wire.ErrMalformed
	// ErrRejected reports that the peer refused the handshake; the error is a *RejectError.
	ErrRejected = errors.New("handshake rejected by peer")
)

// VersionError reports that the peer speaks another protocol version.
type VersionError struct {
	Local, Remote uint16
}

func (e *VersionError) Error() string {
	return fmt.Sprintf("protocol version mismatch: we speak %d, the peer speaks %d", e.Local, e.Remote)
}

// Is makes errors.Is(err, ErrVersion) true.
func (e *VersionError) Is(target error) bool { return target == ErrVersion }

// RejectError is the peer's refusal of a handshake, with its reason.
type RejectError struct {
	Code    uint8
	Message string
}

func (e *RejectError) Error() string {
	return fmt.Sprintf("rejected by peer: %s (code %d)", e.Message, e.Code)
}

// Is makes errors.Is(err, ErrRejected) true, and errors.Is(err, ErrVersion)
// true for a version rejection.
func (e *RejectError) Is(target error) bool {
	return target == ErrRejected || (target == ErrVersion && e.Code == rejectVersion)
}

type (
	publicKey [keyLen]byte
	nonce     [nonceLen]byte
	signature [signatureLen]byte
)

type hello struct {
	ID     ID
	HostID ID
	Mode   Mode
	Caps   Caps
	Key    publicKey
	Nonce  nonce
}

type welcome struct {
	ID         ID
	HostID     ID
	Caps       Caps
	Transport  string // "ucx" or "tcp"
	FallbackOK bool
	UCXPort    uint16
	Token      ID
	Key        publicKey
	Nonce      nonce
	Signature  signature // the server's, of the transcript up to this field
}

// proof is the client's signature of the transcript.
type proof struct {
	Signature signature
}

// writer builds a body.
type writer struct{ b []byte }

func (w *writer) u8(v uint8)   { w.b = append(w.b, v) }
func (w *writer) u16(v uint16) { w.b = binary.BigEndian.AppendUint16(w.b, v) }
func (w *writer) id(v ID)      { w.b = append(w.b, v[:]...) }
func (w *writer) raw(v []byte) { w.b = append(w.b, v...) }
func (w *writer) str(s string) {
	if len(s) > wire.MaxStringLen {
		s = s[:wire.MaxStringLen]
	}
	w.u16(uint16(len(s)))
	w.b = append(w.b, s...)
}
func (w *writer) list(l []string) {
	if len(l) > wire.MaxListLen {
		l = l[:wire.MaxListLen]
	}
	w.u16(uint16(len(l)))
	for _, s := range l {
		w.str(s)
	}
}
func (w *writer) caps(c Caps) {
	var f uint8
	if c.UCX {
		f |= capUCX
	}
	if c.Lanes {
		f |= capLanes
	}
	w.u8(f)
	w.str(c.UCXVersion)
	w.list(c.MemoryTypes)
	w.list(c.UCXTransports)
	w.list(c.CUDADevices)
	w.list(c.Codecs)
}

// reader parses a handshake body; the first error sticks.
type reader struct{ wire.Reader }

func (r *reader) id(what string) ID {
	var id ID
	copy(id[:], r.Take(16, what))
	return id
}

func (r *reader) caps() Caps {
	var c Caps
	f := r.U8("caps flags")
	if r.Err == nil && f&^(capUCX|capLanes) != 0 {
		r.Err = wire.Malformed("caps flags %#x: unknown bits", f)
	}
	c.UCX = f&capUCX != 0
	c.Lanes = f&capLanes != 0
	c.UCXVersion = r.Str("UCX version")
	c.MemoryTypes = r.List("memory types")
	c.UCXTransports = r.List("UCX transports")
	c.CUDADevices = r.List("CUDA devices")
	c.Codecs = r.List("codecs")
	return c
}

func modeCode(m Mode) uint8 {
	switch m {
	case ModeUCX:
		return 1
	case ModeTCP:
		return 2
	}
	return 0
}

func modeFromCode(c uint8) (Mode, bool) {
	switch c {
	case 0:
		return ModeAuto, true
	case 1:
		return ModeUCX, true
	case 2:
		return ModeTCP, true
	}
	return "", false
}

// frame wraps a body in the frame header.
func frame(body []byte) []byte {
	b := make([]byte, 0, frameHeaderLen+len(body))
	b = append(b, magic...)
	b = binary.BigEndian.AppendUint16(b, protocolVersion)
	b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...)
}

func encodeHello(h hello) []byte {
	w := &writer{}
	w.u8(kindHello)
	w.id(h.ID)
	w.id(h.HostID)
	w.u8(modeCode(h.Mode))
	w.caps(h.Caps)
	w.raw(h.Key[:])
	w.raw(h.Nonce[:])
	return frame(w.b)
}

func encodeWelcome(m welcome) []byte {
	w := &writer{}
	w.u8(kindWelcome)
	w.id(m.ID)
	w.id(m.HostID)
	w.caps(m.Caps)
	if m.Transport == "ucx" {
		w.u8(transportCodeUCX)
	} else {
		w.u8(transportCodeTCP)
	}
	var f uint8
	if m.FallbackOK {
		f |= welcomeFallbackOK
	}
	w.u8(f)
	w.u16(m.UCXPort)
	w.id(m.Token)
	w.raw(m.Key[:])
	w.raw(m.Nonce[:])
	w.raw(m.Signature[:])
	return frame(w.b)
}

// unsignedWelcome returns the part of a welcome body the server signs: all of
// it but the trailing signature.
func unsignedWelcome(body []byte) []byte { return body[:len(body)-signatureLen] }

func encodeProof(p proof) []byte {
	w := &writer{}
	w.u8(kindProof)
	w.raw(p.Signature[:])
	return frame(w.b)
}

func encodeReject(code uint8, msg string) []byte {
	w := &writer{}
	w.u8(kindReject)
	w.u8(code)
	w.str(msg)
	return frame(w.b)
}

// notGDRPC is the error for a peer that began with got instead of the magic,
// naming what the peer speaks where its first bytes tell: a gRPC endpoint
// that gdrpc does not serve (a server on net.Listen sends HTTP/2's SETTINGS
// first), HTTP/1 or TLS.
func notGDRPC(got []byte) error {
	var hint string
	switch {
	case len(got) >= 6 && got[3] == 0x4 && got[4]&^0x1 == 0 && got[5]&0x7f == 0:
		// An HTTP/2 frame header: a SETTINGS frame (type 4, flags none or
		// ACK) on stream 0.
		hint = ": the peer speaks HTTP/2, as a gRPC server on a plain listener does; serve it with listener.Listen, or dial it without gdrpc"
	case bytes.HasPrefix(got, []byte("HTTP/")):
		hint = ": the peer speaks HTTP/1"
	case len(got) >= 3 && (got[0] == 0x15 || got[0] == 0x16) && got[1] == 0x3:
		hint = ": the peer speaks TLS"
	}
	return fmt.Errorf("%w: got %q%s", ErrNotGDRPC, got, hint)
}

// readFrame reads one frame whose magic has not been read yet if magicRead is
// false. It returns the version and the body. A frame of another version is
// returned with its body so the caller can look for a reject.
func readFrame(r io.Reader, magicRead bool) (uint16, []byte, error) {
	var hdr [frameHeaderLen]byte
	start := 0
	if magicRead {
		start = len(magic)
		copy(hdr[:], magic)
	}
	if _, err := io.ReadFull(r, hdr[start:]); err != nil {
		if start == 0 && errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, nil, fmt.Errorf("%w: %w", ErrNotGDRPC, err)
		}
		return 0, nil, err
	}
	if string(hdr[:len(magic)]) != magic {
		return 0, nil, notGDRPC(hdr[:len(magic)])
	}
	version := binary.BigEndian.Uint16(hdr[len(magic):])
	n := binary.BigEndian.Uint32(hdr[len(magic)+2:])
	if n == 0 || n > maxBodyLen {
		return version, nil, wire.Malformed("body length %d (max %d)", n, maxBodyLen)
	}
	body, err := readAnnounced(r, int(n), 1<<10)
	if err != nil {
		return version, nil, fmt.Errorf("%w: truncated body: %w", ErrMalformed, err)
	}
	return version, body, nil
}

// parseReject parses a reject body (kind byte included).
func parseReject(body []byte) error {
	r := &reader{wire.Reader{B: body[1:]}}
	code := r.U8("reject code")
	msg := r.Str("reject message")
	if err := r.End(); err != nil {
		return err
	}
	return &RejectError{Code: code, Message: msg}
}

// parseHello parses a hello frame body of the given version.
func parseHello(version uint16, body []byte) (hello, error) {
	if version != protocolVersion {
		return hello{}, &VersionError{Local: protocolVersion, Remote: version}
	}
	r := &reader{wire.Reader{B: body}}
	if k := r.U8("kind"); r.Err == nil && k != kindHello {
		return hello{}, wire.Malformed("expected hello (kind %d), got kind %d", kindHello, k)
	}
	var h hello
	h.ID = r.id("process id")
	h.HostID = r.id("host id")
	mc := r.U8("mode")
	h.Caps = r.caps()
	r.Raw(h.Key[:], "public key")
	r.Raw(h.Nonce[:], "nonce")
	if err := r.End(); err != nil {
		return hello{}, err
	}
	m, ok := modeFromCode(mc)
	if !ok {
		return hello{}, wire.Malformed("unknown mode %d", mc)
	}
	h.Mode = m
	return h, nil
}

// parseWelcome parses the server's answer: a welcome, or a reject (returned as
// a *RejectError) of any version.
func parseWelcome(version uint16, body []byte) (welcome, error) {
	if len(body) > 0 && body[0] == kindReject {
		return welcome{}, parseReject(body)
	}
	if version != protocolVersion {
		return welcome{}, &VersionError{Local: protocolVersion, Remote: version}
	}
	r := &reader{wire.Reader{B: body}}
	if k := r.U8("kind"); r.Err == nil && k != kindWelcome {
		return welcome{}, wire.Malformed("expected welcome (kind %d), got kind %d", kindWelcome, k)
	}
	var m welcome
	m.ID = r.id("process id")
	m.HostID = r.id("host id")
	m.Caps = r.caps()
	tc := r.U8("transport")
	f := r.U8("flags")
	m.UCXPort = r.U16("UCX port")
	m.Token = r.id("token")
	r.Raw(m.Key[:], "public key")
	r.Raw(m.Nonce[:], "nonce")
	r.Raw(m.Signature[:], "signature")
	if err := r.End(); err != nil {
		return welcome{}, err
	}
	switch tc {
	case transportCodeUCX:
		m.Transport = "ucx"
		if m.UCXPort == 0 {
			return welcome{}, wire.Malformed("UCX offered without a port")
		}
	case transportCodeTCP:
		m.Transport = "tcp"
	default:
		return welcome{}, wire.Malformed("unknown transport %d", tc)
	}
	if f&^welcomeFallbackOK != 0 {
		return welcome{}, wire.Malformed("welcome flags %#x: unknown bits", f)
	}
	m.FallbackOK = f&welcomeFallbackOK != 0
	return m, nil
}

// parseProof parses the client's proof, or a reject (returned as a
// *RejectError): a client may give up after the welcome.
func parseProof(version uint16, body []byte) (proof, error) {
	if len(body) > 0 && body[0] == kindReject {
		return proof{}, parseReject(body)
	}
	if version != protocolVersion {
		return proof{}, &VersionError{Local: protocolVersion, Remote: version}
	}
	r := &reader{wire.Reader{B: body}}
	if k := r.U8("kind"); r.Err == nil && k != kindProof {
		return proof{}, wire.Malformed("expected proof (kind %d), got kind %d", kindProof, k)
	}
	var p proof
	r.Raw(p.Signature[:], "signature")
	if err := r.End(); err != nil {
		return proof{}, err
	}
	return p, nil
}

// isHTTP2Preface reports whether b (the first bytes a client sent) starts an
// HTTP/2 client preface; isTLSHello whether it starts a TLS handshake record.
func isHTTP2Preface(b []byte) bool {
	return strings.HasPrefix("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", string(b))
}

func isTLSHello(b []byte) bool {
	return len(b) >= 3 && b[0] == 0x16 && b[1] == 0x03 && b[2] <= 0x04
}

func newNonce() nonce {
	var n nonce
	if _, err := rand.Read(n[:]); err != nil {
		panic("gdrpc: crypto/rand failed: " + err.Error())
	}
	return n
}

func newToken() ID {
	var t ID
	if _, err := rand.Read(t[:]); err != nil {
		panic("gdrpc: crypto/rand failed: " + err.Error())
	}
	return t
}
