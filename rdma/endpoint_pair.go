//go:build cgo && !nordma

// Connecting endpoints (Dial), and pairing the two ends of a connection
// when both are on one worker.

package rdma

/*
#include "ucx.h"
*/
import "C"

import (
	"context"
	"fmt"
	"net"
	"unsafe"
)

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

// Dial connects to a listener at addr ("ip:port") with peer error handling.
// It returns when the connection is established, fails promptly when nobody
// listens, and is bounded by ctx.
func (w *Worker) Dial(ctx context.Context, addr string) (*Endpoint, error) {
	return w.dial(ctx, addr, false)
}

// dial is Dial; sendID sends the worker's client id with the request
// (isolate.go).
func (w *Worker) dial(ctx context.Context, addr string, sendID bool) (*Endpoint, error) {
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
		send := C.int(0)
		if sendID {
			send = 1
		}
		st := C.rdma_ep_connect(w.cw, C.uint64_t(e.id), (*C.uint8_t)(unsafe.Pointer(&ip[0])), C.int(len(ip)), C.int(ap.Port()), send, &ce)
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
