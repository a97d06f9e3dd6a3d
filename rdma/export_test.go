//go:build cgo && !nordma

package rdma

import "time"

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

// Resting reports whether the worker's driver rests now.
func (w *Worker) Resting() bool { return w.resting.Load() }

// SetQuietTick sets how often the worker's resting driver looks around; a
// long tick leaves everything but the wake-ups to the code under test.
func (w *Worker) SetQuietTick(d time.Duration) {
	w.call(func() { w.tickEvery = d })
	notify(w.wake) // the next rest takes it
}
