//go:build cgo && !nordma

package rdma

/*
#include "ucx.h"
*/
import "C"

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// RemoteKey is a peer's memory key unpacked on an endpoint.
type RemoteKey struct {
	e        *Endpoint
	h        C.ucp_rkey_h // lock-only: the worker's lock guards it; nil once destroyed
	region   packedKey
	domains  []string      // keyDomains of what UCX unpacked (Domains)
	segments []segmentHold // what its checks keep of the segments it names, until it goes
	once     sync.Once
	closeErr error

	// pieces counts the puts and gets issued with the key that UCX has not
	// completed; closed is set by Close. UCX keeps a request's key and uses
	// it until the request completes (a put over TCP goes out in fragments,
	// one queued behind another), so a key closed with pieces in flight is
	// destroyed when the last of them completes. Both are lock-only.
	pieces int
	closed bool

	// seg is where the peer's region starts in this process, or nil: UCX
	// attaches a shared-memory segment of a peer on this host when it
	// unpacks a key of memory allocated there (Context.Alloc), and puts and
	// gets with such a key are copies into or out of it (copyDirect). Set
	// before the key is published, never changed. use guards the
	// attachment: a copy holds it shared, Close and destroy exclusively, so
	// UCX never detaches the segment under a copy; shut is set once Close
	// or destroy began: copies that start later fail.
	seg  unsafe.Pointer
	use  sync.RWMutex
	shut atomic.Bool
	// copying counts the direct copies past the shut check: those a Close
	// lets complete (tests wait for one).
	copying atomic.Int32
}

// KeyDomains returns the kinds of the peer's memory domains ("tcp", "ib",
// "sysv", "posix", "cma", "cuda_ipc", ...) that packed carries and that the
// endpoint's lanes reach: the transports a put with the key may take. Which
// of them bound a put by the key depends on the transport: on some (shared
// memory, CMA, CUDA IPC) this process writes itself wherever the key says.
// An empty result means UCX would emulate the put with active messages that
// the peer applies.
func (e *Endpoint) KeyDomains(packed []byte) ([]string, error) {
	pk, lanes, err := e.keyLanes(packed)
	if err != nil {
		return nil, fmt.Errorf("rdma: key domains: %w", err)
	}
	return keyDomains(pk.rkey, lanes), nil
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
	info, err := e.laneInfo(false)
	if err != nil {
		return nil, fmt.Errorf("rdma: lanes: %w", err)
	}
	doms = rmaDomains(info)
	if doms == nil {
		doms = []string{}
	}
	e.mu.Lock()
	if e.lanes == info { // else read again meanwhile
		e.rmaDoms = doms
	}
	e.mu.Unlock()
	return slices.Clone(doms), nil
}

// laneRefresh is how long the lanes read last stand for a key that names
// memory domains they do not reach (keyLanes): UCX adds lanes once wireup
// completes, and an endpoint asked earlier shows only those of its
// connection's setup.
const laneRefresh = 100 * time.Millisecond

// laneInfo returns ucp_ep_print_info's text for the endpoint, read once
// and again, with refresh, when laneRefresh passed since.
func (e *Endpoint) laneInfo(refresh bool) (string, error) {
	e.mu.Lock()
	info, at := e.lanes, e.lanesAt
	e.mu.Unlock()
	if info != "" && (!refresh || time.Since(at) < laneRefresh) {
		return info, nil
	}
	fresh := e.TransportInfo()
	if !strings.Contains(fresh, "->") {
		if info != "" {
			return info, nil // the endpoint is going: what it showed stands
		}
		return "", cmp.Or(e.termErr(), errors.New("the endpoint shows no lanes"))
	}
	e.mu.Lock()
	if fresh != e.lanes {
		e.lanes, e.rmaDoms = fresh, nil
	}
	e.lanesAt = time.Now()
	e.mu.Unlock()
	return fresh, nil
}

// keyLanes decodes and validates packed, a key made by the peer's
// Memory.PackKey, and returns it with the components of the peer's memory
// domains that e's lanes reach, by index, read again (within laneRefresh)
// when the key names domains they do not.
func (e *Endpoint) keyLanes(packed []byte) (packedKey, map[int]string, error) {
	pk, err := decodeKey(packed)
	if err != nil {
		return pk, nil, err
	}
	if err := validateRkey(pk.rkey, pk.memType); err != nil {
		return pk, nil, err
	}
	info, err := e.laneInfo(false)
	if err != nil {
		return pk, nil, err
	}
	lanes := laneComponents(info)
	if rkeyDomains(pk.rkey)&^laneMask(lanes) == 0 {
		return pk, lanes, nil
	}
	if info, err = e.laneInfo(true); err != nil {
		return pk, nil, err
	}
	return pk, laneComponents(info), nil
}

// UnpackKey unpacks a key made by the peer's Memory.PackKey. The framing is
// validated; the key is valid on this endpoint only.
func (e *Endpoint) UnpackKey(packed []byte) (*RemoteKey, error) { return e.unpackKey(packed, false) }

// UnpackForeignKey is UnpackKey for a peer that is another process: a key
// naming a shared-memory segment that this process made is refused
// (ErrBadKey), for attached it would have this process's puts land in its
// own memory. A peer in this very process takes UnpackKey.
func (e *Endpoint) UnpackForeignKey(packed []byte) (*RemoteKey, error) {
	return e.unpackKey(packed, true)
}

func (e *Endpoint) unpackKey(packed []byte, foreign bool) (*RemoteKey, error) {
	pk, lanes, err := e.keyLanes(packed)
	if err != nil {
		return nil, fmt.Errorf("rdma: unpack key: %w", err)
	}
	// UCX unpacks, and attaches, a component for every memory domain of the
	// peer it reaches, lanes or not; only those of lanes are known by kind,
	// and so checked: the others go.
	pk.rkey = laneKey(pk.rkey, lanes)
	var holds []segmentHold // the segments checked (checkSegment)
	defer func() {
		for _, h := range holds {
			if h.release != nil {
				h.release() // UCX attached them too, or gave up
			}
		}
	}()
	drop := func() {
		for _, h := range holds {
			h.drop()
		}
	}
	if err := rkeyComponents(pk.rkey, func(md int, comp []byte) error {
		h, err := checkSegment(lanes[md], comp, foreign, pk.base, pk.length)
		if err == nil {
			holds = append(holds, h)
		}
		return err
	}); err != nil {
		drop()
		return nil, fmt.Errorf("rdma: unpack key: %w", err)
	}
	k := &RemoteKey{e: e, region: pk, domains: keyDomains(pk.rkey, lanes), segments: holds}
	var uerr error
	direct := pk.memType == MemoryHost && pk.length > 0 && pk.length <= math.MaxInt && e.w.ctx.opts.direct && goTakesFaults()
	err = e.w.call(func() {
		if e.ce == nil || e.ucpClosed {
			uerr = e.opError("ucp_ep_rkey_unpack", statusCanceled)
			return
		}
		var before []mapping
		if direct {
			before = mappings()
		}
		st := C.rdma_rkey_unpack(e.ce, unsafe.Pointer(&pk.rkey[0]), &k.h)
		if st != statusOK {
			uerr = statusError("ucp_ep_rkey_unpack", st)
			return
		}
		// UCX computes the pointer from where it attached the segment and
		// the address the peer names, without a bound: a key whose region
		// lies elsewhere than its segment would name other memory of this
		// process. The whole region must lie in a shared mapping that this
		// unpack made, with the worker's lock held throughout, so that no
		// other endpoint of the worker attached one meanwhile.
		var seg unsafe.Pointer
		if before != nil && C.rdma_rkey_ptr(k.h, C.uint64_t(pk.base), &seg) == statusOK && seg != nil &&
			attachedSegment(before, mappings(), uintptr(seg), int(pk.length)) {
			k.seg = seg
		}
		e.rkeys[k] = struct{}{}
		live.rkeys.Add(1)
	})
	if err == nil {
		err = uerr
	}
	if err != nil {
		drop()
		return nil, fmt.Errorf("rdma: unpack key: %w", err)
	}
	return k, nil
}

// Direct reports whether puts and gets with the key are copies this process
// makes into the peer's shared-memory segment (WithDirectCopies).
func (k *RemoteKey) Direct() bool { return k.seg != nil }

// Domains returns the kinds of the peer's memory domains the key carries,
// as UCX unpacked it: those of the lanes its unpack read (KeyDomains of the
// same key may have read the lanes at another time, before wireup ended).
func (k *RemoteKey) Domains() []string { return slices.Clone(k.domains) }

// Close releases the key: puts and gets that start later fail, those already
// started complete, and UCX's key goes when the last of them has. It is
// idempotent; closing the endpoint releases its keys too.
func (k *RemoteKey) Close() error {
	k.once.Do(func() {
		if k.seg != nil {
			// Direct copies that started complete, later ones fail: wait
			// for those under way, off the worker's lock.
			k.stopCopies()
		}
		if err := k.e.w.call(k.close); err != nil && !errors.Is(err, net.ErrClosed) {
			k.closeErr = err
		}
	})
	return k.closeErr
}

// stopCopies fails the direct copies that start from now on and waits for
// those under way.
func (k *RemoteKey) stopCopies() {
	k.shut.Store(true)
	k.use.Lock()
	k.use.Unlock() //nolint:staticcheck // an empty section: the wait is the point
}

// close runs with the worker's lock held.
func (k *RemoteKey) close() {
	k.closed = true
	if k.pieces == 0 {
		k.destroy()
	}
}

// destroy releases UCX's key at once (worker lock held): when no piece uses
// it, or when the endpoint's release completed every request on it.
func (k *RemoteKey) destroy() {
	if k.h == nil {
		return
	}
	if k.seg != nil {
		// The segment goes with the key: wait for the direct copy under
		// way, which its endpoint's end (the only other way here once
		// Close waited) stops at its next piece.
		k.stopCopies()
	}
	C.rdma_rkey_destroy(k.e.w.cw, k.h)
	k.h = nil
	for _, h := range k.segments {
		h.drop()
	}
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
// Put issues no further piece (see rmaPiece), still waits for what it issued
// to complete, or for the endpoint to fail, and then returns ctx's error.
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
	if key.Direct() {
		return e.copyDirect(ctx, false, p, remote, key)
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
	if m.ctx != e.w.ctx {
		// UCX takes a memory handle only on its own context's workers, and
		// closing that context would unmap m under an operation of this one.
		return errors.New("rdma: memory registered on another context than the endpoint's")
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
	if m.mt == MemoryHost && key.Direct() {
		defer m.release()
		return e.copyDirect(ctx, get, m.Bytes()[off:off+n], remote, key)
	}
	return e.rma(ctx, get, m.addr+uintptr(off), n, m, remote, key, m.release)
}

// Go's copy writes around the caches (non-temporal stores) from 1 MiB up on
// amd64: twice as fast as cached stores for a 16 or 64 MiB payload, half as
// fast for a payload that fits in the caches, which the receiver reads next
// (2-core VM, BenchmarkBandwidth). A direct copy of at most directCached bytes
// goes in pieces of directCachedPiece, under that threshold.
const (
	directCached      = 4 << 20
	directCachedPiece = 512 << 10
)

// A direct copy of at least 2*directShare bytes is shared by up to
// directWorkers goroutines (GOMAXPROCS at most), each taking the next piece
// in turn and each copying directShare bytes or more: one core's copy reaches a part of the
// memory's bandwidth (2-core VM, 64 MiB: 26 GiB/s on one goroutine, 46-50
// GiB/s on two), and waking a second goroutine costs more than it saves on a
// smaller copy.
const (
	directWorkers = 4
	directShare   = 16 << 20
)

// copyDirect runs a put from, or a get into, local as a copy between local and
// the peer's segment that key attached, in pieces: between two pieces it
// stops when ctx ended or the endpoint failed, as a put of UCX's issues no
// further piece. A key closed after the copy began does not stop it (Close
// waits). The bytes are in place when it returns: Flush has nothing to wait
// for.
func (e *Endpoint) copyDirect(ctx context.Context, get bool, local []byte, remote uint64, key *RemoteKey) error {
	key.use.RLock()
	defer key.use.RUnlock()
	if key.shut.Load() {
		return cmp.Or(e.termErr(), error(closedError("remote key")))
	}
	key.copying.Add(1)
	defer key.copying.Add(-1)
	// checkRMA bounded [remote, remote+len(local)) by the region, which lies
	// in the segment (UnpackKey).
	seg := unsafe.Slice((*byte)(unsafe.Add(key.seg, remote-key.region.base)), len(local))
	return directCopy{e: e, ctx: ctx, get: get, local: local, seg: seg}.run()
}

// run copies the whole of local, in pieces, on this goroutine or shared with
// others (directWorkers).
func (c directCopy) run() error {
	piece := rmaPiece
	if len(c.local) <= directCached {
		piece = directCachedPiece
	}
	workers := min(directWorkers, runtime.GOMAXPROCS(0), len(c.local)/directShare)
	if workers < 2 {
		for lo := 0; lo < len(c.local); lo += piece {
			if err := c.copyPiece(lo, piece); err != nil {
				return err
			}
		}
		return nil
	}
	// The goroutines take the pieces in turn; a failed piece stops them.
	shared := c // what escapes to the goroutines: the loop above stays on the stack
	var next atomic.Int64
	var failed atomic.Bool
	run := func() error {
		for !failed.Load() {
			lo := int(next.Add(int64(piece)) - int64(piece))
			if lo >= len(shared.local) {
				return nil
			}
			if err := shared.copyPiece(lo, piece); err != nil {
				failed.Store(true)
				return err
			}
		}
		return nil
	}
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 1; w < workers; w++ {
		wg.Go(func() { errs[w] = run() })
	}
	errs[0] = run()
	wg.Wait()
	return cmp.Or(errs...)
}

// directCopy is a direct copy between local and the peer's segment.
type directCopy struct {
	e          *Endpoint
	ctx        context.Context
	get        bool
	local, seg []byte
}

// copyPiece copies the piece at lo, at most piece bytes, unless the copy's
// context ended or its endpoint failed.
func (c directCopy) copyPiece(lo, piece int) error {
	if err := c.ctx.Err(); err != nil {
		return fmt.Errorf("rdma: direct copy: %w", err)
	}
	if err := c.e.termErr(); err != nil {
		return err
	}
	hi := min(lo+piece, len(c.local))
	if c.get {
		return copyGuarded(c.local[lo:hi], c.seg[lo:hi])
	}
	return copyGuarded(c.seg[lo:hi], c.local[lo:hi])
}

// copyGuarded copies src into dst and turns a fault of either into an error.
// A peer may shrink the file behind its segment after this process attached
// it: the pages past the file's end then fault (SIGBUS), which must fail the
// copy, not the process.
func copyGuarded(dst, src []byte) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(interface{ Addr() uintptr })
			if !ok {
				panic(r)
			}
			err = fmt.Errorf("rdma: direct copy: the peer's segment faulted at %#x", f.Addr())
		}
	}()
	copy(dst, src)
	return nil
}

// rmaPiece is the largest piece of a put or get between host memories that
// is issued at once. Over shared memory a put is a copy this process makes
// inside the UCX call, with the worker's lock held: issued whole, a large one
// would keep every other endpoint of the worker (other sessions' sends and
// the messages arriving for them) waiting until the whole copy is done.
// Between two pieces the worker runs what was queued meanwhile and
// progresses. GPU memory on either side goes whole: UCX queues its copies.
const rmaPiece = 4 << 20

// rma runs a put from, or a get into, local[:n]; m is local's registration (nil
// for pinned Go memory), which tells UCX its memory type and handle. It calls
// release once UCX is done with local.
func (e *Endpoint) rma(ctx context.Context, get bool, local uintptr, n int, m *Memory, remote uint64, key *RemoteKey, release func()) error {
	if err := e.termErr(); err != nil {
		release()
		return err
	}
	op := &rmaOp{e: e, get: get, local: local, n: n, piece: n, remote: remote, key: key, release: release, res: make(chan error, 1), scheduled: true}
	if m != nil {
		op.memh = m.h
		op.cuda = m.mt == MemoryCUDA
	}
	if !op.cuda && key.region.memType != MemoryCUDA && n > rmaPiece {
		op.piece = rmaPiece
	}
	if err := e.w.submit(op.issueNext); err != nil {
		release()
		return err
	}
	var ctxErr error
	select {
	case err := <-op.res:
		return err
	case <-ctx.Done():
		// UCX cannot cancel the operation: until it completes it may still
		// read the local memory and write the peer's, which the caller would
		// otherwise reuse, or report failed, at once. No further piece is
		// issued.
		op.stop.Store(true)
		ctxErr = fmt.Errorf("rdma: %s: %w", op.name(), ctx.Err())
		select {
		case err := <-op.res:
			return cmp.Or(ctxErr, err)
		case <-e.done:
		}
	case <-e.done:
	}
	// The endpoint ended: no further piece is issued (issueNext), and its
	// close or failure completes those in flight, until when UCX may still
	// read the local memory, which the caller would reuse at once.
	if err, ok := e.awaitEnded(op.res); ok {
		return cmp.Or(ctxErr, err) // every piece completed, or why one did not
	}
	return cmp.Or(ctxErr, e.termErr())
}

// awaitEnded waits for the outcome of an operation on an endpoint that
// ended, whose close or failure completes it: until then UCX may still
// read, or write, the caller's memory. It gives up (ok false) once the
// worker is gone, which completes nothing more, or after the linger timeout
// and a second more.
func (e *Endpoint) awaitEnded(res <-chan error) (err error, ok bool) {
	t := time.NewTimer(lingerTimeout + time.Second)
	defer t.Stop()
	select {
	case err := <-res:
		return err, true
	case <-e.w.exited:
	case <-t.C:
	}
	return nil, false
}

// rmaOp is a put or get in flight, issued in pieces of at most piece bytes,
// one after another on the worker. Its state past the fields set at its
// making is lock-only, but stop.
type rmaOp struct {
	e       *Endpoint
	get     bool
	local   uintptr
	n       int
	piece   int
	memh    C.ucp_mem_h
	cuda    bool
	remote  uint64
	key     *RemoteKey
	release func()
	res     chan error  // the outcome, once
	stop    atomic.Bool // the caller gave up: issue no more pieces

	next      int   // offset of the next piece
	inflight  int   // pieces issued and not complete
	scheduled bool  // issueNext runs, or waits for the worker's next round
	failed    error // the first piece's failure
	done      bool  // res was sent
}

func (op *rmaOp) name() string {
	if op.get {
		return "ucp_get_nbx"
	}
	return "ucp_put_nbx"
}

// issueNext issues the next piece and leaves the one after it for the
// worker's next round (worker lock held).
func (op *rmaOp) issueNext() {
	if op.failed == nil && (op.key.h == nil || op.key.closed && op.next == 0) {
		// Keys go with their endpoint: when it failed, say why.
		op.failed = cmp.Or(op.e.termErr(), error(closedError("remote key")))
	}
	if op.failed == nil {
		// The endpoint ended (closed here, failed, or closed by the peer):
		// no further piece, so that the caller gets its memory back once
		// those in flight complete.
		op.failed = op.e.termErr()
	}
	if op.failed != nil || op.stop.Load() {
		op.scheduled = false
		op.finish()
		return
	}
	off, k := op.next, min(op.piece, op.n-op.next)
	op.next += k
	op.inflight++
	op.key.pieces++
	cuda := C.int(0)
	if op.cuda {
		cuda = 1
	}
	w, local, remote := op.e.w, C.uintptr_t(op.local+uintptr(off)), C.uint64_t(op.remote+uint64(off))
	op.e.issue(func(ce *C.rdma_ep_t, id C.uint64_t, req *unsafe.Pointer) C.int {
		if op.get {
			return C.rdma_get(w.cw, ce, local, C.size_t(k), cuda, op.memh, remote, op.key.h, id, req)
		}
		return C.rdma_put(w.cw, ce, local, C.size_t(k), cuda, op.memh, remote, op.key.h, id, req)
	}, func(st int) {
		op.inflight--
		if op.key.pieces--; op.key.pieces == 0 && op.key.closed {
			op.key.destroy()
		}
		if err := op.e.opError(op.name(), st); err != nil && op.failed == nil {
			op.failed = err
		}
		op.finish()
	})
	if op.next < op.n && op.failed == nil && !op.stop.Load() {
		w.later(op.issueNext)
		return
	}
	op.scheduled = false
	op.finish()
}

// finish reports the outcome once no piece is in flight and none will be
// issued (worker lock held).
func (op *rmaOp) finish() {
	if op.done || op.scheduled || op.inflight > 0 {
		return
	}
	op.done = true
	op.release()
	op.res <- op.failed
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
