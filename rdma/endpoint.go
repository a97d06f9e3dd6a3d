//go:build cgo && !nordma

package rdma

/*
#include <stdlib.h>
#include "ucx.h"
*/
import "C"

import (
	"net"
	"sync"
	"time"
	"unsafe"
)

// Endpoint is a connection to a peer worker: a net.Conn over the UCX byte
// stream, and the origin of one-sided puts and gets into the peer's memory.
type Endpoint struct {
	w            *Worker
	id           uint64
	laddr, raddr *Addr
	marked       <-chan struct{} // accepted: closed once its descriptors are close-on-exec

	// lock-only: the worker's lock guards it
	ce        *C.rdma_ep_t // nil once released
	closing   bool         // graceful close started
	ucpClosed bool         // force close issued
	rkeys     map[*RemoteKey]struct{}
	key       string    // pairKey it is listed under in the worker's ends
	pair      *Endpoint // the peer's endpoint when it is on this worker
	finAcks   int       // FIN-ACKs issued: one at most, whatever number of FINs the peer sends

	mu       sync.Mutex
	in       []byte // inbound ring
	head, n  int
	rbuf     []byte // a waiting Read's buffer the worker may fill directly
	rfill    int    // bytes the worker put in rbuf
	rbusy    bool   // the worker is copying into rbuf outside mu
	rcond    sync.Cond
	stalled  bool // draining stopped: the ring is full
	cut      bool // the peer closed with more unread than drainMax: the rest was dropped
	finished bool // the peer's FIN came: what it sends after is dropped, never read
	drainReq bool // a drain is queued
	term     error
	eof      bool      // term: the peer closed; Read returns io.EOF
	local    bool      // Close was called
	filledAt time.Time // when data last went into a grown inbound ring (shrinkRings)
	peerErr  error
	inflight int
	onErr    func(error)
	errFired bool
	lanes    string    // TransportInfo once it showed lanes to the peer (KeyDomains)
	lanesAt  time.Time // when lanes was read
	rmaDoms  []string  // rmaDomains(lanes), once asked

	done      chan struct{}
	closeDone chan struct{} // the UCX endpoint is released
	rnotify   chan struct{}
	wnotify   chan struct{}
	rmu, wmu  sync.Mutex
	rdl, wdl  deadline
	closeOnce sync.Once
}

var _ net.Conn = (*Endpoint)(nil)

// newEndpoint runs with the worker's lock held.
func newEndpoint(w *Worker) *Endpoint {
	e := &Endpoint{
		w:         w,
		id:        w.newID(),
		rkeys:     map[*RemoteKey]struct{}{},
		done:      make(chan struct{}),
		closeDone: make(chan struct{}),
		rnotify:   make(chan struct{}, 1),
		wnotify:   make(chan struct{}, 1),
	}
	e.rcond.L = &e.mu
	e.rdl.cancel = make(chan struct{})
	e.wdl.cancel = make(chan struct{})
	return e
}

// attach runs with the worker's lock held.
func (e *Endpoint) attach(ce *C.rdma_ep_t) {
	e.ce = ce
	e.w.eps[e.id] = e
	e.w.epByH[e.handle()] = e
	live.endpoints.Add(1)
	if e.w.share != nil {
		e.w.share.add(e.w)
	}
	e.w.unpaired++
	e.queryAddrs()
	e.pairUp()
}

// handle is the address of e's UCX endpoint, by which FIN and FIN-ACK events
// name it (worker lock held; 0 once released).
func (e *Endpoint) handle() uintptr {
	if e.ce == nil {
		return 0
	}
	return uintptr(unsafe.Pointer(e.ce.ep))
}

// issue starts a request on this endpoint (worker lock held); once the UCX
// endpoint is gone, done gets UCS_ERR_CANCELED.
func (e *Endpoint) issue(call func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int, done func(int)) {
	if e.ce == nil || e.ucpClosed {
		done(statusCanceled)
		return
	}
	ce := e.ce
	e.w.issue(func(id C.uint64_t, req *unsafe.Pointer) C.int { return call(ce, id, req) }, done)
}

func (e *Endpoint) waitReleased() {
	t := time.NewTimer(forceTimeout)
	defer t.Stop()
	select {
	case <-e.closeDone:
	case <-e.w.exited:
	case <-t.C:
	}
}

// fail ends the endpoint with err unless it already ended.
func (e *Endpoint) fail(err error, fromPeer bool) {
	e.setTerm(err, false, fromPeer)
}

// setTerm records why the endpoint ended (first reason wins), closes Done and,
// for reasons that come from the peer, fires OnError.
func (e *Endpoint) setTerm(err error, eof, fromPeer bool) {
	e.mu.Lock()
	if e.term != nil {
		e.mu.Unlock()
		return
	}
	e.term, e.eof = err, eof
	var f func(error)
	if fromPeer {
		e.peerErr = err
		if e.onErr != nil && !e.errFired {
			e.errFired = true
			f = e.onErr
		}
	}
	close(e.done)
	e.mu.Unlock()
	notify(e.rnotify)
	notify(e.wnotify)
	if f != nil {
		go f(err)
	}
}

// peerFailed runs with the worker's lock held when UCX reports the endpoint failed.
func (e *Endpoint) peerFailed(status int) {
	e.unlist()
	e.drain(true)
	msg := statusString(status)
	if status == statusCanceled {
		msg = "connection lost: UCX cancelled the pending requests"
	}
	e.setTerm(newEndpointError("endpoint", status, msg), false, true)
	e.w.ctx.opts.logger.Debug("rdma endpoint failed", "remote", e.raddr, "status", status, "reason", msg)
	e.forceClose()
}

// peerFinished runs with the worker's lock held when the peer announced its close;
// everything it sent before is in UCX's queue by now. The FIN-ACK tells the
// peer it may release its endpoint.
func (e *Endpoint) peerFinished() {
	e.mu.Lock()
	again := e.finished
	e.mu.Unlock()
	if again {
		// A peer closes once: a FIN after the first answers nothing, and
		// an ack for each would let it queue requests without bound.
		return
	}
	e.unlist()
	e.drain(true)
	e.mu.Lock()
	cut := e.cut
	e.finished = true // Reads end where the FIN came (io.EOF), whatever follows it
	e.mu.Unlock()
	if cut {
		e.setTerm(errUnreadCut, false, true)
	} else {
		e.setTerm(errPeerClosed, true, true)
	}
	if e.ce != nil && !e.ucpClosed {
		e.finAcks++
	}
	e.issueFIN(true, func(int) {})
}

func (e *Endpoint) termErr() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.local {
		return closedError("endpoint")
	}
	return e.term
}

// opError turns the final status of a request into the error a caller sees
// (worker lock held). A request may report the peer's failure before UCX calls
// the endpoint's error handler: the endpoint fails then.
func (e *Endpoint) opError(op string, st int) error {
	if st == statusOK {
		return nil
	}
	if err := e.termErr(); err != nil {
		return err
	}
	if isPeerFailure(st) || (st == statusCanceled && !e.ucpClosed) {
		// We cancel nothing ourselves except by closing the endpoint (which
		// sets term first): UCX cancelled the request because the
		// endpoint failed (UCX 1.16 does so before the error callback).
		e.peerFailed(st)
		return e.termErr()
	}
	return statusError(op, C.int(st))
}

// isPeerFailure reports statuses that mean the connection is gone.
func isPeerFailure(st int) bool {
	switch {
	case st <= statusFirstLinkFailure && st >= statusLastEndpointFailure:
		return true
	case st == statusConnReset, st == statusNotConnected, st == statusUnreachable, st == statusIOError:
		return true
	}
	return false
}

func (e *Endpoint) isLocalClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.local
}

// TransportInfo describes the UCX lanes and transports the endpoint uses (the
// text of ucp_ep_print_info), for diagnostics; "" once closed.
func (e *Endpoint) TransportInfo() string {
	var s string
	e.w.call(func() {
		if e.ce == nil || e.ucpClosed {
			return
		}
		var n C.size_t
		if p := C.rdma_ep_info(e.ce, &n); p != nil {
			s = C.GoStringN(p, C.int(n))
			C.free(unsafe.Pointer(p))
		}
	})
	return s
}

// LocalAddr returns the local address (Network() is "ucx").
func (e *Endpoint) LocalAddr() net.Addr { return e.laddr }

// RemoteAddr returns the peer's address (Network() is "ucx").
func (e *Endpoint) RemoteAddr() net.Addr { return e.raddr }

// Done is closed when the endpoint failed, the peer closed it, or it was
// closed.
func (e *Endpoint) Done() <-chan struct{} { return e.done }

// Err says why Done is closed: an *EndpointError when the peer failed, an
// error wrapping io.EOF when the peer closed, one wrapping net.ErrClosed after
// Close; nil while alive.
func (e *Endpoint) Err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.term
}

// OnError sets a function called once, from its own goroutine, when the peer
// fails (an *EndpointError) or closes (an error wrapping io.EOF); at once if
// that already happened. Close does not call it.
func (e *Endpoint) OnError(f func(error)) {
	e.mu.Lock()
	e.onErr = f
	var err error
	if f != nil && e.peerErr != nil && !e.errFired {
		e.errFired = true
		err = e.peerErr
	}
	e.mu.Unlock()
	if err != nil {
		go f(err)
	}
}

// Close closes the endpoint: it wakes every waiter, sends what was written and
// tells the peer (its Reads then return io.EOF) for at most 2 s, then
// releases the UCX endpoint (force close). It is idempotent; later calls
// return errors wrapping net.ErrClosed.
func (e *Endpoint) Close() error { return e.close(true) }

// Abort closes the endpoint at once: what was written and not yet sent is
// dropped, and the peer is not told (its endpoint fails). It is for a peer
// that broke the protocol: UCX goes on receiving for an endpoint that Close
// lingers on. It is idempotent, and a no-op after Close.
func (e *Endpoint) Abort() error { return e.close(false) }

func (e *Endpoint) close(polite bool) error {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		graceful := polite && e.term == nil
		e.local = true
		e.mu.Unlock()
		e.setTerm(closedError("endpoint"), false, false)
		if e.w.submit(func() { e.closeUCP(graceful) }) != nil {
			return // the worker closed: its teardown released the endpoint
		}
		t := time.NewTimer(lingerTimeout)
		defer t.Stop()
		select {
		case <-e.closeDone:
			return
		case <-e.w.exited:
			return
		case <-t.C:
		}
		if e.w.submit(e.forceClose) == nil {
			e.waitReleased()
		}
	})
	return nil
}

// closeUCP runs with the worker's lock held: flush, FIN; the peer's FIN-ACK (or
// Close's linger timeout) then triggers the force close. Releasing the
// endpoint right after the FIN could let the disconnect overtake it.
func (e *Endpoint) closeUCP(graceful bool) {
	e.unlist()
	if e.ce == nil || e.closing || e.ucpClosed {
		return
	}
	if !graceful {
		e.forceClose()
		return
	}
	e.closing = true
	w := e.w
	flush := func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
		return C.rdma_ep_flush(w.cw, ce, id, req)
	}
	then := func(next func()) func(int) {
		return func(st int) {
			if st != statusOK {
				e.forceClose()
				return
			}
			next()
		}
	}
	e.issue(flush, then(func() {
		e.issueFIN(false, then(func() {}))
	}))
}

// issueFIN sends the peer a FIN, or with ack the FIN-ACK that answers one
// (worker lock held).
func (e *Endpoint) issueFIN(ack bool, done func(int)) {
	w, a := e.w, C.int(0)
	if ack {
		a = 1
	}
	e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
		return C.rdma_ep_fin(w.cw, ce, a, id, req)
	}, done)
}

// forceClose releases the UCX endpoint (worker lock held); UCX completes its
// pending requests with an error.
func (e *Endpoint) forceClose() {
	if e.ce == nil || e.ucpClosed {
		return
	}
	e.ucpClosed = true
	ce := e.ce
	w := e.w
	w.issue(func(id C.uint64_t, req *unsafe.Pointer) C.int {
		return C.rdma_ep_close(w.cw, ce, id, req)
	}, func(int) {
		for k := range e.rkeys {
			k.destroy()
		}
		delete(w.eps, e.id)
		// UCX frees the endpoint before this completion is handled, and an
		// endpoint created meanwhile (a connection request handled first)
		// may have its address: the entry is this endpoint's to delete only
		// while it names it.
		if h := e.handle(); w.epByH[h] == e {
			delete(w.epByH, h)
		}
		e.unpair()
		C.rdma_ep_free(ce)
		e.ce = nil
		live.endpoints.Add(-1)
		close(e.closeDone)
		if w.share != nil {
			w.share.drop(w)
		}
	})
}
