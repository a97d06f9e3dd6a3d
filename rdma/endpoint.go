//go:build cgo && !nordma

package rdma

/*
#include <stdlib.h>
#include "ucx.h"
*/
import "C"

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"
)

const (
	ringInitial = 64 << 10 // first inbound buffer of an endpoint
	ringMax     = 4 << 20  // inbound buffer above which draining UCX stops until Read catches up
	smallWrite  = 64 << 10 // writes up to this size are copied and sent without waiting
	maxInflight = 4 << 20  // copied bytes in flight per endpoint before Write waits
	directRead  = 32 << 10 // Reads from this size wait with their buffer posted for a direct copy
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

	mu       sync.Mutex
	in       []byte // inbound ring
	head, n  int
	rbuf     []byte // a waiting Read's buffer the worker may fill directly
	rfill    int    // bytes the worker put in rbuf
	rbusy    bool   // the worker is copying into rbuf outside mu
	rcond    sync.Cond
	stalled  bool // draining stopped: the ring is full
	drainReq bool // a drain is queued
	term     error
	eof      bool // term: the peer closed; Read returns io.EOF
	local    bool // Close was called
	peerErr  error
	inflight int
	onErr    func(error)
	errFired bool
	lanes    string   // TransportInfo once it showed lanes to the peer (KeyDomains)
	rmaDoms  []string // rmaDomains(lanes), once asked

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
	e.w.epByH[uintptr(unsafe.Pointer(ce.ep))] = e
	live.endpoints.Add(1)
	e.w.unpaired++
	e.queryAddrs()
	e.pairUp()
}

// pairKey names a connection by its addresses as one end sees them.
func pairKey(local, remote *Addr) string { return local.String() + ">" + remote.String() }

// pairUp lists the endpoint under its addresses once both are known, and
// pairs it with the endpoint that has them the other way round: the two ends
// of one connection, both on this worker (worker lock held).
func (e *Endpoint) pairUp() {
	if e.key != "" || e.laddr == nil || e.raddr == nil || e.laddr.Port == 0 || e.raddr.Port == 0 {
		return
	}
	w := e.w
	key := pairKey(e.laddr, e.raddr)
	if _, taken := w.ends[key]; taken {
		return
	}
	e.key = key
	w.ends[key] = e
	if m := w.ends[pairKey(e.raddr, e.laddr)]; m != nil && m != e && m.pair == nil {
		e.pair, m.pair = m, e
		w.unpaired -= 2
	}
}

// unlist takes an ending endpoint out of the worker's ends (worker lock
// held): a new connection with the same addresses must not pair with it.
func (e *Endpoint) unlist() {
	if e.key != "" && e.key != unlisted {
		delete(e.w.ends, e.key)
	}
	e.key = unlisted
}

// unlisted is the key of an endpoint that ended: pairUp lists it no more.
const unlisted = "-"

// unpair takes a released endpoint off the worker's lists (worker lock held);
// its peer's endpoint, if here, is left without a pair.
func (e *Endpoint) unpair() {
	w := e.w
	e.unlist()
	if m := e.pair; m != nil {
		m.pair, e.pair = nil, nil
		w.unpaired++
		return
	}
	w.unpaired--
}

func (e *Endpoint) queryAddrs() {
	var lip, rip [16]byte
	var ln, lp, rn, rp C.int
	if C.rdma_ep_addrs(e.ce, (*C.uint8_t)(unsafe.Pointer(&lip[0])), &ln, &lp, (*C.uint8_t)(unsafe.Pointer(&rip[0])), &rn, &rp) != statusOK {
		return
	}
	if a := addrFrom(lip[:], ln, lp); a != nil && a.Port != 0 {
		e.laddr = a
	}
	if a := addrFrom(rip[:], rn, rp); a != nil && a.Port != 0 {
		e.raddr = a
	}
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

// Dial connects to a listener at addr ("ip:port") with peer error handling.
// It returns when the connection is established, fails promptly when nobody
// listens, and is bounded by ctx.
func (w *Worker) Dial(ctx context.Context, addr string) (*Endpoint, error) {
	ap, err := resolve(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("rdma: dial %s: %w", addr, err)
	}
	type result struct {
		e      *Endpoint
		err    error
		marked <-chan struct{} // the close-on-exec scan covering its descriptors
	}
	res := make(chan result, 1)
	var e *Endpoint // lock-only: the worker's lock guards it
	err = w.submit(func() {
		e = newEndpoint(w)
		ip := ap.Addr().AsSlice()
		var ce *C.rdma_ep_t
		st := C.rdma_ep_connect(w.cw, C.uint64_t(e.id), (*C.uint8_t)(unsafe.Pointer(&ip[0])), C.int(len(ip)), C.int(ap.Port()), &ce)
		if st != statusOK {
			e = nil
			res <- result{nil, statusError("ucp_ep_create", st), nil}
			return
		}
		e.attach(ce)
		if e.raddr == nil {
			e.raddr = &Addr{IP: net.IP(ip), Port: int(ap.Port())}
		}
		e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
			return C.rdma_ep_flush(w.cw, ce, id, req)
		}, func(st int) {
			if err := e.opError("ucp_ep_flush_nbx", st); err != nil {
				e.fail(err, false)
				e.forceClose()
				res <- result{e, err, nil}
				return
			}
			e.queryAddrs()
			e.pairUp()
			res <- result{e, nil, markCloexec(false)}
		})
	})
	if err != nil {
		return nil, fmt.Errorf("rdma: dial %s: %w", addr, err)
	}
	select {
	case r := <-res:
		if r.err != nil {
			if r.e != nil {
				r.e.waitReleased()
			}
			return nil, fmt.Errorf("rdma: dial %s: %w", addr, r.err)
		}
		if r.e.laddr == nil {
			r.e.laddr = &Addr{}
		}
		<-r.marked
		return r.e, nil
	case <-ctx.Done():
		cerr := fmt.Errorf("rdma: dial %s: %w", addr, ctx.Err())
		rel := make(chan *Endpoint, 1)
		if w.submit(func() {
			if e != nil {
				e.fail(cerr, false)
				e.forceClose()
			}
			rel <- e
		}) == nil {
			select {
			case x := <-rel:
				if x != nil {
					x.waitReleased()
				}
			case <-w.exited:
			}
		}
		return nil, cerr
	}
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
	e.unlist()
	e.drain(true)
	e.setTerm(errPeerClosed, true, true)
	w := e.w
	e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
		return C.rdma_ep_fin(w.cw, ce, 1, id, req)
	}, func(int) {})
}

// drain moves received stream data from UCX into the inbound ring (worker
// lock held). Unless all is set it stops when the ring reaches ringMax.
func (e *Endpoint) drain(all bool) {
	if e.ce == nil || e.ucpClosed {
		return
	}
	for {
		e.mu.Lock()
		e.drainReq = false
		if e.local {
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
			e.grow(size)
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

// Write sends all of p on the stream or returns an error. It honours the
// write deadline. Up to 64 KiB are copied and sent without waiting (at most
// 4 MiB in flight); larger writes are pinned and wait for UCX to complete. A
// larger write that times out may still be sent: p stays pinned until then.
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
	select {
	case err := <-res:
		if err != nil {
			return 0, err
		}
		return len(p), nil
	case <-dl:
		return 0, &timeoutError{op: "write"}
	case <-e.done:
		return 0, e.termErr()
	}
}

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
func (e *Endpoint) Close() error {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		graceful := e.term == nil
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
	fin := func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
		return C.rdma_ep_fin(w.cw, ce, 0, id, req)
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
		e.issue(fin, then(func() {}))
	}))
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
		delete(w.epByH, uintptr(unsafe.Pointer(ce.ep)))
		e.unpair()
		C.rdma_ep_free(ce)
		e.ce = nil
		live.endpoints.Add(-1)
		close(e.closeDone)
	})
}

// RemoteKey is a peer's memory key unpacked on an endpoint.
type RemoteKey struct {
	e        *Endpoint
	h        C.ucp_rkey_h // lock-only: the worker's lock guards it; nil once destroyed
	region   packedKey
	once     sync.Once
	closeErr error
}

// KeyDomains returns the kinds of the peer's memory domains ("tcp", "ib",
// "sysv", "posix", "cma", "cuda_ipc", ...) that packed carries and that the
// endpoint's lanes reach: the transports a put with the key may take. Which
// of them bound a put by the key depends on the transport: on some (shared
// memory, CMA, CUDA IPC) this process writes itself wherever the key says.
// An empty result means UCX would emulate the put with active messages that
// the peer applies.
func (e *Endpoint) KeyDomains(packed []byte) ([]string, error) {
	info, err := e.laneInfo()
	if err != nil {
		return nil, fmt.Errorf("rdma: key domains: %w", err)
	}
	return keyDomains(packed, info)
}

// RMADomains returns the components of the peer's memory domains that the
// endpoint's rma_bw lanes reach ("tcp", "ib", "cuda_ipc", ...): where a put
// of a large buffer may go.
func (e *Endpoint) RMADomains() ([]string, error) {
	e.mu.Lock()
	doms := e.rmaDoms
	e.mu.Unlock()
	if doms != nil {
		return slices.Clone(doms), nil
	}
	info, err := e.laneInfo()
	if err != nil {
		return nil, fmt.Errorf("rdma: lanes: %w", err)
	}
	doms = rmaDomains(info)
	if doms == nil {
		doms = []string{}
	}
	e.mu.Lock()
	e.rmaDoms = doms
	e.mu.Unlock()
	return slices.Clone(doms), nil
}

// laneInfo returns ucp_ep_print_info's text for the endpoint, asked once:
// lanes do not change after wireup.
func (e *Endpoint) laneInfo() (string, error) {
	e.mu.Lock()
	info := e.lanes
	e.mu.Unlock()
	if info != "" {
		return info, nil
	}
	info = e.TransportInfo()
	if !strings.Contains(info, "->") {
		return "", cmp.Or(e.termErr(), errors.New("the endpoint shows no lanes"))
	}
	e.mu.Lock()
	e.lanes = info
	e.mu.Unlock()
	return info, nil
}

// UnpackKey unpacks a key made by the peer's Memory.PackKey. The framing is
// validated; the key is valid on this endpoint only.
func (e *Endpoint) UnpackKey(packed []byte) (*RemoteKey, error) {
	pk, err := decodeKey(packed)
	if err != nil {
		return nil, err
	}
	if err := validateRkey(pk.rkey); err != nil {
		return nil, err
	}
	pk.rkey = slices.Clone(pk.rkey)
	k := &RemoteKey{e: e, region: pk}
	var uerr error
	err = e.w.call(func() {
		if e.ce == nil || e.ucpClosed {
			uerr = e.opError("ucp_ep_rkey_unpack", statusCanceled)
			return
		}
		st := C.rdma_rkey_unpack(e.ce, unsafe.Pointer(&pk.rkey[0]), &k.h)
		if st != statusOK {
			uerr = statusError("ucp_ep_rkey_unpack", st)
			return
		}
		e.rkeys[k] = struct{}{}
		live.rkeys.Add(1)
	})
	if err == nil {
		err = uerr
	}
	if err != nil {
		return nil, fmt.Errorf("rdma: unpack key: %w", err)
	}
	return k, nil
}

// Close releases the key. It is idempotent; closing the endpoint releases
// its keys too.
func (k *RemoteKey) Close() error {
	k.once.Do(func() {
		if err := k.e.w.call(k.destroy); err != nil && !errors.Is(err, net.ErrClosed) {
			k.closeErr = err
		}
	})
	return k.closeErr
}

// destroy runs with the worker's lock held.
func (k *RemoteKey) destroy() {
	if k.h == nil {
		return
	}
	C.rdma_rkey_destroy(k.e.w.cw, k.h)
	k.h = nil
	delete(k.e.rkeys, k)
	live.rkeys.Add(-1)
}

func (e *Endpoint) checkRMA(key *RemoteKey, remote uint64, n int) error {
	if key == nil {
		return errors.New("rdma: nil remote key")
	}
	if key.e != e {
		return errors.New("rdma: remote key was unpacked on another endpoint")
	}
	if n < 0 || !key.region.contains(remote, n) {
		return fmt.Errorf("rdma: remote range %#x+%d outside the key's region %#x+%d", remote, n, key.region.base, key.region.length)
	}
	return nil
}

func checkLocal(m *Memory, off, n int) error {
	if m == nil {
		return errors.New("rdma: nil memory")
	}
	if off < 0 || n < 0 || off > m.n-n {
		return fmt.Errorf("rdma: local range %d+%d outside memory of %d bytes", off, n, m.n)
	}
	return nil
}

// Put writes n bytes at src[srcOff:] into the peer's memory at remote. It
// returns when the source may be reused (local completion); Flush gives
// remote completion. UCX cannot cancel a put once issued: when ctx ends first,
// Put still waits for the put to complete, or for the endpoint to fail, and
// then returns ctx's error.
func (e *Endpoint) Put(ctx context.Context, src *Memory, srcOff, n int, remote uint64, key *RemoteKey) error {
	return e.memRMA(ctx, false, src, srcOff, n, remote, key)
}

// PutBytes writes p (Go memory, pinned for the operation) into the peer's
// memory at remote.
func (e *Endpoint) PutBytes(ctx context.Context, p []byte, remote uint64, key *RemoteKey) error {
	if err := e.checkRMA(key, remote, len(p)); err != nil {
		return err
	}
	if len(p) == 0 {
		return e.termErr()
	}
	pin := new(runtime.Pinner)
	pin.Pin(&p[0])
	return e.rma(ctx, false, uintptr(unsafe.Pointer(&p[0])), len(p), nil, remote, key, pin.Unpin)
}

// Get reads n bytes at the peer's remote into dst[dstOff:].
func (e *Endpoint) Get(ctx context.Context, dst *Memory, dstOff, n int, remote uint64, key *RemoteKey) error {
	return e.memRMA(ctx, true, dst, dstOff, n, remote, key)
}

// memRMA checks the ranges and runs a put from, or a get into, m[off:off+n],
// holding a reference on m until UCX completes.
func (e *Endpoint) memRMA(ctx context.Context, get bool, m *Memory, off, n int, remote uint64, key *RemoteKey) error {
	if err := checkLocal(m, off, n); err != nil {
		return err
	}
	if err := e.checkRMA(key, remote, n); err != nil {
		return err
	}
	if n == 0 {
		return e.termErr()
	}
	if err := m.acquire(); err != nil {
		return err
	}
	return e.rma(ctx, get, m.addr+uintptr(off), n, m, remote, key, m.release)
}

// rma runs a put from, or a get into, local[:n]; m is local's registration (nil
// for pinned Go memory), which tells UCX its memory type and handle.
func (e *Endpoint) rma(ctx context.Context, get bool, local uintptr, n int, m *Memory, remote uint64, key *RemoteKey, release func()) error {
	name := "ucp_put_nbx"
	if get {
		name = "ucp_get_nbx"
	}
	if err := e.termErr(); err != nil {
		release()
		return err
	}
	res := make(chan error, 1)
	w := e.w
	err := w.submit(func() {
		if key.h == nil {
			// Keys go with their endpoint: when it failed, say why.
			release()
			if err := e.termErr(); err != nil {
				res <- err
			} else {
				res <- closedError("remote key")
			}
			return
		}
		cuda, memh := C.int(0), C.ucp_mem_h(nil)
		if m != nil {
			memh = m.h
			if m.mt == MemoryCUDA {
				cuda = 1
			}
		}
		e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
			if get {
				return C.rdma_get(w.cw, ce, C.uintptr_t(local), C.size_t(n), cuda, memh, C.uint64_t(remote), key.h, id, req)
			}
			return C.rdma_put(w.cw, ce, C.uintptr_t(local), C.size_t(n), cuda, memh, C.uint64_t(remote), key.h, id, req)
		}, func(st int) {
			release()
			res <- e.opError(name, st)
		})
	})
	if err != nil {
		release()
		return err
	}
	var ctxErr error
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		// UCX cannot cancel the operation: until it completes it may still
		// read the local memory and write the peer's, which the caller would
		// otherwise reuse, or report failed, at once.
		ctxErr = fmt.Errorf("rdma: %s: %w", name, ctx.Err())
	case <-e.done:
	}
	select {
	case err := <-res:
		return cmp.Or(ctxErr, err)
	case <-e.done:
		select {
		case err := <-res:
			return cmp.Or(ctxErr, err)
		default:
		}
		return cmp.Or(ctxErr, e.termErr())
	}
}

// Flush waits until every put issued on the endpoint so far completed at the
// peer.
func (e *Endpoint) Flush(ctx context.Context) error {
	if err := e.termErr(); err != nil {
		return err
	}
	res := make(chan error, 1)
	w := e.w
	err := w.submit(func() {
		e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
			return C.rdma_ep_flush(w.cw, ce, id, req)
		}, func(st int) { res <- e.opError("ucp_ep_flush_nbx", st) })
	})
	if err != nil {
		return err
	}
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		return fmt.Errorf("rdma: flush: %w", ctx.Err())
	case <-e.done:
		select {
		case err := <-res:
			return err
		default:
		}
		return e.termErr()
	}
}
