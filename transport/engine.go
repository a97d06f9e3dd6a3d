package transport

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"
)

// Engine serves what a session carries besides the gRPC stream: control
// messages, bulk streams and the bulk lane. The out-of-band engine (package
// oob) is one. Sessions get theirs from WithEngine; a session without one
// drops control messages and closes bulk streams the peer opens.
type Engine interface {
	// Attach is called once for each session, after its handshake and before
	// it carries anything else. link is the session's side only the engine
	// holds. The handler serves the session until it closed.
	Attach(s *Session, link *Link) Handler
	// Codecs are the payload codecs whose transfers the engine serves; the
	// handshake announces them (Caps.Codecs), so a peer sends out-of-band
	// payloads only to sessions that will answer their pulls. Sessions ask
	// on every call they carry and never modify the slice: return the same
	// one each time.
	Codecs() []string
}

// Handler serves one session for its Engine. Its methods run on the
// session's goroutines, which Close joins: each must return once the session
// is done.
type Handler interface {
	// Control handles one control message; it owns payload. Messages are
	// handled concurrently, each on a goroutine that handles no other
	// meanwhile (the session reuses them), at most MaxControlHandlers at once.
	Control(typ byte, payload []byte)
	// Bulk serves one bulk stream the peer opened; it owns c.
	Bulk(c net.Conn)
	// Lane reads the frames of one of the session's frame lanes until it
	// fails; an error ends the session. A session with a wide lane besides
	// its bulk lane calls it for each, concurrently.
	Lane(c net.Conn) error
	// Linger returns once a session whose gRPC conn closed may close: the
	// session stays up while out-of-band transfers still use it. Close
	// waits for it; Linger must not call Close.
	Linger()
	// Closed runs once the session closed, after it left the registry and
	// Done was closed, on a goroutine of its own: the session may be closed
	// by a goroutine of the engine's (an I/O error in one of its writes, an
	// Abort) that holds what Closed needs. Close waits for it; Closed must
	// not call Close.
	Closed()
	// Join waits for the goroutines the handler started for the session; Close
	// calls it after Closed.
	Join()
}

// Link is the part of a session only its Engine holds: what the engine sends
// and opens, and how it ends a session whose peer broke the protocol. The
// zero Link is not usable; sessions make theirs.
type Link struct {
	s *Session

	ctxOnce sync.Once
	ctx     context.Context
	cancel  context.CancelFunc
}

// ErrNoLaneTurn marks a lane frame or a control message of which nothing was
// written: the context or the session ended while it waited for its turn on
// its lane or the control stream.
var ErrNoLaneTurn = errors.New("no turn on the lane")

// SendControl sends one control message: [type u8][length u32 BE][payload] on
// the control stream. Writers are serialised; a message is never interleaved
// with another. ctx bounds the wait for the stream and for the turn to write.
// An error wrapping ErrNoLaneTurn means nothing was written; any other error
// is a write that failed, which ends the session, and the message may have
// reached the peer all the same.
func (l *Link) SendControl(ctx context.Context, typ byte, payload []byte) error {
	return l.s.sendControl(ctx, typ, payload)
}

// OpenBulk opens a new bulk stream to the peer, whose engine's Bulk gets the
// other end.
func (l *Link) OpenBulk(ctx context.Context) (net.Conn, error) {
	return l.s.open(ctx, roleBulk)
}

// Lane returns the session's bulk lane once it is there, else nil.
func (l *Link) Lane() net.Conn { return l.s.bulkLane() }

// WriteLaneFrame writes bufs as one frame, whole, between the frames of other
// transfers, by ctx's deadline, on the lane that carries transfers of total
// bytes: the bulk lane, or the wide lane for a large one where the session
// has one. Every frame of a transfer, its abort included, must name the same
// total, so they keep to one lane and their order. An error wrapping
// ErrNoLaneTurn means nothing was written; any other error may leave a frame
// cut short, and the caller should end the session.
func (l *Link) WriteLaneFrame(ctx context.Context, total uint64, bufs ...[]byte) error {
	return l.s.writeLaneFrame(ctx, total, bufs...)
}

// WriteLaneFrameFrom writes a frame of hdr and body, of a transfer of total
// bytes, as WriteLaneFrame does,
// for a body the caller may need back before the peer took it all: the
// write runs from body for at most quick, then letGo gets what of body is
// unwritten and returns the copy the rest is written from. letGo is called
// once in any case; after it the write reads body no more. Over a lane that
// may not report a partial write, letGo gets the whole body first.
func (l *Link) WriteLaneFrameFrom(ctx context.Context, total uint64, hdr, body []byte, quick time.Duration, letGo func(rest []byte) []byte) error {
	return l.s.writeLaneFrameFrom(ctx, total, hdr, body, quick, letGo)
}

// WarnPeer logs to log, at Warn, something the peer sent that this side
// refuses or drops (a malformed control message): as the listener logs its
// own per-connection failures, at most once per msg every 10 s over all the
// sessions of the listener (a client's session: of the session), the others
// at Debug, the next line at Warn counting them (more_at_debug). A peer can
// send such messages as fast as it writes.
func (l *Link) WarnPeer(log *slog.Logger, msg string, args ...any) {
	l.s.peerWarns.logTo(log, slog.LevelWarn, "peer\x00"+msg, msg, args...)
}

// Abort ends the session with cause, without waiting (it may run on the
// session's own goroutines): for a peer that broke the protocol or stopped
// answering.
func (l *Link) Abort(cause error) { l.s.closeWith(cause) }

// Context returns a context that ends when the session closes.
func (l *Link) Context() context.Context {
	l.ctxOnce.Do(func() {
		l.ctx, l.cancel = context.WithCancel(context.Background())
		select {
		case <-l.s.done:
			l.cancel()
		default:
		}
	})
	return l.ctx
}

// ClosedErr is what calls on the closed session return: it wraps
// net.ErrClosed and the session's Err.
func (l *Link) ClosedErr() error { return l.s.closedErr() }

// end cancels the link's context; the session calls it once it closed.
func (l *Link) end() {
	l.ctxOnce.Do(func() {
		l.ctx, l.cancel = context.WithCancel(context.Background())
	})
	l.cancel()
}

// noHandler serves a session without an engine.
type noHandler struct{ s *Session }

func (h noHandler) Control(typ byte, payload []byte) {
	h.s.log.Debug("control message dropped: no engine", "type", typ, "len", len(payload))
}
func (h noHandler) Bulk(c net.Conn) {
	// A session without an engine announced no codecs: a peer has no
	// transfer to open a bulk stream for.
	h.s.refuseStream(c, errors.New("gdrpc: the peer opened a bulk stream on a session without out-of-band transfers"))
}

// Lane ends the session at the lane's first byte: a session without an
// engine runs no transfers, so an honest peer sends nothing there, and
// what a lane left unread carries piles up in this process (UCX's stream
// has no flow control).
func (noHandler) Lane(c net.Conn) error {
	var b [1]byte
	for {
		n, err := c.Read(b[:])
		if n > 0 {
			return errLaneNoEngine
		}
		if err != nil {
			return err
		}
	}
}

// errLaneNoEngine ends a session whose peer wrote on a lane of a session
// without an engine.
var errLaneNoEngine = errors.New("data on a lane of a session without an engine")

// Linger gives the peer lingerNoEngine to read what the lanes still carry:
// the ping that closes a session gracefully travels on the session's main
// connection, so its answer does not say the peer read its lanes.
func (h noHandler) Linger() {
	t := time.NewTimer(lingerNoEngine)
	defer t.Stop()
	select {
	case <-t.C:
	case <-h.s.done:
	}
}

// lingerNoEngine is how long a session without an engine stays up after its
// gRPC conn closed.
const lingerNoEngine = 500 * time.Millisecond

func (noHandler) Closed() {}
func (noHandler) Join()   {}
