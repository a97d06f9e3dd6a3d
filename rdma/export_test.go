//go:build cgo && !nordma

package rdma

import (
	"fmt"
	"time"
)

// Paired reports whether the endpoint's peer endpoint is on its worker.
func (e *Endpoint) Paired() (p bool) {
	e.w.call(func() { p = e.pair != nil })
	return p
}

// Quiet reports whether the worker's driver may rest.
func (w *Worker) Quiet() (q bool) {
	w.call(func() { q = w.quiet() })
	return q
}

// Parked reports whether the worker's driver waits on the event fd now.
func (w *Worker) Parked() bool { return w.parked.Load() }

// Yielded reports whether the worker's driver has yielded its core.
func (w *Worker) Yielded() bool { return w.yields.Load() > 0 }

// SetPark runs hook (nil: none) before each park of the worker's driver,
// with the worker's event fd; a timeout it returns replaces the park's.
func (w *Worker) SetPark(hook func(efd int) time.Duration) {
	w.call(func() { w.testPark = hook })
}

// Resting reports whether the worker's driver rests now.
func (w *Worker) Resting() bool { return w.resting.Load() }

// SetQuietTick sets how often the worker's resting driver looks around; a
// long tick leaves everything but the wake-ups to the code under test.
func (w *Worker) SetQuietTick(d time.Duration) {
	w.call(func() { w.tickEvery = d })
	notify(w.wake) // the next rest takes it
}

// PieceSize is the largest piece of a put or get between host memories.
const PieceSize = rmaPiece

// Hold takes the worker's lock; the returned func gives it back, serving what
// was submitted meanwhile.
func (w *Worker) Hold() (release func()) {
	w.mu.Lock()
	return func() { w.release(false) }
}

// Queued returns how many submitted operations wait for the worker's lock.
func (w *Worker) Queued() int {
	w.qmu.Lock()
	defer w.qmu.Unlock()
	return len(w.queue)
}

// Submit runs f with the worker's lock held, after what was submitted before.
func (w *Worker) Submit(f func()) error { return w.submit(f) }

// Later runs f in the worker's next round, after what ran in this one
// deferred before it (worker lock held: from a function Submit runs).
func (w *Worker) Later(f func()) { w.later(f) }

// SegmentAt is where UCX attached the key's segment in this process, or 0.
func (k *RemoteKey) SegmentAt() uintptr { return uintptr(k.seg) }

// Copying reports whether a direct copy with the key is under way.
func (k *RemoteKey) Copying() bool { return k.copying.Load() > 0 }

// RingLen is the size of e's inbound ring.
func (e *Endpoint) RingLen() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.in)
}

// RingInitial is an inbound ring's first size.
const RingInitial = ringInitial

// DrainMax bounds the inbound ring once the peer closed.
const DrainMax = drainMax

// ErrUnreadCut ends the reads of an endpoint whose peer closed it with more
// unread than DrainMax.
var ErrUnreadCut = errUnreadCut

// OnWorker reports whether the endpoint is on w.
func (e *Endpoint) OnWorker(w *Worker) bool { return e.w == w }

// SendFIN sends the peer the FIN that a graceful close sends, without
// closing e: a peer that announces its close and goes on sending.
func (e *Endpoint) SendFIN() error {
	res := make(chan int, 1)
	if err := e.w.submit(func() { e.issueFIN(false, func(st int) { res <- st }) }); err != nil {
		return err
	}
	if st := <-res; st != statusOK {
		return fmt.Errorf("rdma: FIN: status %d", st)
	}
	return nil
}

// FINAcksSent is how many FIN-ACKs e issued to its peer.
func (e *Endpoint) FINAcksSent() (int, error) {
	res := make(chan int, 1)
	if err := e.w.submit(func() { res <- e.finAcks }); err != nil {
		return 0, err
	}
	return <-res, nil
}

// Buffered is how many received bytes e holds for its Reads.
func (e *Endpoint) Buffered() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n
}

// Handle is the address of e's UCX endpoint, by which UCX's FIN and FIN-ACK
// events name it (0 once released).
func (e *Endpoint) Handle() (h uintptr) {
	_ = e.w.call(func() { h = e.handle() })
	return h
}

// EndpointAt is the endpoint that events naming UCX endpoint h reach.
func (e *Endpoint) EndpointAt(h uintptr) (owner *Endpoint) {
	_ = e.w.call(func() { owner = e.w.epByH[h] })
	return owner
}

// SetEndpointAt makes events naming UCX endpoint h reach owner (nil: none),
// as UCX giving a released endpoint's address to a new one does.
func (e *Endpoint) SetEndpointAt(h uintptr, owner *Endpoint) {
	_ = e.w.call(func() {
		if owner == nil {
			delete(e.w.epByH, h)
			return
		}
		e.w.epByH[h] = owner
	})
}

// SetMaxApart sets how many client workers the listener keeps apart.
func (l *Listener) SetMaxApart(n int) {
	l.clients.mu.Lock()
	defer l.clients.mu.Unlock()
	l.clients.max = n
}
