//go:build cgo && !nordma

package rdma

/*
#include "ucx.h"
*/
import "C"

import (
	"math/rand/v2"
	"sync"
)

// IsolateClients makes the listener keep the endpoints of later connection
// requests from each client worker in another process on a worker of their
// own, created at the client's first request and closed once its last
// endpoint is released.
func (l *Listener) IsolateClients() { l.isolate.Store(true) }

// An isolating listener keeps the endpoints of each client worker in another
// process on a worker of their own. A peer process that dies in the middle of a send
// over shared memory (UCX's posix and sysv transports) leaves the receive
// queue of the worker it sent to blocked for good: UCX waits on the slot the
// peer took and never marked written. On a worker of its own, that is the
// dead client's worker, which ends once its endpoints are released, not the
// listener's, which every other client's connections would share. Clients
// in this process stay on the listener's worker, where both ends of a
// connection hand bytes over directly (endpoint_pair.go).
//
// UCX sends the client's worker id with each connection request
// (UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID). A client may name any id: naming
// another client's puts its endpoints beside that client's, as every
// client's were before, and naming one of this process's workers puts them
// on the listener's worker, as before.

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

// clientShare is a listener's worker for one client worker, and the
// endpoints it holds or is accepting.
type clientShare struct {
	w    *Worker
	refs int
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

// clientWorker returns the worker for client id's endpoints, creating it at
// the client's first request, and counts one more endpoint on it (release it
// with dropClient). Nil: keep the endpoint on the listener's worker.
func (l *Listener) clientWorker(id uint64) *Worker {
	l.cmu.Lock()
	defer l.cmu.Unlock()
	if cs := l.clients[id]; cs != nil {
		cs.refs++
		return cs.w
	}
	w, err := l.w.ctx.newWorker(false, &clientLink{l: l, id: id})
	if err != nil {
		l.w.ctx.opts.logger.Warn("rdma: no worker of its own for a client; its endpoint stays on the listener's", "err", err)
		return nil
	}
	if l.clients == nil {
		l.clients = map[uint64]*clientShare{}
	}
	l.clients[id] = &clientShare{w: w, refs: 1}
	return w
}

// clientLink ties a worker to the listener that made it for a client.
type clientLink struct {
	l  *Listener
	id uint64
}

// dropClient counts one endpoint less on w, a client's worker; the last
// closes w (on a goroutine of its own: the caller may hold w's lock).
func (k *clientLink) drop(w *Worker) {
	l := k.l
	l.cmu.Lock()
	cs := l.clients[k.id]
	if cs == nil || cs.w != w {
		l.cmu.Unlock()
		return
	}
	cs.refs--
	if cs.refs > 0 {
		l.cmu.Unlock()
		return
	}
	delete(l.clients, k.id)
	l.cmu.Unlock()
	go w.close()
}
