package transport

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
)

// errSpokeEarly refuses a connection that sent data before this side
// answered it; errEndedEarly one that ended or failed meanwhile.
var (
	errSpokeEarly = errors.New("the peer sent data before it was answered")
	errEndedEarly = errors.New("the connection ended before it was answered")
)

// silence watches a connection that must send nothing until this side
// answers it: a UCX endpoint after its token, whose client waits for the
// ack. UCX's stream has no flow control of its own, so what a peer sends to
// an endpoint nobody reads piles up in this process's memory; a byte (or
// the end, or a failure) breaks the silence, and the endpoint is aborted.
type silence struct {
	c       net.Conn
	gone    chan struct{} // closed once the watch's read returned
	silent  bool          // the read ended at stop's deadline, with nothing; set before gone closes
	spoke   bool          // the read returned data; set before gone closes
	stopped bool          // stop ran: c is read no more
}

// watchSilence starts watching c: a read of one byte, which stop's deadline
// ends.
func watchSilence(c net.Conn) *silence {
	q := &silence{c: c, gone: make(chan struct{})}
	go func() {
		defer close(q.gone)
		var b [1]byte
		n, err := c.Read(b[:])
		var ne net.Error
		q.spoke = n > 0
		q.silent = n == 0 && errors.As(err, &ne) && ne.Timeout()
	}()
	return q
}

// broken is closed once the watch's read returned: c sent something,
// ended, failed, or its deadline passed. Nil for no watch.
func (q *silence) broken() <-chan struct{} {
	if q == nil {
		return nil
	}
	return q.gone
}

// stop ends the watch, leaving c with no read deadline, and reports whether
// c stayed silent (true for no watch).
func (q *silence) stop() bool {
	if q == nil {
		return true
	}
	interruptRead(q.c, q.gone)
	q.stopped = true
	return q.silent
}

// err is why a broken silence refuses c (after stop or broken).
func (q *silence) err() error {
	if q.spoke {
		return errSpokeEarly
	}
	return errEndedEarly
}

// refuseLinger bounds how long a refused UCX endpoint is given to read its
// answer and go.
const refuseLinger = 2 * time.Second

// refuse answers c with ack and lets it go. A UCX endpoint, watched by q
// (or by a watch of its own where q is nil or stopped), is closed once its
// peer went, as a client told no does, and the answer reached it; one that
// sends instead, or stays past refuseLinger, is aborted: what it sends
// would pile up in UCX while a close lingered. An abort right after the
// answer could drop the answer. Other conns are closed.
func refuse(c net.Conn, ack byte, q *silence) {
	_, _ = c.Write([]byte{ack})
	if !isEndpoint(c) {
		_ = c.Close()
		return
	}
	if q == nil || q.stopped {
		q = watchSilence(c)
	}
	t := time.NewTimer(refuseLinger)
	defer t.Stop()
	select {
	case <-q.broken():
	case <-t.C:
	}
	if !q.stop() && !q.spoke {
		_ = c.Close() // the peer went: no linger
		return
	}
	abortConn(c)
}

// abortConn closes c at once where it is a UCX endpoint, dropping what it
// holds (Abort), and as usual otherwise.
func abortConn(c net.Conn) {
	if ep, ok := c.(*rdma.Endpoint); ok {
		_ = ep.Abort()
		return
	}
	_ = c.Close()
}

// maxEarly bounds what a client may send on its UCX endpoint between the
// ack and the server's reading of its choice of UCX on the bootstrap
// connection: an honest client sends there only the start of its session
// (yamux's first frames, the streams' first bytes, each stream within
// yamux's initial window of 256 KiB), right after its choice.
const maxEarly = 4 << 20

// errFloodedEarly refuses a UCX endpoint whose client sent more than
// maxEarly bytes before its session started.
var errFloodedEarly = fmt.Errorf("the client sent more than %d bytes on its UCX endpoint before its session started", maxEarly)

// early reads what a client sends on its UCX endpoint between the ack and
// the session's start, which would otherwise pile up unread (UCX's stream
// has no flow control): past maxEarly it aborts the endpoint.
type early struct {
	c    net.Conn
	buf  []byte
	err  error // why the reads ended, unless stop ended them
	gone chan struct{}
}

func readEarly(c net.Conn) *early {
	e := &early{c: c, gone: make(chan struct{})}
	go func() {
		defer close(e.gone)
		var b [64 << 10]byte
		for {
			n, err := c.Read(b[:])
			e.buf = append(e.buf, b[:n]...)
			if len(e.buf) > maxEarly {
				e.err = errFloodedEarly
				abortConn(c)
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return // stop's deadline
			}
			if err != nil {
				e.err = err
				return
			}
		}
	}()
	return e
}

// stop ends the reads, leaving c with no read deadline, and returns what
// they took, which the session reads first, or why c is no longer usable.
func (e *early) stop() ([]byte, error) {
	interruptRead(e.c, e.gone)
	return e.buf, e.err
}

// interruptRead ends the read of c that a goroutine runs until gone closes,
// by a deadline in the past, and leaves c with no read deadline.
func interruptRead(c net.Conn, gone <-chan struct{}) {
	_ = c.SetReadDeadline(time.Unix(1, 0))
	<-gone
	_ = c.SetReadDeadline(time.Time{})
}
