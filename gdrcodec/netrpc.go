package gdrcodec

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/rpc"
	"slices"
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/transport"
)

// net/rpc codecs: requests and replies are protobuf messages whose payloads move
// out-of-band exactly as with gRPC. On the wire each message is
//
//	uvarint(len(header)) header uvarint(len(body)) body
//
// with header = uvarint(seq) uvarint(len(method)) method uvarint(len(error)) error.

// maxNetRPCFrame bounds a body on the wire whatever WithNetRPCMaxBody says,
// maxNetRPCHeader a header (a method name and an error message).
const (
	maxNetRPCFrame  = 1 << 30
	maxNetRPCHeader = 64 << 10
)

// DefaultNetRPCMaxBody bounds the body of a net/rpc request or reply, as it
// is on the wire, unless WithNetRPCMaxBody says otherwise: gRPC's default
// bound on a message it receives. The body carries a message's descriptors
// and small fields; its payloads travel out-of-band over a gdrpc session
// from the eager threshold on, and inline below it, or every one over a
// conn that is no gdrpc session. The bound on the body is what bounds the
// memory a peer's message makes the codec allocate as it decodes it: a
// protobuf message takes up to a hundred times its size once decoded (a
// repeated field of empty messages, two bytes each on the wire).
const DefaultNetRPCMaxBody = 4 << 20

// WithNetRPCMaxBody sets the largest body a net/rpc codec reads and writes
// (see DefaultNetRPCMaxBody), at most 1 GiB, the framing's own bound, which
// n < 0 sets: a body over it that arrives ends the connection, for what
// follows would be read from inside it, and one that would be sent fails its
// call instead. Give both ends the same: to the codecs, or to Register for
// codecs made without options (options given to a codec replace all of
// Register's). Peers of releases before this option sent bodies of up to
// 64 MiB. If zero, DefaultNetRPCMaxBody.
func WithNetRPCMaxBody(n int) Option { return func(o *options) { o.maxBody = n } }

// netRPCMaxBody is the bound WithNetRPCMaxBody set, or its default.
func (o *options) netRPCMaxBody() int {
	switch {
	case o.maxBody == 0:
		return DefaultNetRPCMaxBody
	case o.maxBody < 0:
		return maxNetRPCFrame
	}
	return min(o.maxBody, maxNetRPCFrame)
}

// DefaultNetRPCPending bounds the requests of one net/rpc server connection
// whose replies are not written yet, unless WithNetRPCPending says
// otherwise. net/rpc starts a handler for every request it reads, and the
// codec keeps each request's message (and its received payloads) until the
// reply: past the bound the server reads no further request until a reply
// is written, so a client that pipelines requests and reads no reply holds
// the connection's window and that many requests, until the reply it does
// not read ends the connection (DefaultNetRPCWriteTimeout).
const DefaultNetRPCPending = 1024

// WithNetRPCPending sets how many requests of one net/rpc server connection
// may wait for their replies before the codec reads no further one (see
// DefaultNetRPCPending); n < 0 lifts the bound. A service whose handlers
// wait for later requests of the same connection (long polls that another
// call releases: a net/rpc Client sends every call over one connection)
// needs a bound above the calls it keeps waiting. If zero,
// DefaultNetRPCPending.
func WithNetRPCPending(n int) Option { return func(o *options) { o.pending = n } }

// DefaultNetRPCWriteTimeout is how long a net/rpc server connection's write
// may go on with the client reading none of it before the codec ends the
// connection, unless WithNetRPCWriteTimeout says otherwise. A client that
// stops reading would otherwise hold a reply's write, every later reply
// (net/rpc writes one at a time) and every request waiting for its reply,
// with its payloads, for as long as the connection lives. It is well past
// what an honest client's reader may spend between two reads: the pulls of
// a reply's payloads, each bounded by the transfer timeout
// (oob.DefaultTransferTimeout).
const DefaultNetRPCWriteTimeout = 5 * time.Minute

// WithNetRPCWriteTimeout sets how long a write to a net/rpc connection may
// go on with the peer reading none of it before the codec ends the
// connection; d < 0 lifts the bound. A server codec has
// DefaultNetRPCWriteTimeout unless set; a client codec has none unless set
// (a server that reads no request holds a client's write by design while
// as many wait for their replies as its own bound allows, see
// WithNetRPCPending).
func WithNetRPCWriteTimeout(d time.Duration) Option {
	return func(o *options) { o.writeTimeout = d }
}

// progressWriter writes to a connection in pieces, each with a deadline of
// idle from when it starts: a write fails once the peer read none of it for
// idle, however long the whole write takes while the peer reads.
type progressWriter struct {
	nc   net.Conn
	idle time.Duration
}

// progressPiece is the most a progressWriter writes under one deadline.
const progressPiece = 64 << 10

func (w *progressWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		k := min(len(p), progressPiece)
		_ = w.nc.SetWriteDeadline(time.Now().Add(w.idle))
		m, err := w.nc.Write(p[:k])
		n += m
		if err != nil {
			return n, err
		}
		p = p[k:]
	}
	return n, nil
}

// DefaultNetRPCPendingBytes bounds the bytes of the requests of one net/rpc
// server connection whose replies are not written yet (their bodies, or what
// their messages hold once decoded where that is more, and the payloads they
// named out-of-band), unless
// WithNetRPCPendingBytes says otherwise: a body may carry its bound's worth
// inline (payloads under the eager threshold, or every payload over a
// connection that is no gdrpc session; DefaultNetRPCMaxBody) and name up to
// the receive limit more, and the count alone (DefaultNetRPCPending) would
// let one connection hold 1,024 of them while its handlers run. Past it the server reads no
// further request until a reply is written; a request is always read when
// none waits.
const DefaultNetRPCPendingBytes = 1 << 30

// WithNetRPCPendingBytes sets how many bytes of requests one net/rpc server
// connection may hold while their replies are not written (see
// DefaultNetRPCPendingBytes); n < 0 lifts the bound. If zero,
// DefaultNetRPCPendingBytes.
func WithNetRPCPendingBytes(n int64) Option { return func(o *options) { o.pendingBytes = n } }

// netRPCPendingBytes is the bound WithNetRPCPendingBytes set, or -1 for none.
func (o *options) netRPCPendingBytes() int64 {
	return optionalBound(o.pendingBytes, DefaultNetRPCPendingBytes)
}

// netRPCPending is the bound WithNetRPCPending set, or -1 for none.
func (o *options) netRPCPending() int { return optionalBound(o.pending, DefaultNetRPCPending) }

// optionalBound is a bound an option set: set itself, -1 (none) when set is
// below zero, or def when set is zero.
func optionalBound[T int | int64](set, def T) T {
	switch {
	case set > 0:
		return set
	case set < 0:
		return -1
	}
	return def
}

// frameChunk is how much of a frame is allocated before its bytes arrive.
const frameChunk = 64 << 10

type netrpcConn struct {
	rwc io.ReadWriteCloser
	r   *bufio.Reader
	w   *bufio.Writer
	wmu sync.Mutex
	c   codec
	// broken is why the reading lost its place in the stream (a frame
	// refused before its bytes were read, a read that failed part-way);
	// every later read returns it: what follows would be read from inside
	// a frame, its bytes taken for messages of their own. Only the reading
	// goroutine (net/rpc has one per codec) touches it.
	broken error
	// ctx bounds the pulls of received payloads; Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc
	// idle is how long a write may go on with the peer reading none of it
	// (progressWriter), or 0.
	idle time.Duration
	// bodyLen is the length of the last body read into memory (readBody),
	// or what its message holds once decoded where that is more and
	// countDecoded is set (a server's, whose pending bound counts it:
	// decodedSize), 0 after one skipped, with the lengths of the payloads
	// its message named out-of-band (pulled, or taken from the receive
	// space). Only the reading goroutine touches it.
	bodyLen      int
	countDecoded bool
}

// newNetRPCConn needs no Register: net/rpc does not use gRPC's codec
// registry. Without opts the conn follows Register's options. Only over a
// gdrpc session that negotiated the codec do payloads travel out-of-band:
// over any other conn (a plain peer the listener handed over, a pipe) they
// go inline, and a body that names a payload by owner and token is refused
// before anything is pulled or allocated for it.
// newNetRPCConn's writes to a net.Conn end the connection once the peer read
// none of them for idle (0: never; see WithNetRPCWriteTimeout, which
// overrides it).
func newNetRPCConn(rwc io.ReadWriteCloser, opts []Option, idle time.Duration) netrpcConn {
	c := codec{name: Name}
	if len(opts) > 0 {
		c.o = newOptions(opts)
	}
	if d := c.options().writeTimeout; d != 0 {
		idle = max(d, 0)
	}
	ctx := context.Background()
	var out io.Writer = rwc
	if nc, ok := rwc.(net.Conn); ok {
		if s := transport.SessionOf(nc); s != nil && s.Speaks(Name) {
			c.oob, c.sess = true, s
		}
		// Pulls take the conn's own session first, as a gRPC call's do.
		ctx = peer.NewContext(ctx, &peer.Peer{Addr: nc.RemoteAddr(), LocalAddr: nc.LocalAddr()})
		if idle > 0 {
			out = &progressWriter{nc: nc, idle: idle}
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	return netrpcConn{rwc: rwc, r: bufio.NewReader(rwc), w: bufio.NewWriter(out), c: c, ctx: ctx, cancel: cancel, idle: idle}
}

// close ends the pulls under way and closes the connection.
func (c *netrpcConn) close() error {
	c.cancel()
	return c.rwc.Close()
}

// unwritten is the error of a message refused before any of its bytes
// went out: the connection is still good for the next.
type unwritten struct{ err error }

func (e unwritten) Error() string { return e.err.Error() }
func (e unwritten) Unwrap() error { return e.err }

// headerRoom is what a header frame leaves for a method name and an error
// message together.
const headerRoom = maxNetRPCHeader - 3*binary.MaxVarintLen64

// truncate returns s cut to at most n bytes, not inside a rune.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// write sends one message, its body's payloads held by h (nil: none). An
// error message too long for a header is cut short; a method name too long
// is an error. An error before any byte went out is an unwritten.
func (c *netrpcConn) write(seq uint64, method, errMsg string, body any, h *hold) error {
	if len(method) > headerRoom {
		return unwritten{fmt.Errorf("gdrcodec: net/rpc method name of %d bytes, at most %d", len(method), headerRoom)}
	}
	errMsg = truncate(errMsg, headerRoom-len(method))
	var msg mem.BufferSlice // the body's buffers, written as they are
	if body != nil {
		m := messageV2Of(body)
		if m == nil {
			return unwritten{fmt.Errorf("gdrcodec: net/rpc body %T is not a proto.Message", body)}
		}
		data, err := c.c.marshal(m, h)
		if err != nil {
			return unwritten{err}
		}
		defer data.Free()
		if limit := c.c.options().netRPCMaxBody(); data.Len() > limit {
			// The peer would refuse it and end the connection: its inline
			// payloads (under the eager threshold, or every payload over a
			// connection that is no gdrpc session) are too large for one
			// body.
			return unwritten{fmt.Errorf("gdrcodec: net/rpc body of %d bytes, at most %d (gdrcodec.WithNetRPCMaxBody); send large payloads out-of-band", data.Len(), limit)}
		}
		msg = data
	}
	hdr := binary.AppendUvarint(nil, seq)
	hdr = binary.AppendUvarint(hdr, uint64(len(method)))
	hdr = append(hdr, method...)
	hdr = binary.AppendUvarint(hdr, uint64(len(errMsg)))
	hdr = append(hdr, errMsg...)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	err := c.writeFrames(hdr, msg)
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() && c.idle > 0 {
		// The peer stopped reading. The writer's error sticks, so every
		// later write fails at once; the connection's end fails the reads.
		_ = c.close()
		return fmt.Errorf("gdrcodec: the net/rpc peer read nothing for %v: %w", c.idle, err)
	}
	return err
}

// writeFrames writes a header frame and a body frame (c.wmu held).
func (c *netrpcConn) writeFrames(hdr []byte, msg mem.BufferSlice) error {
	for _, frame := range []mem.BufferSlice{{mem.SliceBuffer(hdr)}, msg} {
		if _, err := c.w.Write(binary.AppendUvarint(nil, uint64(frame.Len()))); err != nil {
			return err
		}
		for _, b := range frame {
			if _, err := c.w.Write(b.ReadOnlyData()); err != nil {
				return err
			}
		}
	}
	return c.w.Flush()
}

// frameLen reads the length of the next frame, at most limit.
func (c *netrpcConn) frameLen(limit int) (int, error) {
	if c.broken != nil {
		return 0, c.broken
	}
	n, err := binary.ReadUvarint(c.r)
	if err != nil {
		return 0, c.lost(err)
	}
	if n > uint64(limit) {
		return 0, c.lost(fmt.Errorf("gdrcodec: net/rpc frame of %d bytes, at most %d", n, limit))
	}
	return int(n), nil
}

// lost records err, after which the reading is no longer at the start of a
// frame (or the stream ended), as the answer to every later read, and
// returns it.
func (c *netrpcConn) lost(err error) error {
	c.broken = err
	return err
}

// cut is lost for a read that failed inside a frame: an end of the stream
// there is unexpected.
func (c *netrpcConn) cut(err error) error {
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return c.lost(err)
}

// readFrame reads the next frame, of at most limit bytes. Its buffer grows
// as the bytes arrive: a peer that announces a large frame and stalls pins
// no more memory than it sent.
func (c *netrpcConn) readFrame(limit int) ([]byte, error) {
	n, err := c.frameLen(limit)
	if err != nil {
		return nil, err
	}
	p := make([]byte, 0, min(n, frameChunk))
	for len(p) < n {
		if len(p) == cap(p) {
			p = slices.Grow(p, min(n-len(p), len(p)))
		}
		k, err := io.ReadFull(c.r, p[len(p):min(cap(p), n)])
		p = p[:len(p)+k]
		if err != nil {
			return nil, c.cut(err)
		}
	}
	return p, nil
}

// skipFrame reads past the next frame, of at most limit bytes.
func (c *netrpcConn) skipFrame(limit int) error {
	n, err := c.frameLen(limit)
	if err != nil {
		return err
	}
	if _, err := io.CopyN(io.Discard, c.r, int64(n)); err != nil {
		return c.cut(err)
	}
	return nil
}

func (c *netrpcConn) readHeader() (seq uint64, method, errMsg string, err error) {
	p, err := c.readFrame(maxNetRPCHeader)
	if err != nil {
		return 0, "", "", err
	}
	str := func() string {
		n, k := binary.Uvarint(p)
		if k <= 0 || n > uint64(len(p)-k) {
			err = errors.New("gdrcodec: malformed net/rpc header")
			p = nil
			return ""
		}
		s := string(p[k : k+int(n)])
		p = p[k+int(n):]
		return s
	}
	seq, k := binary.Uvarint(p)
	if k <= 0 {
		return 0, "", "", errors.New("gdrcodec: malformed net/rpc header")
	}
	p = p[k:]
	method = str()
	errMsg = str()
	if err == nil && len(p) != 0 {
		err = errors.New("gdrcodec: malformed net/rpc header: trailing bytes")
	}
	return seq, method, errMsg, err
}

// readBody decodes the next body into v (nil: discard), pulling its payloads.
func (c *netrpcConn) readBody(v any) error {
	c.bodyLen = 0
	if v == nil {
		return c.skipFrame(c.c.options().netRPCMaxBody())
	}
	p, err := c.readFrame(c.c.options().netRPCMaxBody())
	c.bodyLen = len(p)
	if err != nil {
		return err
	}
	m := messageV2Of(v)
	if m == nil {
		return fmt.Errorf("gdrcodec: net/rpc body %T is not a proto.Message", v)
	}
	md := m.ProtoReflect().Descriptor()
	carries := mayCarry(md)
	from := plainSender
	if c.c.oob {
		from = gdrSender
	}
	if carries {
		ReleaseAll(m) // as codec.Unmarshal: the decode resets m
		err = precount(p, md)
	}
	if err == nil {
		err = proto.Unmarshal(p, m)
	}
	if err != nil {
		if carries {
			// As a refused walk does: a reply's payloads that landed in
			// this side's receive space are not taken back otherwise.
			discardLandedOnWire(c.ctx, p, md, from)
		}
		return err
	}
	// What the request holds once decoded, which the pending bound counts:
	// up to a hundred times its body (decodedSize).
	if c.countDecoded {
		c.bodyLen = max(c.bodyLen, decodedSize(m.ProtoReflect()))
	}
	if !carries {
		return nil
	}
	pulls, err := collectPulls(c.ctx, m.ProtoReflect(), from, c.c.options())
	if err != nil {
		return err
	}
	for _, j := range pulls.jobs {
		c.bodyLen += int(j.n) // within the receive limit: no overflow
	}
	return pulls.run(c.ctx)
}

// NewClientCodec returns a net/rpc client codec over rwc (a gdrpc conn from
// dialer.Dialer.DialContext): rpc.NewClientWithCodec(gdrcodec.NewClientCodec(conn)).
// A request's payloads stay available to the server until its reply arrives,
// a reply cannot be read (the server went away, or sent what does not
// parse: net/rpc then fails every pending call), the codec closes, or the
// outbox's lease ends; Close also ends the pulls of a reply under way.
// opts (the receive allocator, limits) apply to this codec alone; without
// them it follows Register's.
func NewClientCodec(rwc io.ReadWriteCloser, opts ...Option) rpc.ClientCodec {
	return &clientCodec{netrpcConn: newNetRPCConn(rwc, opts, 0), held: map[uint64]*hold{}}
}

type clientCodec struct {
	netrpcConn
	mu     sync.Mutex
	held   map[uint64]*hold // by seq: the payloads of requests not answered yet
	closed bool
	// readDone: a reply could not be read, and net/rpc reads no more: no
	// request written from then on can get its reply.
	readDone bool
	// pruneHeld is the count of held requests past which those whose
	// payloads all left the outbox (their lease ended) are forgotten: a
	// server that answers a seq before its request was written (net/rpc
	// registers the call first) leaves that request's hold unanswered.
	pruneHeld int
}

// WriteRequest files the request's hold before it writes: the reply may be
// read before the write returns. net/rpc's Client.Close may run meanwhile:
// a request written after Close holds nothing.
func (c *clientCodec) WriteRequest(r *rpc.Request, body any) error {
	h := &hold{}
	c.mu.Lock()
	_, dup := c.held[r.Seq]
	closed, readDone := c.closed, c.readDone
	if !closed && !readDone && !dup {
		c.held[r.Seq] = h
		if len(c.held) >= max(c.pruneHeld, maxNoted) {
			maps.DeleteFunc(c.held, func(_ uint64, h *hold) bool { return h.gone() })
			c.pruneHeld = 2 * len(c.held)
		}
	}
	c.mu.Unlock()
	switch {
	case closed:
		return fmt.Errorf("gdrcodec: net/rpc client codec: %w", net.ErrClosed)
	case readDone:
		return errors.New("gdrcodec: net/rpc client codec: replies can no longer be read")
	case dup:
		return fmt.Errorf("gdrcodec: net/rpc request with seq %d while an earlier one with that seq is not answered yet", r.Seq)
	}
	err := c.write(r.Seq, r.ServiceMethod, "", body, h)
	if err != nil || !h.keeps() {
		// Failed, or nothing to keep for the reply.
		c.mu.Lock()
		if c.held[r.Seq] == h {
			delete(c.held, r.Seq)
		}
		c.mu.Unlock()
		h.release()
	}
	return err
}

func (c *clientCodec) ReadResponseHeader(r *rpc.Response) error {
	seq, method, errMsg, err := c.readHeader()
	if err != nil {
		c.readingEnded()
		return err
	}
	r.Seq, r.ServiceMethod, r.Error = seq, method, errMsg
	c.mu.Lock()
	h := c.held[seq]
	delete(c.held, seq)
	c.mu.Unlock()
	if h != nil {
		h.release()
	}
	return nil
}

func (c *clientCodec) ReadResponseBody(body any) error {
	err := c.readBody(body)
	if err != nil {
		c.readingEnded()
	}
	return err
}

// readingEnded gives back the payloads of every call still waiting for its
// reply: net/rpc's Client reads nothing after a header or body it could not
// read, and fails those calls, but closes the codec only when the
// application closes the Client.
func (c *clientCodec) readingEnded() {
	c.mu.Lock()
	held := c.held
	c.held, c.readDone = map[uint64]*hold{}, true
	c.mu.Unlock()
	for _, h := range held {
		h.release()
	}
}

func (c *clientCodec) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.readingEnded()
	return c.close()
}

// NewServerCodec returns a net/rpc server codec over rwc (a conn accepted from
// a gdrpc listener): rpc.ServeCodec(gdrcodec.NewServerCodec(conn)). A request's
// buffers are released once its reply is written, the reply's once sent (the
// outbox keeps its own reference until the client pulled it); a method that
// keeps a received buffer takes it with Detach. A request whose seq is that
// of one not answered yet ends the connection, once the replies of the
// requests before it are written. At most DefaultNetRPCPending requests
// (WithNetRPCPending) wait for their replies at once; the next is read once
// a reply is written. A body frame over DefaultNetRPCMaxBody
// (WithNetRPCMaxBody) ends the connection. A method that returns an error
// releases what it attached to its reply itself: net/rpc then writes no
// reply body, and the codec never sees it. A reply's payload that landed in
// receive space the client advertised goes back when the client decodes it
// and releases it; net/rpc has no end of a call to say so otherwise, so a
// client that decodes the reply into a type without the payload's field (or
// skips the reply) leaves its range taken until the session ends, after which
// later replies are pulled. opts apply to this codec alone; without them it
// follows Register's.
func NewServerCodec(rwc io.ReadWriteCloser, opts ...Option) rpc.ServerCodec {
	c := &serverCodec{netrpcConn: newNetRPCConn(rwc, opts, DefaultNetRPCWriteTimeout), args: map[uint64]any{}, sizes: map[uint64]int64{}}
	c.countDecoded = true
	c.replied = sync.NewCond(&c.mu)
	return c
}

type serverCodec struct {
	netrpcConn
	mu  sync.Mutex
	seq uint64 // of the request whose body is next
	// refused is why a request header was refused; every later read
	// returns it too (the refused request's body was never read).
	refused error
	// args holds, by seq, every request whose reply is not written yet: its
	// received message, released with the reply (nil until its body is
	// decoded, and for a body that is not a message).
	args map[uint64]any
	// sizes are the lengths of the requests of args (bodies and payloads),
	// by seq, and held their sum: what WithNetRPCPendingBytes bounds.
	sizes map[uint64]int64
	held  int64
	// replied is signalled when a reply is written or the codec closes:
	// ReadRequestHeader waits on it while as many requests as the bound
	// (WithNetRPCPending) wait for their replies.
	replied *sync.Cond
	closed  bool
	// writing counts the replies being written: their requests left args
	// (a client that has a reply may send its seq again) but still count
	// towards the pending bounds until the reply is written.
	writing int
}

// ReadRequestHeader refuses a request whose seq is that of one not answered
// yet: net/rpc and its client tell replies apart by seq alone, so the first
// reply would release the second request's buffers while its handler still
// runs. The error ends the connection (net/rpc reads no further request,
// waits for the replies of those it started, then closes the codec) before
// the duplicate's body is read: nothing of it is pulled.
func (c *serverCodec) ReadRequestHeader(r *rpc.Request) error {
	if c.refused != nil {
		return c.refused
	}
	c.mu.Lock()
	n, b := c.c.options().netRPCPending(), c.c.options().netRPCPendingBytes()
	for !c.closed && (n > 0 && len(c.args)+c.writing >= n || b > 0 && c.held >= b && len(c.args)+c.writing > 0) {
		c.replied.Wait()
	}
	c.mu.Unlock()
	seq, method, _, err := c.readHeader()
	if err != nil {
		return err
	}
	c.mu.Lock()
	_, outstanding := c.args[seq]
	if !outstanding {
		c.args[seq] = nil
	}
	c.mu.Unlock()
	if outstanding {
		c.refused = fmt.Errorf("gdrcodec: net/rpc request with seq %d while an earlier one with that seq is not answered yet", seq)
		return c.refused
	}
	r.Seq, r.ServiceMethod = seq, method
	c.seq = seq
	return nil
}

func (c *serverCodec) ReadRequestBody(body any) error {
	err := c.readBody(body)
	if n := int64(c.bodyLen); n > 0 {
		// Held until the reply, which net/rpc writes whatever the read gave.
		c.mu.Lock()
		if _, ok := c.args[c.seq]; ok {
			c.sizes[c.seq] = n
			c.held += n
		}
		c.mu.Unlock()
	}
	if err != nil {
		return err
	}
	if m := messageV2Of(body); m != nil {
		c.mu.Lock()
		c.args[c.seq] = m
		c.mu.Unlock()
	}
	return nil
}

func (c *serverCodec) WriteResponse(r *rpc.Response, body any) error {
	if r.Error != "" {
		body = nil
	}
	// A request's method name may fill its header frame, leaving the reply
	// no room: net/rpc's client matches a reply by seq alone, so the name
	// it echoes is cut rather than the reply refused (its caller would wait
	// for ever: net/rpc drops a reply's write error).
	method := truncate(r.ServiceMethod, headerRoom/2)
	var s *transport.Session
	if nc, ok := c.rwc.(net.Conn); ok {
		s = transport.SessionOf(nc)
	}
	m := messageV2Of(body)
	var reply *callMessages // what the reply's marshal wrote into the client's receive space
	if m != nil {
		// The reply's payloads may land in receive space the client
		// advertised. A reply refused before any of it went out gives
		// those ranges back; one whose write failed on the way leaves
		// them taken until the session ends (the conn failed with it, and
		// the client may hold what it read).
		reply = &callMessages{}
		bindTo(c.ctx, s, reply, m)
	}
	// The request leaves args before any byte of its reply goes: a client
	// that has the reply may send its seq again at once. Its size stays
	// counted until the reply is written.
	c.mu.Lock()
	args, size := c.args[r.Seq], c.sizes[r.Seq]
	delete(c.args, r.Seq)
	delete(c.sizes, r.Seq)
	c.writing++
	c.mu.Unlock()
	err := c.write(r.Seq, method, r.Error, body, nil)
	takeDestination(m) // not marshaled: forget it
	var refused unwritten
	if m != nil {
		// Payloads offered to be pulled leave the outbox with the last
		// session to the client, or at once when nobody got the reply.
		if err != nil {
			notSent(m)
		} else {
			sentOver(s, m)
		}
		if errors.As(err, &refused) {
			reply.mu.Lock()
			landed := reply.landed[m]
			reply.mu.Unlock()
			landed.reclaim()
		}
	}
	if errors.As(err, &refused) && body != nil {
		// net/rpc drops a reply's write error, and its client would wait
		// for this seq for ever: it gets the error instead, in a reply
		// without a body.
		err = c.write(r.Seq, method, "gdrcodec: the reply could not be sent: "+refused.err.Error(), nil, nil)
	}
	c.mu.Lock()
	c.held -= size
	c.writing--
	c.replied.Signal() // one reader waits, at most
	c.mu.Unlock()
	for _, v := range []any{args, body} {
		if m := messageV2Of(v); m != nil {
			ReleaseAll(m)
		}
	}
	return err
}

func (c *serverCodec) Close() error {
	c.mu.Lock()
	c.closed = true
	c.replied.Broadcast()
	c.mu.Unlock()
	return c.close()
}
