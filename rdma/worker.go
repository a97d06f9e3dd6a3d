//go:build cgo && !nordma

package rdma

/*
#include <sched.h>
#include "ucx.h"
*/
import "C"

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	sleepTimeout   = 250 * time.Millisecond // longest park
	pendingTimeout = time.Millisecond       // longest park while requests are in flight
	pendingSpin    = 5 * time.Millisecond   // poll (yielding) this long while requests are in flight
	drainTimeout   = 5 * time.Second        // how long a closing worker waits for UCX to complete its requests
	acceptBacklog  = 128                    // connection requests waiting for Accept
	eventBatch     = 64                     // events taken from the ring at once
	progressBatch  = 32                     // ucp_worker_progress calls per round
	lingerTimeout  = 2 * time.Second        // Close: flush pending writes and tell the peer, at most this long
	forceTimeout   = 5 * time.Second        // Close: wait for the force close, at most this long
	scanInterval   = 10 * time.Millisecond  // least time between two FD_CLOEXEC scans
	quietIdle      = 100 * time.Millisecond // a resting driver parks on the event fd after this long without work
	serveRounds    = 4                      // progress rounds of one serve while handled events issue requests
	quietTick      = time.Millisecond       // how often a resting driver looks around
	lockSpin       = 50 * time.Microsecond  // how long the driver yields before it sleeps on a held lock
)

// Worker is a UCX worker in UCS_THREAD_MODE_SERIALIZED: every UCX call for the
// worker, its endpoints and listeners, and the state marked "lock-only", is
// made by the goroutine holding mu. A goroutine submitting an operation runs it
// itself when mu is free, so a write on an idle worker involves no hand-off;
// otherwise the operation waits in the queue for the holder, which serves the
// queue before releasing mu. The driver goroutine keeps UCX progressing: it
// polls briefly after work (anyone's) and while requests are in flight, and
// otherwise arms the worker and sleeps on its event fd.
//
// When both ends of every connection are on this worker (client and server in
// one process), the sender's own serve hands the bytes to the reader: the
// driver then rests instead of polling, so it takes no processor from the
// goroutines doing the work, and does not arm the worker, so a send raises no
// event. It looks around every quietTick for what only it would see
// (connection requests, failures UCX's async thread detects, tcp bytes one
// serve left behind), and parks as usual after quietIdle without work. This
// overrides the poll time.
type Worker struct {
	ctx       *Context
	cw        *C.rdma_worker_t // lock-only; nil once destroyed
	isDefault bool
	clientID  uint64     // sent with this worker's connection requests (isolate.go)
	share     *shareLink // a worker kept for one peer's endpoints (isolate.go), else nil

	mu      sync.Mutex // the worker's lock
	qmu     sync.Mutex
	queue   []func()
	closed  bool          // no more operations accepted
	parked  atomic.Bool   // the driver waits on the event fd
	resting atomic.Bool   // the driver waits on wake or its tick (quiet)
	wake    chan struct{} // wakes a resting driver
	tick    *time.Timer   // a resting driver's tick
	exited  chan struct{} // the driver returned: the worker is destroyed
	closeMu sync.Mutex

	// The worker's event fd (duplicated) in Go's poller, where the driver
	// parks; nil where the poller does not take it (the driver then parks
	// in C). Set before the driver starts, then driver only.
	efd     *os.File
	efdConn syscall.RawConn

	// lock-only state
	nextID    uint64
	grown     map[*Endpoint]struct{} // endpoints whose inbound ring is past ringInitial (shrinkRings)
	pending   map[uint64]*op
	eps       map[uint64]*Endpoint
	epByH     map[uintptr]*Endpoint
	ends      map[string]*Endpoint // live endpoints by their addresses (pairKey)
	unpaired  int                  // endpoints in eps without a pair (peer elsewhere, or not identified)
	issued    bool                 // serve: a handled event issued a request
	deferred  []func()             // operations for the next round (later)
	tickEvery time.Duration        // a resting driver's tick: quietTick (tests change it)
	listeners map[uint64]*Listener
	stopping  bool
	stopAt    time.Time
	lastWork  time.Time // the last serve that found something to do
	handled   bool      // the driver's last serve handled events
	arrived   bool      // the driver's last serve handled data or a FIN from a peer
	spins     spinPolicy
	yields    atomic.Int64     // times the driver yielded its core
	evs       []C.rdma_event_t // events taken from the ring

	// driver only
	lastScan   time.Time
	polled     bool      // the driver's last serve found nothing, and it polls on
	yielded    bool      // and yielded its core
	spinning   bool      // the driver polled since the last work
	parkedIdle bool      // the driver parked since the last work
	parkedAt   time.Time // when it first did, if it polled before
	// peeked: the last park returned because the event fd was readable
	// when it began to wait, and no serve found work since (see park).
	peeked bool
	// testPark, set by tests, runs before each park with the event fd (-1
	// without one); a timeout it returns replaces the park's.
	testPark func(efd int) time.Duration
}

// op is a UCX request in flight.
type op struct {
	req  unsafe.Pointer
	done func(status int)
}

// newWorker creates a worker; share is set for one kept for a peer's
// endpoints (isolate.go).
func (c *Context) newWorker(isDefault bool, share *shareLink) (*Worker, error) {
	w := &Worker{
		ctx:       c,
		isDefault: isDefault,
		exited:    make(chan struct{}),
		wake:      make(chan struct{}, 1),
		tick:      time.NewTimer(quietTick),
		pending:   map[uint64]*op{},
		eps:       map[uint64]*Endpoint{},
		epByH:     map[uintptr]*Endpoint{},
		ends:      map[string]*Endpoint{},
		tickEvery: quietTick,
		listeners: map[uint64]*Listener{},
		evs:       make([]C.rdma_event_t, eventBatch),
		spins:     spinPolicy{max: c.opts.pollTime},
		clientID:  newClientID(),
		share:     share,
	}
	// Under c.mu, so that a Close of the context either closes this worker
	// with the others or is seen before the worker is made: a worker made
	// after the context's teardown would outlive its UCX context.
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, closedError("context")
	}
	st := C.rdma_worker_create(w.ctx.h, C.uint64_t(w.clientID), &w.cw)
	ucxFDs.scan()
	if st != statusOK {
		c.mu.Unlock()
		return nil, fmt.Errorf("rdma: create worker: %w", statusError("ucp_worker_create", st))
	}
	w.mu.Lock() // new: nobody else holds it
	c.workers[w] = struct{}{}
	hooks := c.cuda.Load()
	c.mu.Unlock()
	if hooks != nil {
		if cu, err := hooks.context(hooks.dev); err == nil {
			C.rdma_worker_set_cuda(w.cw, cu)
		}
	}
	w.pollEvents()
	w.mu.Unlock()
	clientWorkers.Store(w.clientID, w)
	go w.run()
	if !isDefault {
		live.workers.Add(1)
	}
	return w, nil
}

// useCUDA makes the worker's later UCX calls run with cu's context current.
func (w *Worker) useCUDA(cu *C.rdma_cuda_t) {
	w.call(func() {
		if w.cw != nil {
			C.rdma_worker_set_cuda(w.cw, cu)
		}
	})
}

// run is the driver goroutine.
func (w *Worker) run() {
	defer close(w.exited)
	for {
		w.lockDriver()
		w.handled, w.arrived = false, false
		prev := w.lastWork
		busy := w.serve()
		handled := w.handled
		if w.arrived {
			switch {
			case w.polled && !w.yielded:
				w.spins.caught(w.lastWork.Sub(prev))
			case !w.parkedAt.IsZero():
				w.spins.woke(w.lastWork.Sub(w.parkedAt), w.lastWork)
			}
		}
		w.polled, w.yielded = false, false
		if busy {
			w.spins.worked(w.lastWork)
			w.spinning, w.parkedIdle, w.parkedAt = false, false, time.Time{}
			w.peeked = false
		}
		if w.stopping && (len(w.pending) == 0 || time.Now().After(w.stopAt)) && !w.queued() {
			if w.efd != nil {
				w.efd.Close()
			}
			C.rdma_worker_destroy(w.cw)
			w.cw = nil
			w.mu.Unlock()
			return
		}
		if busy {
			w.release(false)
			if handled {
				// The events handled here often readied a goroutine (a
				// reader handed its bytes, a writer its completion): let it
				// run on this P now, not after another round or once another
				// P steals it after the runtime's delay.
				runtime.Gosched()
			}
			continue
		}
		// Poll for a while after the last work, by anyone: a reply often
		// follows soon, and a park costs a wake-up on the way back. Requests
		// in flight progress only when this side polls (a full shared-memory
		// FIFO drains without waking us): keep polling then, yielding to other
		// goroutines between rounds.
		now := time.Now()
		idle := now.Sub(w.lastWork)
		if w.quiet() && idle < quietIdle {
			w.rest()
			continue
		}
		if idle < w.spins.max || (len(w.pending) > 0 && idle < pendingSpin) {
			w.polled, w.yielded, w.spinning = true, w.spins.yielding(idle), true
			w.release(false)
			if w.yielded {
				C.sched_yield()
				w.yields.Add(1)
			}
			runtime.Gosched()
			continue
		}
		// UCX opens descriptors lazily (connections of lanes, from its async
		// thread too): mark them close-on-exec when going idle.
		if now.Sub(w.lastScan) > scanInterval {
			markCloexec(true)
			w.lastScan = now
		}
		w.shrinkRings(now)
		timeout := sleepTimeout
		switch {
		case w.stopping:
			timeout = 10 * time.Millisecond
		case len(w.pending) > 0:
			// UCX does not wake the event fd when a full shared-memory FIFO
			// drains: requests in flight need this side to progress. After a
			// timeout the driver keeps parking in these short slices.
			timeout = pendingTimeout
		}
		if !w.parkedIdle && w.spinning {
			w.parkedAt = now
		}
		w.parkedIdle = true
		w.spins.parking()
		if w.testPark != nil {
			efd := -1
			if w.efdConn != nil {
				_ = w.efdConn.Control(func(fd uintptr) { efd = int(fd) })
			}
			if d := w.testPark(efd); d > 0 {
				timeout = d
			}
		}
		w.park(timeout)
	}
}

// lockDriver takes mu for the driver. Held by another goroutine (a
// submitter serving its own operation, for a few microseconds), mu is tried
// again after a yield of the P for up to lockSpin before the driver sleeps
// on it: a driver asleep on mu is woken by the holder's unlock, one more
// thread wake-up in the middle of a call, and its core goes idle meanwhile.
func (w *Worker) lockDriver() {
	if w.mu.TryLock() {
		return
	}
	start := time.Now()
	for time.Since(start) < lockSpin {
		runtime.Gosched()
		if w.mu.TryLock() {
			return
		}
	}
	w.mu.Lock()
}

// pollEvents puts a duplicate of the worker's event fd in Go's poller (mu
// held, before the driver starts), for park.
func (w *Worker) pollEvents() {
	fd := C.rdma_worker_dup_efd(w.cw)
	if fd < 0 {
		return
	}
	f := os.NewFile(uintptr(fd), "ucx-worker-events")
	// A deadline takes only on a descriptor the poller registered.
	if f.SetReadDeadline(time.Time{}) != nil {
		f.Close()
		return
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return
	}
	w.efd, w.efdConn = f, rc
}

// park arms the worker and waits until its event fd is readable (an event to
// progress, or a signal from release) or timeout passes (driver only; mu
// held, released on return). Unless the worker is busy: then it returns at
// once, to progress.
//
// It waits in Go's poller, as a network read does: the driver goroutine
// gives up its P, so a goroutine readied just before (a writer with a
// message to send) runs at once. A driver blocked in C keeps its P, and what
// waits on that P runs only once the runtime takes it back, which it checks
// every 20 µs to 10 ms: with one P (a process on one core), every message
// waited for that.
func (w *Worker) park(timeout time.Duration) {
	arm := func() bool {
		if w.queued() || C.rdma_worker_arm(w.cw) != statusOK { // UCS_ERR_BUSY: events to progress
			w.release(false)
			return false
		}
		w.parked.Store(true)
		return true
	}
	if w.efd == nil || w.efd.SetReadDeadline(time.Now().Add(timeout)) != nil {
		if !arm() {
			return
		}
		cw := w.cw
		w.release(false)
		// Only the driver destroys the worker: cw stays valid.
		C.rdma_worker_wait(cw, C.int(timeout/time.Millisecond))
		w.parked.Store(false)
		return
	}
	// Arm inside the read, after the poller forgot earlier readiness:
	// readiness from an event after the arm is then never lost. Readiness
	// from before it is: the poller reports an edge once, and an event that
	// arrived since the last progress (its edge forgotten with the rest)
	// raises no new one, while UCX's tcp transport arms without looking
	// (its arm is a no-op), so the driver would sleep its whole timeout with
	// bytes waiting. The event fd, an epoll set, is readable while any of
	// its descriptors has events: one look after the arm catches them.
	// Should it be readable with nothing to progress, the next park does not
	// look, so the driver cannot spin on it.
	held, armed := true, false
	look := !w.peeked
	w.efdConn.Read(func(fd uintptr) bool {
		if !held {
			return true // readable
		}
		held = false
		if armed = arm(); armed {
			w.release(false)
			if look && readable(fd) {
				w.peeked = true
				return true
			}
		}
		return !armed
	})
	if held { // the read failed before the call
		w.release(false)
	}
	w.parked.Store(false)
}

// quiet reports whether the driver may rest (mu held): every endpoint has its
// peer on this worker, so whoever sends progresses the worker and hands the
// bytes over (submit serves), and no request waits for progress.
func (w *Worker) quiet() bool {
	return len(w.eps) > 0 && w.unpaired == 0 && len(w.pending) == 0 && !w.stopping
}

// rest releases mu and waits for a wake or the next tick (driver only).
func (w *Worker) rest() {
	w.resting.Store(true)
	every := w.tickEvery
	w.release(false)
	w.tick.Reset(every)
	select {
	case <-w.wake:
	case <-w.tick.C:
	}
	w.resting.Store(false)
}

// serve runs queued operations, progresses UCX and handles its events (mu
// held). It reports whether anything happened.
func (w *Worker) serve() bool {
	if w.cw == nil {
		return false
	}
	busy := false
	for {
		q := w.take()
		if len(q) == 0 {
			break
		}
		for _, f := range q {
			f()
		}
		busy = true
	}
	// A handled event may issue a request (a FIN-ACK, the FIN after a
	// flush) whose peer endpoint is on this worker: progress again, so it is
	// delivered now, not when the driver next looks (it may be resting).
	for range serveRounds {
		w.issued = false
		if C.rdma_worker_progress(w.cw, progressBatch) > 0 {
			busy = true
		}
		for {
			n := int(C.rdma_worker_events(w.cw, &w.evs[0], C.int(len(w.evs))))
			for i := range n {
				w.handle(&w.evs[i])
			}
			w.handled = w.handled || n > 0
			if n == 0 {
				break
			}
			busy = true
		}
		if !w.issued {
			break
		}
	}
	if len(w.deferred) > 0 {
		// Queued after what others submitted during this round, and served
		// by whoever holds the lock next (release serves what is queued).
		w.qmu.Lock()
		w.queue = append(w.queue, w.deferred...)
		w.qmu.Unlock()
		clear(w.deferred)
		w.deferred = w.deferred[:0]
		busy = true
	}
	if busy {
		w.lastWork = time.Now()
	}
	return busy
}

// later runs f with the lock held after this round of serve has progressed
// UCX and after what others submitted meanwhile (lock held): an operation in
// pieces issues its next piece there, so that the worker's other endpoints
// are served between two pieces.
func (w *Worker) later(f func()) {
	w.deferred = append(w.deferred, f)
}

// cloexec is the state of markCloexec.
var cloexec struct {
	mu      sync.Mutex
	running bool            // a goroutine is scanning, or resting before it scans again
	again   bool            // asked since the running scan began: it scans again
	waiters []chan struct{} // requests the next scan covers, closed when it ends
	done    time.Time       // when the last scan ended
	took    time.Duration   // how long it took
}

// scanRest is how many times as long as a scan took the scanner waits before
// the next one, so that scanning takes at most a fifth of a processor however
// many descriptors the process has.
const scanRest = 4

// markCloexec marks the descriptors UCX opened close-on-exec, so that child
// processes do not inherit them, on a goroutine of its own. The scan reads
// every descriptor of the process: done with a worker's lock held, once per
// connection request of a burst, it would hold the worker (every session's
// progress, keepalive pings and their answers included) for as many scans in
// a row. Requests made while a scan runs share the next one, which comes
// after a rest (scanRest). It returns a channel closed once a scan that began
// after the request ended: Dial, Listen and Accept wait on it, off the
// worker's lock, so that what they return opened no inheritable descriptor.
// With idle (the driver's periodic look) a request is dropped instead while a
// scan runs or rests, and the channel is nil: the driver asks again when it
// next goes idle.
func markCloexec(idle bool) <-chan struct{} {
	cloexec.mu.Lock()
	defer cloexec.mu.Unlock()
	if idle && (cloexec.running || time.Since(cloexec.done) < max(scanInterval, scanRest*cloexec.took)) {
		return nil
	}
	done := make(chan struct{})
	cloexec.waiters = append(cloexec.waiters, done)
	if cloexec.running {
		cloexec.again = true
		return done
	}
	cloexec.running = true
	go func() {
		for {
			cloexec.mu.Lock()
			cloexec.again = false // what was asked so far, this scan covers
			covered := cloexec.waiters
			cloexec.waiters = nil
			cloexec.mu.Unlock()
			start := time.Now()
			ucxFDs.scan()
			end := time.Now()
			for _, c := range covered {
				close(c)
			}
			cloexec.mu.Lock()
			cloexec.done, cloexec.took = end, end.Sub(start)
			again := cloexec.again
			cloexec.running = again
			cloexec.mu.Unlock()
			if !again {
				return
			}
			time.Sleep(max(scanInterval, scanRest*end.Sub(start)))
		}
	}()
	return done
}

// release unlocks mu, leaving nothing behind: operations queued while mu was
// held are served by this goroutine or by whichever holds mu next (every
// holder checks the queue after unlocking). After work done outside the
// driver (woke), a parked driver is woken to poll: for the requests in flight,
// and for the reply that often follows a send; a resting one, once the worker
// is no longer quiet.
func (w *Worker) release(woke bool) {
	for {
		switch {
		case !woke || w.cw == nil:
		case w.parked.Load():
			C.rdma_worker_signal(w.cw)
		case w.resting.Load() && !w.quiet():
			notify(w.wake)
		}
		w.mu.Unlock()
		if !w.queued() || !w.mu.TryLock() {
			return
		}
		woke = w.serve()
	}
}

func (w *Worker) queued() bool {
	w.qmu.Lock()
	defer w.qmu.Unlock()
	return len(w.queue) > 0
}

func (w *Worker) take() []func() {
	w.qmu.Lock()
	defer w.qmu.Unlock()
	q := w.queue
	w.queue = nil
	return q
}

// submit runs f with the worker's lock held: at once on this goroutine when
// the lock is free, else on the goroutine holding it, before it releases the
// lock. Operations run in the order submitted. It fails once the worker
// closes.
func (w *Worker) submit(f func()) error {
	w.qmu.Lock()
	if w.closed {
		w.qmu.Unlock()
		return closedError("worker")
	}
	w.queue = append(w.queue, f)
	w.qmu.Unlock()
	if w.mu.TryLock() {
		w.release(w.serve())
	}
	return nil
}

// call runs f with the worker's lock held and waits for it.
func (w *Worker) call(f func()) error {
	done := make(chan struct{})
	if err := w.submit(func() { f(); close(done) }); err != nil {
		return err
	}
	select {
	case <-done:
		return nil
	case <-w.exited:
		select {
		case <-done:
			return nil
		default:
		}
		return closedError("worker")
	}
}

// issue starts a UCX request (worker lock held): call gets the request id
// and returns a status, with *req set when in progress. done gets the final
// status, with the lock held.
func (w *Worker) issue(call func(id C.uint64_t, req *unsafe.Pointer) C.int, done func(status int)) {
	w.issued = true
	w.nextID++
	id := w.nextID
	var req unsafe.Pointer
	st := call(C.uint64_t(id), &req)
	if st == statusInProgress {
		w.pending[id] = &op{req: req, done: done}
		return
	}
	done(int(st))
}

func (w *Worker) newID() uint64 {
	w.nextID++
	return w.nextID
}

func (w *Worker) handle(ev *C.rdma_event_t) {
	switch ev.kind {
	case C.RDMA_EV_REQ:
		o := w.pending[uint64(ev.id)]
		if o == nil {
			return
		}
		delete(w.pending, uint64(ev.id))
		C.rdma_request_free(o.req)
		o.done(int(ev.status))
	case C.RDMA_EV_STREAM:
		w.arrived = true
		if e := w.eps[uint64(ev.id)]; e != nil {
			e.drain(false)
		}
	case C.RDMA_EV_FIN:
		w.arrived = true
		if e := w.epByH[uintptr(ev.ptr)]; e != nil {
			e.peerFinished()
		}
	case C.RDMA_EV_FINACK:
		if e := w.epByH[uintptr(ev.ptr)]; e != nil && e.closing {
			e.forceClose()
		}
	case C.RDMA_EV_EP_ERR:
		if e := w.eps[uint64(ev.id)]; e != nil {
			e.peerFailed(int(ev.status))
		}
	case C.RDMA_EV_CONN:
		l := w.listeners[uint64(ev.id)]
		if l == nil {
			return
		}
		l.connRequest(uintptr(ev.ptr))
	}
}

// Flush waits until every put issued on the worker so far completed at its
// target.
func (w *Worker) Flush(ctx context.Context) error {
	res := make(chan error, 1)
	err := w.submit(func() {
		w.issue(func(id C.uint64_t, req *unsafe.Pointer) C.int {
			return C.rdma_worker_flush(w.cw, id, req)
		}, func(st int) { res <- statusError("ucp_worker_flush_nbx", C.int(st)) })
	})
	if err != nil {
		return err
	}
	select {
	case err := <-res:
		if err != nil {
			return fmt.Errorf("rdma: flush: %w", err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("rdma: flush: %w", ctx.Err())
	case <-w.exited:
		return closedError("worker")
	}
}

// Close closes the worker's listeners and endpoints (force close) and the
// worker. It is idempotent. On a context's default worker it does nothing:
// Context.Close closes that one.
func (w *Worker) Close() error {
	if w == w.ctx.def {
		return nil
	}
	return w.close()
}

func (w *Worker) close() error {
	w.closeMu.Lock()
	defer w.closeMu.Unlock()
	w.qmu.Lock()
	if w.closed {
		w.qmu.Unlock()
		<-w.exited
		return nil
	}
	w.queue = append(w.queue, w.teardown)
	w.closed = true
	w.qmu.Unlock()
	w.mu.Lock()
	w.serve()
	w.release(true) // the driver may be parked for long
	<-w.exited      // bounded: the driver gives UCX drainTimeout to complete requests
	clientWorkers.CompareAndDelete(w.clientID, w)
	c := w.ctx
	c.mu.Lock()
	delete(c.workers, w)
	c.mu.Unlock()
	if !w.isDefault {
		live.workers.Add(-1)
	}
	return nil
}

// teardown is the worker's last queued operation.
func (w *Worker) teardown() {
	for _, l := range w.listeners {
		l.markClosed()
		l.destroy()
	}
	for _, e := range w.eps {
		e.fail(closedError("worker"), false)
		e.forceClose()
	}
	w.stopping = true
	w.stopAt = time.Now().Add(drainTimeout)
}

// Listen listens for connection requests on addr ("ip:port"; port 0 picks
// one). Addr reports the bound port.
func (w *Worker) Listen(addr string) (*Listener, error) {
	ap, err := resolve(context.Background(), addr)
	if err != nil {
		return nil, fmt.Errorf("rdma: listen %s: %w", addr, err)
	}
	l := &Listener{w: w, accq: make(chan *Endpoint, acceptBacklog), closedCh: make(chan struct{})}
	l.clients.ctx = w.ctx
	var lerr error
	var marked <-chan struct{}
	err = w.call(func() {
		l.id = w.newID()
		ip := ap.Addr().AsSlice()
		st := C.rdma_listener_create(w.cw, C.uint64_t(l.id), (*C.uint8_t)(unsafe.Pointer(&ip[0])), C.int(len(ip)), C.int(ap.Port()), &l.cl)
		marked = markCloexec(false)
		if st != statusOK {
			lerr = statusError("ucp_listener_create", st)
			return
		}
		port := int(C.rdma_listener_port(l.cl))
		if port <= 0 {
			port = int(ap.Port())
		}
		l.addr = &Addr{IP: net.IP(ap.Addr().AsSlice()), Port: port, Zone: ap.Addr().Zone()}
		w.listeners[l.id] = l
		live.listeners.Add(1)
	})
	if err == nil {
		err = lerr
	}
	if marked != nil {
		<-marked
	}
	if err != nil {
		return nil, fmt.Errorf("rdma: listen %s: %w", addr, err)
	}
	return l, nil
}

// resolve returns addr's IPv4 address and port: a name is looked up and its
// first IPv4 address taken; an IPv6 address gets ErrIPv6.
func resolve(ctx context.Context, addr string) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		if ip := ap.Addr().Unmap(); ip.Is4() {
			return netip.AddrPortFrom(ip, ap.Port()), nil
		}
		return netip.AddrPort{}, ErrIPv6
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	pn, err := net.DefaultResolver.LookupPort(ctx, "tcp", port)
	if err != nil {
		return netip.AddrPort{}, err
	}
	if host == "" {
		return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(pn)), nil
	}
	if ip, err := netip.ParseAddr(host); err == nil && !ip.Unmap().Is4() {
		return netip.AddrPort{}, ErrIPv6
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip4", host)
	if err != nil {
		return netip.AddrPort{}, err
	}
	if len(ips) == 0 {
		return netip.AddrPort{}, fmt.Errorf("no IPv4 address for %s", host)
	}
	return netip.AddrPortFrom(ips[0].Unmap(), uint16(pn)), nil
}

func addrFrom(ip []byte, n C.int, port C.int) *Addr {
	if n != 4 && n != 16 {
		return nil
	}
	return &Addr{IP: net.IP(append([]byte(nil), ip[:n]...)), Port: int(port)}
}

// Listener accepts connection requests on a worker.
type Listener struct {
	w        *Worker
	id       uint64
	cl       *C.rdma_listener_t // lock-only: the worker's lock guards it
	addr     *Addr
	accq     chan *Endpoint
	filter   atomic.Pointer[func(net.Addr) bool]
	once     sync.Once
	closedCh chan struct{}
	isolate  atomic.Bool // IsolateClients
	clients  shares      // the workers of other processes' clients, by client id (isolate.go)
}

// Addr returns the listening address with the bound port.
func (l *Listener) Addr() net.Addr { return l.addr }

// SetFilter sets a function that decides, for each connection request, whether
// to accept it (true) or reject it (false). If nil, all are accepted.
func (l *Listener) SetFilter(f func(remote net.Addr) bool) {
	if f == nil {
		l.filter.Store(nil)
		return
	}
	l.filter.Store(&f)
}

// connRequest runs with the worker's lock held.
func (l *Listener) connRequest(req uintptr) {
	var ip [16]byte
	var n, port C.int
	var remote *Addr
	if C.rdma_conn_request_addr(C.uintptr_t(req), (*C.uint8_t)(unsafe.Pointer(&ip[0])), &n, &port) == statusOK {
		remote = addrFrom(ip[:], n, port)
	}
	if f := l.filter.Load(); f != nil && !(*f)(remote) {
		C.rdma_listener_reject(l.cl, C.uintptr_t(req))
		l.w.ctx.opts.logger.Debug("rdma connection request rejected by the filter", "remote", remote)
		return
	}
	if len(l.accq) == cap(l.accq) {
		C.rdma_listener_reject(l.cl, C.uintptr_t(req))
		l.w.ctx.opts.logger.Warn("rdma connection request rejected: accept backlog full", "remote", remote, "backlog", cap(l.accq))
		return
	}
	w := l.w
	if l.isolate.Load() {
		if id, local := l.requestClient(req); id != 0 && !local {
			if cw := l.clients.hold(id); cw != nil {
				w = cw
			}
		}
	}
	if w != l.w {
		// Accepted now, with l.w's lock still held, never queued: the UCX
		// listener the request came through is freed with l.w's lock held
		// (destroy), and UCX reads it while it accepts. The lock order is
		// l.w's, then the client worker's; a client worker's holder never
		// waits for another worker's lock (submit only tries it).
		w.mu.Lock()
		taken := w.cw != nil && !w.stopping
		if taken {
			l.acceptOn(w, req, remote)
		}
		w.release(taken)
		w.share.drop(w) // the hold; an endpoint accepted holds w on its own
		if taken {
			return
		}
	}
	l.acceptOn(l.w, req, remote)
}

// acceptOn creates the endpoint of a connection request on w and queues it
// for Accept (w's lock held, and l.w's, under which connRequest found room
// in accq).
func (l *Listener) acceptOn(w *Worker, req uintptr, remote *Addr) {
	e := newEndpoint(w)
	var ce *C.rdma_ep_t
	st := C.rdma_ep_accept(w.cw, C.uint64_t(e.id), C.uintptr_t(req), &ce)
	e.marked = markCloexec(false)
	if st != statusOK {
		return
	}
	e.attach(ce)
	if e.raddr == nil {
		e.raddr = remote
	}
	if e.laddr == nil {
		e.laddr = l.addr
	}
	e.pairUp()
	l.accq <- e
}

// Accept waits for and returns the next connection.
func (l *Listener) Accept(ctx context.Context) (*Endpoint, error) {
	select {
	case <-l.closedCh:
		return nil, closedError("listener")
	default:
	}
	select {
	case e := <-l.accq:
		if e.marked != nil {
			<-e.marked // the scan covering the endpoint's descriptors
		}
		return e, nil
	case <-l.closedCh:
		return nil, closedError("listener")
	case <-ctx.Done():
		return nil, fmt.Errorf("rdma: accept: %w", ctx.Err())
	}
}

// Close stops listening and closes connections not yet accepted. It is
// idempotent; Accept then returns an error wrapping net.ErrClosed.
func (l *Listener) Close() error {
	l.markClosed()
	l.w.call(l.destroy)
	return nil
}

func (l *Listener) markClosed() { l.once.Do(func() { close(l.closedCh) }) }

// destroy runs with the worker's lock held.
func (l *Listener) destroy() {
	if l.cl == nil {
		return
	}
	C.rdma_listener_destroy(l.cl)
	l.cl = nil
	delete(l.w.listeners, l.id)
	live.listeners.Add(-1)
	// An Accept may take an endpoint meanwhile: never wait on accq.
	for {
		select {
		case e := <-l.accq:
			end := func() {
				e.fail(closedError("listener"), false)
				e.forceClose()
			}
			if e.w == l.w {
				end()
			} else {
				// On a client's worker, under its lock; a closed worker
				// released it.
				_ = e.w.submit(end)
			}
		default:
			return
		}
	}
}

// readable reports whether fd polls readable now, without waiting.
func readable(fd uintptr) bool {
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd, 0)
	return err == nil && n > 0 && pfd[0].Revents&unix.POLLIN != 0
}
