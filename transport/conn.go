package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"
)

// Stream and lane roles: the first byte the opener writes on a new stream,
// the last of a lane's request (lane.go). 'W' names a lane only.
const (
	roleGRPC    = 'G' // the one stream gRPC runs on, opened by the client
	roleControl = 'C' // the one control stream, opened by the client after the handshake
	roleBulk    = 'B' // bulk streams, opened by either side
	roleWide    = 'W' // the wide lane: large bulk transfers over TCP on a UCX session between hosts (lane.go)
)

// Addr is the address of a conn a session hands out. Network() is
// "gdrpc+ucx" or "gdrpc+tcp"; String() is the address of the underlying
// connection.
type Addr struct {
	Transport string   // "ucx" or "tcp"
	Under     net.Addr // the address of the underlying connection
	session   *Session
}

// Network returns "gdrpc+" and the transport.
func (a *Addr) Network() string { return "gdrpc+" + a.Transport }

func (a *Addr) String() string {
	if a == nil || a.Under == nil {
		return "<nil>"
	}
	return a.Under.String()
}

// TimeoutError is returned when a deadline passes. It is a net.Error with
// Timeout() true and unwraps to os.ErrDeadlineExceeded.
type TimeoutError struct{ Op string }

func (e *TimeoutError) Error() string   { return e.Op + ": i/o timeout" }
func (e *TimeoutError) Timeout() bool   { return true }
func (e *TimeoutError) Temporary() bool { return true }
func (e *TimeoutError) Unwrap() error   { return os.ErrDeadlineExceeded }

var _ net.Error = (*TimeoutError)(nil)

// ErrStreamReset reports that the peer reset a stream.
var ErrStreamReset = errors.New("gdrpc: stream reset by peer")

// connCommon is what the conns a session hands out (streamConn, laneConn)
// share: their session, role and addresses, and the closed state after which
// every call fails with an error wrapping net.ErrClosed.
type connCommon struct {
	sess        *Session
	role        byte
	local, peer net.Addr
	closed      atomic.Bool
	closeOnce   sync.Once
}

func newConnCommon(s *Session, role byte) connCommon {
	return connCommon{
		sess:  s,
		role:  role,
		local: &Addr{Transport: s.transport, Under: s.localAddr, session: s},
		peer:  &Addr{Transport: s.transport, Under: s.remoteAddr, session: s},
	}
}

func (c *connCommon) opErr(op string, err error) error {
	return &net.OpError{Op: op, Net: c.local.Network(), Source: c.local, Addr: c.peer, Err: err}
}

// closeOnceWith marks the conn closed and runs closeConn, once; closing the
// gRPC stream then closes the session too, after the peer got what was
// written (see Session.closeGracefully).
func (c *connCommon) closeOnceWith(closeConn func()) {
	c.closeOnce.Do(func() {
		c.closed.Store(true)
		closeConn()
		if c.role == roleGRPC {
			c.sess.closeGracefully()
		}
	})
}

// open reports the error a call on a closed conn returns, or nil.
func (c *connCommon) open(op string) error {
	if c.closed.Load() {
		return c.opErr(op, net.ErrClosed)
	}
	return nil
}

func (c *connCommon) LocalAddr() net.Addr  { return c.local }
func (c *connCommon) RemoteAddr() net.Addr { return c.peer }

// Session returns the session the conn belongs to.
func (c *connCommon) Session() *Session { return c.sess }

// streamConn is a yamux stream with gdrpc's error semantics: deadlines in the
// past fail at once, timeouts are *TimeoutError, and after Close every call
// fails with an error wrapping net.ErrClosed.
type streamConn struct {
	connCommon
	st       *yamux.Stream
	rdl, wdl atomic.Int64 // deadlines in UnixNano, 0 for none
}

var _ net.Conn = (*streamConn)(nil)

func newStreamConn(s *Session, st *yamux.Stream, role byte) *streamConn {
	return &streamConn{connCommon: newConnCommon(s, role), st: st}
}

func past(dl int64) bool { return dl != 0 && time.Now().UnixNano() >= dl }

func (c *streamConn) Read(b []byte) (int, error) {
	if err := c.open("read"); err != nil {
		return 0, err
	}
	if past(c.rdl.Load()) {
		return 0, c.opErr("read", &TimeoutError{Op: "read"})
	}
	n, err := c.st.Read(b)
	if err != nil {
		err = c.mapErr("read", err)
	}
	return n, err
}

func (c *streamConn) Write(b []byte) (int, error) {
	if err := c.open("write"); err != nil {
		return 0, err
	}
	if past(c.wdl.Load()) {
		return 0, c.opErr("write", &TimeoutError{Op: "write"})
	}
	n, err := c.st.Write(b)
	if err != nil {
		err = c.mapErr("write", err)
	}
	return n, err
}

// mapErr turns a yamux error into ours.
func (c *streamConn) mapErr(op string, err error) error {
	if err == io.EOF {
		// yamux reports a dying session as EOF; only a peer that ended the
		// session cleanly gives a clean EOF.
		if serr := c.sess.Err(); serr != nil && serr != ErrPeerGone && !c.closed.Load() {
			return c.opErr(op, c.sess.closedErr())
		}
		return err
	}
	if c.closed.Load() {
		return c.opErr(op, net.ErrClosed)
	}
	switch {
	case errors.Is(err, yamux.ErrTimeout):
		return c.opErr(op, &TimeoutError{Op: op})
	case errors.Is(err, yamux.ErrSessionShutdown):
		return c.opErr(op, c.sess.closedErr())
	case errors.Is(err, yamux.ErrConnectionWriteTimeout):
		// The connection took no data for the keepalive timeout: the peer is
		// as good as dead, and the keepalive could not get a ping out either.
		c.sess.closeWith(fmt.Errorf("%w: writes to the connection blocked for %v", ErrPeerGone, c.sess.cfg.kaTimeout))
		return c.opErr(op, c.sess.closedErr())
	case errors.Is(err, yamux.ErrConnectionReset):
		return c.opErr(op, ErrStreamReset)
	case errors.Is(err, yamux.ErrStreamClosed):
		return c.opErr(op, fmt.Errorf("gdrpc: stream closed: %w", net.ErrClosed))
	}
	return c.opErr(op, err)
}

// Close closes the stream. Closing the gRPC stream closes its session too,
// after the peer got what was written (see Session.closeGracefully).
func (c *streamConn) Close() error {
	c.closeOnceWith(func() {
		// Wake a blocked Read: yamux's Close only half-closes, and its Read
		// keeps waiting for data.
		_ = c.st.SetReadDeadline(time.Unix(1, 0))
		_ = c.st.Close()
	})
	return nil
}

// CloseWrite ends this side's writing: the peer reads io.EOF once it read
// what was written. Read goes on until the peer closes its side; Close ends
// the rest.
func (c *streamConn) CloseWrite() error {
	if err := c.open("close write"); err != nil {
		return err
	}
	if err := c.st.Close(); err != nil {
		return c.mapErr("close write", err)
	}
	return nil
}

func (c *streamConn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func (c *streamConn) SetReadDeadline(t time.Time) error {
	if err := c.open("set deadline"); err != nil {
		return err
	}
	c.rdl.Store(nanos(t))
	return c.st.SetReadDeadline(t)
}

func (c *streamConn) SetWriteDeadline(t time.Time) error {
	if err := c.open("set deadline"); err != nil {
		return err
	}
	c.wdl.Store(nanos(t))
	return c.st.SetWriteDeadline(t)
}

// SessionOf returns the session a conn handed out by this package belongs to,
// or nil (a raw plain HTTP/2 conn, or any other conn).
func SessionOf(c net.Conn) *Session {
	if c, ok := c.(interface{ Session() *Session }); ok {
		return c.Session()
	}
	return nil
}

// replayConn is a connection whose first bytes were read already (a raw TCP
// conn's, to tell gdrpc from HTTP/2; a UCX endpoint's, while nothing else
// read it: readEarly); it returns them again before reading on.
type replayConn struct {
	net.Conn
	mu  sync.Mutex
	buf []byte
}

func (c *replayConn) Read(b []byte) (int, error) {
	c.mu.Lock()
	if len(c.buf) > 0 {
		n := copy(b, c.buf)
		c.buf = c.buf[n:]
		c.mu.Unlock()
		return n, nil
	}
	c.mu.Unlock()
	return c.Conn.Read(b)
}

// underConn is the session's byte stream as yamux sees it. It records the
// first error of the underlying connection (the cause a session reports when
// it dies), and it coalesces each yamux data frame: yamux writes a frame's
// 12-byte header and its body in two Write calls, which over UCX would be two
// sends per message. Only yamux's send loop writes to it, one frame at a
// time, and a data header announcing n bytes is always followed by a Write of
// exactly those n bytes. On the read side it counts the peer's ping requests
// (see pings).
type underConn struct {
	net.Conn
	once sync.Once
	err  atomic.Pointer[error]

	hdr     [yamuxHeaderLen]byte
	pending bool   // hdr holds a data header whose body comes next
	scratch []byte // header+body of small frames
	tcp     bool   // the conn does vectored writes (net.Buffers)

	in pingCounter // only yamux's receive loop reads

	linger atomic.Int64 // Close lingers until then (Unix nanoseconds), if not 0
}

// lingerUntil makes Close linger (lingerClose) until t, and the multiplexer's
// reads end; the connection is a TCP one.
func (c *underConn) lingerUntil(t time.Time) { c.linger.Store(t.UnixNano()) }

// Close closes the connection, lingering if lingerUntil said so.
func (c *underConn) Close() error {
	if until := c.linger.Load(); until != 0 {
		return lingerClose(tcpOf(c.Conn), time.Unix(0, until))
	}
	return c.Conn.Close()
}

// tcpOf returns the TCP connection c is, or wraps as a replayConn; nil for
// any other (a UCX endpoint).
func tcpOf(c net.Conn) *net.TCPConn {
	if rc, ok := c.(*replayConn); ok {
		c = rc.Conn
	}
	tc, _ := c.(*net.TCPConn)
	return tc
}

// lingerClose closes c after its peer's end, until then at the latest: it
// ends this side's writes (the peer reads its end), then reads and drops
// whatever the peer still sends until the peer's end or until, and closes.
// A connection closed with bytes unread, or before bytes the peer sent
// meanwhile arrive, is answered by the kernel with a reset. Reads of other
// goroutines, under way or later, fail or take part of the bytes dropped.
// A timer closes c at until: a read deadline alone would not bound the
// wait, for another reader of c may set its own.
func lingerClose(c *net.TCPConn, until time.Time) error {
	if c.CloseWrite() == nil {
		t := time.AfterFunc(time.Until(until), func() { _ = c.Close() })
		defer t.Stop()
		if c.SetReadDeadline(until) == nil {
			_, _ = io.Copy(io.Discard, c)
		}
	}
	return c.Close()
}

// maxPeerPings is how many of the peer's ping requests a session holds
// unanswered. yamux answers each on a goroutine of its own, which waits up
// to the keepalive timeout to send the answer: a peer that sends pings and
// reads nothing would otherwise grow them without a bound. An honest peer
// has one ping out at a time, answered as soon as this side's writes go out.
const maxPeerPings = 256

// errPingFlood is the cause of a session whose peer sent more than
// maxPeerPings ping requests that are not answered yet.
var errPingFlood = fmt.Errorf("gdrpc: the peer sent more than %d keepalive pings that this side could not answer yet", maxPeerPings)

// Frame types and flags of yamux's header.
const (
	yamuxTypeData = 0
	yamuxTypePing = 2
	yamuxFlagSYN  = 1
	yamuxFlagACK  = 2
)

// pingCounter follows the frames of the peer's byte stream through whatever
// pieces it is read in, and counts the ping requests not answered yet.
type pingCounter struct {
	hdr  [yamuxHeaderLen]byte
	have int    // bytes of hdr read
	skip uint64 // bytes of a data frame's body still to pass

	unanswered atomic.Int64 // the receive loop adds, the send loop takes
}

// scan passes p, the next bytes of the stream, and reports a flood.
func (pc *pingCounter) scan(p []byte) error {
	for len(p) > 0 {
		if pc.skip > 0 {
			k := min(uint64(len(p)), pc.skip)
			pc.skip -= k
			p = p[k:]
			continue
		}
		k := copy(pc.hdr[pc.have:], p)
		pc.have += k
		p = p[k:]
		if pc.have < yamuxHeaderLen {
			return nil
		}
		pc.have = 0
		switch pc.hdr[1] {
		case yamuxTypeData:
			pc.skip = uint64(binary.BigEndian.Uint32(pc.hdr[8:]))
		case yamuxTypePing:
			if binary.BigEndian.Uint16(pc.hdr[2:])&yamuxFlagSYN == 0 {
				break // an answer to this side's ping
			}
			if pc.unanswered.Add(1) > maxPeerPings {
				return errPingFlood
			}
		}
	}
	return nil
}

// wrote notes a frame header this side wrote: the answer to a ping.
func (pc *pingCounter) wrote(hdr []byte) {
	if hdr[1] == yamuxTypePing && binary.BigEndian.Uint16(hdr[2:])&yamuxFlagACK != 0 {
		pc.unanswered.Add(-1)
	}
}

const (
	yamuxHeaderLen = 12
	// coalesceMax is the largest body copied next to its header; larger
	// bodies go out with a vectored write (TCP) or as a second send (UCX),
	// where the copy would cost more than the extra send.
	coalesceMax = 64 << 10
)

func newUnderConn(c net.Conn) *underConn {
	_, tcp := c.(*net.TCPConn)
	return &underConn{Conn: c, tcp: tcp}
}

func (c *underConn) record(err error) {
	if err != nil {
		c.once.Do(func() { c.err.Store(&err) })
	}
}

func (c *underConn) Read(b []byte) (int, error) {
	if c.linger.Load() != 0 {
		// Closing: what the peer still sends is lingerClose's to drop, not
		// the multiplexer's to hand to streams.
		return 0, net.ErrClosed
	}
	n, err := c.Conn.Read(b)
	if ferr := c.in.scan(b[:n]); ferr != nil {
		// The bytes read are dropped with the session: yamux's receive
		// loop ends on the error.
		c.record(ferr)
		return 0, ferr
	}
	c.record(err)
	return n, err
}

func (c *underConn) Write(b []byte) (int, error) {
	// A yamux data header (version 0, type 0) with a non-empty body: keep it
	// for the body's Write.
	if !c.pending && len(b) == yamuxHeaderLen && b[0] == 0 && b[1] == 0 && binary.BigEndian.Uint32(b[8:]) > 0 {
		copy(c.hdr[:], b)
		c.pending = true
		return len(b), nil
	}
	if !c.pending {
		if len(b) == yamuxHeaderLen {
			c.in.wrote(b)
		}
		n, err := c.Conn.Write(b)
		c.record(err)
		return n, err
	}
	c.pending = false
	if uint32(len(b)) != binary.BigEndian.Uint32(c.hdr[8:]) {
		// Not the body announced: never expected, but stay correct.
		if _, err := c.Conn.Write(c.hdr[:]); err != nil {
			c.record(err)
			return 0, err
		}
		n, err := c.Conn.Write(b)
		c.record(err)
		return n, err
	}
	var err error
	switch {
	case len(b) <= coalesceMax:
		buf := append(append(c.scratch[:0], c.hdr[:]...), b...)
		c.scratch = buf
		_, err = c.Conn.Write(buf)
	case c.tcp:
		bufs := net.Buffers{c.hdr[:], b}
		_, err = bufs.WriteTo(c.Conn)
	default:
		if _, err = c.Conn.Write(c.hdr[:]); err == nil {
			_, err = c.Conn.Write(b)
		}
	}
	if err != nil {
		c.record(err)
		return 0, err
	}
	return len(b), nil
}

func (c *underConn) firstErr() error {
	if p := c.err.Load(); p != nil {
		return *p
	}
	return nil
}
