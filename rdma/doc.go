// Package rdma is the binding to UCX (libucp): contexts, workers and their
// progress engine, listeners, endpoints carrying a byte stream (an Endpoint is a
// net.Conn), registered memory, packed remote keys, and one-sided put/get/flush.
//
// It owns every call into UCX and is the only package of gdrpc that imports "C"
// for UCX. Above it everything is plain Go.
//
// Each Worker has one owner goroutine locked to its OS thread; every UCX call for
// that worker is made there. Other goroutines submit operations through a queue
// and wake the owner with ucp_worker_signal; completions come back on channels.
// When idle the owner arms the worker and sleeps on its event fd, so an idle
// worker burns no CPU. UCX callbacks carry integer ids, never Go pointers.
//
// What this package must never do: hand a Go pointer to UCX past the call that
// uses it (bytes are copied into C memory or pinned for exactly one operation),
// register Go heap memory for longer than one operation, touch memory of type
// MemoryCUDA from the CPU, or hand CUDA memory to a UCX that cannot register it.
// It knows nothing about peers, sessions or protocols: that is the transport's job.
//
// A build without cgo, or with the build tag nordma, compiles the same API and
// every call reports ErrNotSupported.
package rdma
