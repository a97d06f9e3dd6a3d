//go:build cgo && !nordma

package rdma

/*
#include <stdlib.h>
#include "ucx.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"time"
	"unsafe"
)

const (
	ringInitial = 32 << 10 // first inbound buffer of an endpoint
	// ringLinger is how long a grown ring stays empty and unfilled before
	// the driver gives it back (shrinkRings): bursts a moment apart reuse it.
	ringLinger = time.Second
	ringMax    = 4 << 20 // inbound buffer above which draining UCX stops until Read catches up
	// drainMax bounds the inbound ring once the peer closed or failed, when
	// what it sent is taken out of UCX before the endpoint goes: past it the
	// rest is dropped and Read ends with errUnreadCut, not io.EOF. Readers
	// over flow control (yamux, HTTP/2, the bulk lanes) leave far less
	// unread; a peer that sends to an endpoint nobody reads cannot make its
	// close copy more than this into Go memory.
	drainMax    = 16 * ringMax
	smallWrite  = 64 << 10 // writes up to this size are copied and sent without waiting
	maxInflight = 4 << 20  // copied bytes in flight per endpoint before Write waits
	directRead  = 32 << 10 // Reads from this size wait with their buffer posted for a direct copy (gRPC's reads of a lane are 32 KiB)
)

// errUnreadCut ends the reads of an endpoint whose peer closed it with more
// unread than the endpoint keeps (drainMax): what came after was dropped.
var errUnreadCut = fmt.Errorf("rdma: peer closed the endpoint with more than %d MiB unread; the rest was dropped", drainMax>>20)

// drain moves received stream data from UCX into the inbound ring (worker
// lock held). Unless all is set it stops when the ring reaches ringMax; with
// all it stops at drainMax, noting the cut.
func (e *Endpoint) drain(all bool) {
	if e.ce == nil || e.ucpClosed {
		return
	}
	for {
		e.mu.Lock()
		e.drainReq = false
		if e.local || e.cut || e.finished {
			// Closed here, cut, or finished by the peer: what the reader
			// gets ends where the close, the cut or the FIN was made.
			e.mu.Unlock()
			return
		}
		if e.n == 0 && e.rfill < len(e.rbuf) {
			// A Read waits with its own buffer: fill it directly (Go memory
			// passed for the call; the reader waits for rbusy to clear).
			buf := e.rbuf[e.rfill:]
			e.rbusy = true
			e.mu.Unlock()
			more := e.streamRead(buf, func(k int) {
				e.rfill += k
				e.rbusy = false
				e.rcond.Broadcast()
			})
			if !more {
				return
			}
			continue
		}
		if e.n == len(e.in) {
			size := max(2*len(e.in), ringInitial)
			if size > ringMax && !all {
				e.stalled = true
				e.mu.Unlock()
				return
			}
			if size > drainMax {
				e.cut = true
				e.mu.Unlock()
				return
			}
			e.grow(size)
			if size > ringInitial {
				if e.w.grown == nil {
					e.w.grown = map[*Endpoint]struct{}{}
				}
				e.w.grown[e] = struct{}{}
			}
		}
		var buf []byte
		if end := e.head + e.n; end < len(e.in) {
			buf = e.in[end:]
		} else {
			buf = e.in[end-len(e.in) : e.head]
		}
		e.mu.Unlock()
		// C writes only the free part of the ring; Read copies out only the
		// filled part, under mu, after n says it is filled.
		more := e.streamRead(buf, func(k int) {
			e.n += k
			e.stalled = false
			if len(e.in) > ringInitial {
				e.filledAt = time.Now()
			}
		})
		if !more {
			return
		}
	}
}

// streamRead copies received stream data into buf (mu not held), records the
// k bytes copied with mu held, wakes a Read if any came, and reports whether
// UCX has more.
func (e *Endpoint) streamRead(buf []byte, record func(k int)) bool {
	var more C.int
	k := int(C.rdma_stream_read(e.ce, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), &more))
	e.mu.Lock()
	record(k)
	e.mu.Unlock()
	if k > 0 {
		notify(e.rnotify)
	}
	return more != 0
}

// shrinkRings gives back the inbound rings that grew past ringInitial and
// have been empty for ringLinger, and those of closed endpoints, whose data
// nobody reads any more, as the driver goes idle (w.mu held, so no drain
// fills one): a burst grows an endpoint's ring up to ringMax, which it kept
// for its life (4 MiB of a UCX session's gRPC lane after one stream of 1 MiB
// messages). The next data gets a ring of ringInitial.
func (w *Worker) shrinkRings(now time.Time) {
	for e := range w.grown {
		e.mu.Lock()
		switch {
		case len(e.in) <= ringInitial:
			delete(w.grown, e)
		case e.local || e.n == 0 && now.Sub(e.filledAt) >= ringLinger:
			e.in, e.head, e.n = nil, 0, 0
			delete(w.grown, e)
		}
		e.mu.Unlock()
	}
}

// grow runs with mu held.
func (e *Endpoint) grow(size int) {
	b := make([]byte, size)
	k := e.copyOut(b)
	e.in, e.head, e.n = b, 0, k
}

// copyOut runs with mu held.
func (e *Endpoint) copyOut(p []byte) int {
	k := 0
	for k < len(p) && e.n > 0 {
		end := min(e.head+e.n, len(e.in))
		c := copy(p[k:], e.in[e.head:end])
		k += c
		e.head += c
		e.n -= c
		if e.head == len(e.in) {
			e.head = 0
		}
	}
	// head is not reset when the ring empties: the worker may be filling the
	// free part at head+n outside mu.
	return k
}

// Read reads stream data. It honours the read deadline; it never posts a
// receive to UCX, so a deadline strands nothing. After the peer closed it
// returns what arrived and then io.EOF; after a failure, what arrived and then
// the *EndpointError.
func (e *Endpoint) Read(p []byte) (int, error) {
	e.rmu.Lock()
	defer e.rmu.Unlock()
	for {
		e.mu.Lock()
		if k := e.retract(); k > 0 {
			e.mu.Unlock()
			return k, nil
		}
		if e.local {
			e.mu.Unlock()
			return 0, closedError("read")
		}
		if e.n > 0 && len(p) > 0 {
			k := e.copyOut(p)
			kick := e.stalled && !e.drainReq
			if kick {
				e.drainReq = true
			}
			e.mu.Unlock()
			if kick {
				e.w.submit(func() { e.drain(false) })
			}
			return k, nil
		}
		if e.term != nil {
			term, eof := e.term, e.eof
			e.mu.Unlock()
			if eof {
				return 0, io.EOF
			}
			return 0, term
		}
		if len(p) == 0 {
			e.mu.Unlock()
			return 0, nil
		}
		dl := e.rdl.wait()
		if isClosed(dl) {
			e.mu.Unlock()
			return 0, &timeoutError{op: "read"}
		}
		if len(p) >= directRead {
			// The ring is empty: let the worker copy straight into p.
			e.rbuf, e.rfill = p, 0
		}
		e.mu.Unlock()
		select {
		case <-e.rnotify:
		case <-dl:
		case <-e.done:
		}
	}
}

// retract takes back the buffer a Read posted (mu held): it waits out a copy
// in progress and returns how many bytes the worker put there.
func (e *Endpoint) retract() int {
	if e.rbuf == nil {
		return 0
	}
	for e.rbusy {
		e.rcond.Wait()
	}
	k := e.rfill
	e.rbuf, e.rfill = nil, 0
	return k
}

// Write sends all of p on the stream or returns an error. It honours the
// write deadline. Up to 64 KiB are copied and sent without waiting (at most
// 4 MiB in flight); larger writes are pinned and wait for UCX to complete.
// UCX cannot take back a send under way, so a larger write that times out
// ends the endpoint (how much of p the peer got is unknown: the stream is
// broken) and returns once UCX no longer reads p.
func (e *Endpoint) Write(p []byte) (int, error) {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	if err := e.termErr(); err != nil {
		return 0, err
	}
	dl := e.wdl.wait()
	if isClosed(dl) {
		return 0, &timeoutError{op: "write"}
	}
	if len(p) == 0 {
		return 0, nil
	}
	if len(p) <= smallWrite {
		return e.writeCopy(p, dl)
	}
	var pin runtime.Pinner
	pin.Pin(&p[0])
	buf, n := uintptr(unsafe.Pointer(&p[0])), len(p)
	res := make(chan error, 1)
	err := e.w.submit(func() {
		e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
			return C.rdma_stream_send(e.w.cw, ce, C.uintptr_t(buf), C.size_t(n), id, req)
		}, func(st int) {
			pin.Unpin()
			err := e.opError("ucp_stream_send_nbx", st)
			if err != nil {
				e.sendFailed(err)
			}
			res <- err
		})
	})
	if err != nil {
		pin.Unpin()
		return 0, err
	}
	sent := func(err error) (int, error) {
		if err != nil {
			return 0, err
		}
		return len(p), nil
	}
	select {
	case err := <-res:
		return sent(err)
	case <-dl:
		select {
		case err := <-res: // it completed meanwhile
			return sent(err)
		default:
		}
		e.fail(errWriteCut, false)
		_ = e.w.submit(e.forceClose) // completes the send, with an error
		e.awaitEnded(res)
		return 0, &timeoutError{op: "write"}
	case <-e.done:
		// The endpoint's close or failure completes the send (a graceful
		// close flushes it first, and then all of p went).
		if err, ok := e.awaitEnded(res); ok && err == nil {
			return len(p), nil
		}
		return 0, e.termErr()
	}
}

// errWriteCut is why an endpoint ended whose large write timed out with its
// send under way.
var errWriteCut = errors.New("rdma: the stream broke: a write timed out while UCX was sending it")

func (e *Endpoint) writeCopy(p []byte, dl chan struct{}) (int, error) {
	for {
		e.mu.Lock()
		if e.term != nil || e.local {
			e.mu.Unlock()
			return 0, e.termErr()
		}
		if e.inflight == 0 || e.inflight+len(p) <= maxInflight {
			e.inflight += len(p)
			e.mu.Unlock()
			break
		}
		e.mu.Unlock()
		select {
		case <-e.wnotify:
		case <-dl:
			return 0, &timeoutError{op: "write"}
		case <-e.done:
		}
	}
	n := len(p)
	cbuf := C.malloc(C.size_t(n))
	copy(unsafe.Slice((*byte)(cbuf), n), p)
	err := e.w.submit(func() {
		e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
			return C.rdma_stream_send(e.w.cw, ce, C.uintptr_t(uintptr(cbuf)), C.size_t(n), id, req)
		}, func(st int) {
			C.free(cbuf)
			e.mu.Lock()
			e.inflight -= n
			e.mu.Unlock()
			notify(e.wnotify)
			if err := e.opError("ucp_stream_send_nbx", st); err != nil {
				e.sendFailed(err)
			}
		})
	})
	if err != nil {
		C.free(cbuf)
		e.mu.Lock()
		e.inflight -= n
		e.mu.Unlock()
		return 0, err
	}
	return n, nil
}

// sendFailed: a stream send failed without the endpoint failing first; the
// stream has lost bytes, so the endpoint is over (worker lock held).
func (e *Endpoint) sendFailed(err error) {
	var se *StatusError
	if errors.As(err, &se) {
		e.fail(newEndpointError(se.Op, se.Status, se.Msg), false)
	}
	e.forceClose()
}

// SetDeadline sets the read and write deadlines.
func (e *Endpoint) SetDeadline(t time.Time) error {
	if err := e.SetReadDeadline(t); err != nil {
		return err
	}
	return e.SetWriteDeadline(t)
}

// SetReadDeadline sets the deadline for pending and future Reads.
func (e *Endpoint) SetReadDeadline(t time.Time) error {
	if e.isLocalClosed() {
		return closedError("set deadline")
	}
	e.rdl.set(t)
	return nil
}

// SetWriteDeadline sets the deadline for pending and future Writes.
func (e *Endpoint) SetWriteDeadline(t time.Time) error {
	if e.isLocalClosed() {
		return closedError("set deadline")
	}
	e.wdl.set(t)
	return nil
}
