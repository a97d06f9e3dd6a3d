//go:build cgo && !nordma

package rdma

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
