//go:build cgo && !nordma

package rdma

/*
#include "ucx.h"
*/
import "C"

import (
	"cmp"
	"context"
	"math/rand/v2"
	"sync"
)

// Workers kept apart. A peer process that dies in the middle of a send over
// shared memory (UCX's posix and sysv transports) leaves the receive queue
// of the worker it sent to blocked for good: UCX waits on the slot the peer
// took and never marked written, so every endpoint of that worker stalls.
// An isolating listener keeps the endpoints of each client worker in another
// process on a worker of their own, and DialApart keeps a context's
// endpoints to each listener address on one: a dead peer then blocks the
// worker that ends with its own endpoints. Clients in this process stay on
// the listener's worker, where both ends of a connection hand bytes over
// directly (endpoint_pair.go).
//
// DialApart sends the client's worker id with its connection requests
// (UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID); Worker.Dial sends none, which keeps
// the endpoint on the listener's worker. Not every dial sends it: with the
// id in every request, UCX 1.13 failed the assertion in its tcp connection
// manager's send progress in 2 of 5 runs of the transport tests,
// which turn requests away and dial again. A client may name any id: naming
// another client's puts its endpoints beside that client's, as every
// client's were before, and naming one of this process's workers puts them
// on the listener's worker, as before.

// IsolateClients makes the listener keep the endpoints of later connection
// requests from each client worker in another process that sends its id
// (DialApart) on a worker of their own, created at the client's first
// request and closed once its last endpoint is released.
func (l *Listener) IsolateClients() { l.isolate.Store(true) }

// DialApart dials addr as Worker.Dial does, on a worker of this context
// kept for the endpoints to that address: created at the first, closed once
// the last is released. A listener's process that dies in the middle of a
// send over shared memory then blocks the receive queue of that worker, not
// of the one the context's other endpoints share. An endpoint to a listener
// of this process gets no direct hand-over of bytes (endpoint_pair.go): its
// peer is on another worker.
func (c *Context) DialApart(ctx context.Context, addr string) (*Endpoint, error) {
	w := c.peers.hold(addr)
	if w == nil {
		return c.Worker().dial(ctx, addr, true)
	}
	defer w.share.drop(w) // the hold; an endpoint holds w on its own
	return w.dial(ctx, addr, true)
}

// clientWorkers holds the live workers of this process by their client id.
var clientWorkers sync.Map // uint64 -> *Worker

// newClientID returns a client id for a new worker: random, so that two
// processes' workers do not share one, and never 0, which a request without
// an id carries.
func newClientID() uint64 {
	for {
		if id := rand.Uint64(); id != 0 {
			if _, taken := clientWorkers.Load(id); !taken {
				return id
			}
		}
	}
}

// requestClient returns the client id a connection request carries (0 for
// none) and whether it names a worker of this process and context.
func (l *Listener) requestClient(req uintptr) (id uint64, local bool) {
	var cid C.uint64_t
	if C.rdma_conn_request_client_id(C.uintptr_t(req), &cid) != statusOK {
		return 0, false
	}
	id = uint64(cid)
	if v, ok := clientWorkers.Load(id); ok && v.(*Worker).ctx == l.w.ctx {
		return id, true
	}
	return id, false
}

// maxApart bounds the workers one shares keeps apart: a client names its
// worker's id itself, and each worker holds threads' worth of descriptors
// and memory, so past the bound a peer's endpoints go on the shared worker,
// as without isolation.
const maxApart = 64

// shares are workers kept apart for the endpoints of one peer each (a
// listener's for each client worker, a context's for each listener it
// dials), keyed by that peer. A worker lives while it holds an endpoint or
// is held for one being made.
type shares struct {
	ctx *Context
	max int // the workers kept at most (maxApart; 0 too)
	mu  sync.Mutex
	m   map[any]*share
}

// share is one peer's worker and how many endpoints and holds it has.
type share struct {
	w    *Worker
	refs int
}

// shareLink ties a worker to its place in shares.
type shareLink struct {
	s   *shares
	key any
}

// hold returns the worker kept for key's endpoints, creating it at the
// first, held until release: an endpoint attached meanwhile holds it too
// (add), until it is released (drop). Nil (logged): use another worker (no
// worker could be made, or maxApart are kept).
func (s *shares) hold(key any) *Worker {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sh := s.m[key]; sh != nil {
		sh.refs++
		return sh.w
	}
	if len(s.m) >= cmp.Or(s.max, maxApart) {
		s.ctx.opts.logger.Debug("rdma: as many workers kept apart as allowed; a peer's endpoint goes on a shared one", "limit", cmp.Or(s.max, maxApart))
		return nil
	}
	w, err := s.ctx.newWorker(false, &shareLink{s: s, key: key})
	if err != nil {
		s.ctx.opts.logger.Warn("rdma: no worker of its own for a peer; its endpoint goes on a shared one", "err", err)
		return nil
	}
	if s.m == nil {
		s.m = map[any]*share{}
	}
	s.m[key] = &share{w: w, refs: 1}
	return w
}

// add counts an endpoint attached to w, a worker of s.
func (k *shareLink) add(w *Worker) {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if sh := k.s.m[k.key]; sh != nil && sh.w == w {
		sh.refs++
	}
}

// drop releases a hold or an endpoint of w, a worker of s; the last closes w
// (on a goroutine of its own: the caller may hold w's lock).
func (k *shareLink) drop(w *Worker) {
	k.s.mu.Lock()
	sh := k.s.m[k.key]
	if sh == nil || sh.w != w {
		k.s.mu.Unlock()
		return
	}
	sh.refs--
	if sh.refs > 0 {
		k.s.mu.Unlock()
		return
	}
	delete(k.s.m, k.key)
	k.s.mu.Unlock()
	go w.close()
}
