package devicebuf

import (
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// copyPlan is what a copy between two buffers needs.
type copyPlan struct {
	dir driver.Dir // 0: host to host
	d   driver.Driver
}

func plan(dst, src *Buffer) (copyPlan, error) {
	if dst == nil || src == nil {
		return copyPlan{}, fmt.Errorf("devicebuf: copy with a nil buffer")
	}
	if dst.Released() || src.Released() {
		return copyPlan{}, ErrReleased
	}
	if dst.n != src.n {
		return copyPlan{}, fmt.Errorf("devicebuf: copy of %d bytes into %d bytes: sizes must match", src.n, dst.n)
	}
	var p copyPlan
	switch {
	case dst.a.kind == Host && src.a.kind == Host:
		return p, nil
	case dst.a.kind == CUDA && src.a.kind == Host:
		p.dir, p.d = driver.HtoD, dst.a.drv
	case dst.a.kind == Host && src.a.kind == CUDA:
		p.dir, p.d = driver.DtoH, src.a.drv
	default:
		// CUDA leaves a copy between overlapping device ranges undefined (device
		// addresses are unique across devices).
		if dst.n > 0 && dst.ptr < src.ptr+uintptr(src.n) && src.ptr < dst.ptr+uintptr(dst.n) {
			return p, fmt.Errorf("devicebuf: copy %s <- %s: the device ranges overlap", dst, src)
		}
		p.dir, p.d = driver.DtoD, dst.a.drv
	}
	if p.d == nil {
		d, err := cudaDriver()
		if err != nil {
			return p, err
		}
		p.d = d
	}
	return p, nil
}

func hostCopy(dst, src *Buffer) error {
	db, err := dst.HostBytes()
	if err != nil {
		return err
	}
	sb, err := src.HostBytes()
	if err != nil {
		return err
	}
	copy(db, sb)
	return nil
}

// Copy copies src into dst (any two kinds; lengths must match) and returns when the bytes
// are in place. A device copy is ordered after work queued on the legacy default stream;
// work on other streams that writes src or reads dst must be complete first (synchronize
// those streams, as before handing a buffer to gdrpc). Pending buffers are waited for first.
// Overlapping device ranges are refused: CUDA leaves such a copy undefined.
func Copy(dst, src *Buffer) error {
	p, err := plan(dst, src)
	if err != nil || dst.n == 0 {
		return err
	}
	if !retainAll(dst, src) {
		return ErrReleased
	}
	defer releaseAll(dst, src)
	if p.dir == 0 {
		return hostCopy(dst, src)
	}
	for _, b := range [...]*Buffer{src, dst} {
		if err := b.Wait(); err != nil {
			return fmt.Errorf("devicebuf: copy %s <- %s: %w", dst, src, err)
		}
	}
	err = p.d.Memcpy(p.dir, dst.a.dev, dst.ptr, src.a.dev, src.ptr, dst.n, 0)
	runtime.KeepAlive(dst.a)
	runtime.KeepAlive(src.a)
	if err != nil {
		strandUnsettled(err, dst, src)
		return fmt.Errorf("devicebuf: copy %s <- %s: %w", dst, src, err)
	}
	return nil
}

// Clear sets every byte of b to zero and returns when they are: a memset on the device for
// CUDA memory (the CPU never touches it), in place for host memory.
func Clear(b *Buffer) error {
	if b == nil {
		return fmt.Errorf("devicebuf: clear of a nil buffer")
	}
	if b.n == 0 {
		return nil
	}
	if !b.tryRetain() {
		return ErrReleased
	}
	defer b.Release()
	if b.Kind() == Host {
		hb, err := b.HostBytes()
		if err != nil {
			return err
		}
		clear(hb)
		return nil
	}
	if err := b.Wait(); err != nil {
		return err
	}
	d, err := driverOf(b)
	if err != nil {
		return err
	}
	err = d.MemsetZero(b.a.dev, b.ptr, b.n)
	runtime.KeepAlive(b.a)
	if err != nil {
		strandUnsettled(err, b)
		return fmt.Errorf("devicebuf: clear %s: %w", b, err)
	}
	return nil
}

// Stream is an ordered queue of copies on one CUDA device (a CUDA stream). Copies between
// two host buffers run inline. A Stream retains the buffers of every copy queued on it until
// the copy is known complete (Synchronize or Close). Safe for concurrent use: a Synchronize
// does not hold up copies queued meanwhile.
type Stream struct {
	d       driver.Driver
	dev     int
	s       driver.Stream
	adopted bool // the application's: Close leaves it be

	// life is held for reading by every call on s, for writing by Close.
	life    sync.RWMutex
	mu      sync.Mutex // guards pending and closed
	pending []queued
	closed  bool
}

// queued is what a copy on a stream keeps until it is known complete.
type queued struct {
	bufs [2]*Buffer
	pins *runtime.Pinner // Go memory of the copy, pinned; nil if none
}

// NewStream creates a stream on CUDA device number device, not ordered with the legacy
// default stream. device == -1 makes a host-only stream (no CUDA needed) on which only
// host-to-host copies may be queued.
func NewStream(device int) (*Stream, error) { return newStream(device, false) }

// NewCopyStream creates a stream on CUDA device number device whose copies are ordered
// after work on the legacy default stream, as Copy's are.
func NewCopyStream(device int) (*Stream, error) {
	if device < 0 {
		return nil, fmt.Errorf("devicebuf: copy stream on device %d", device)
	}
	return newStream(device, true)
}

func newStream(device int, blocking bool) (*Stream, error) {
	st := &Stream{dev: device}
	if device >= 0 {
		d, err := checkDevice(device)
		if err != nil {
			return nil, err
		}
		s, err := d.StreamCreate(device, blocking)
		if err != nil {
			return nil, fmt.Errorf("devicebuf: cuStreamCreate on device %d: %w", device, err)
		}
		st.d, st.s = d, s
	} else if device != -1 {
		return nil, fmt.Errorf("devicebuf: stream on device %d", device)
	}
	live.streams.Add(1)
	return st, nil
}

// AdoptStream wraps s, a CUDA stream (CUstream) the application created in the primary
// context of device dev, so that devicebuf queues copies and waits on it: Buffer.WaitOn
// then orders the application's own kernels after a buffer's arrival. Close only lets go
// of it: the stream stays the application's, and must outlive the Stream.
func AdoptStream(dev int, s uintptr) (*Stream, error) {
	d, err := checkDevice(dev)
	if err != nil {
		return nil, err
	}
	if err := d.StreamAdopt(dev, driver.Stream(s)); err != nil {
		return nil, fmt.Errorf("devicebuf: adopt stream on device %d: %w", dev, err)
	}
	live.streams.Add(1)
	return &Stream{d: d, dev: dev, s: driver.Stream(s), adopted: true}, nil
}

// Device returns the stream's CUDA ordinal (-1 for a host-only stream).
func (s *Stream) Device() int { return s.dev }

// Handle returns the CUDA stream (CUstream) for work of the application's own, such as
// kernels launched on it; 0 for a host-only stream. It is valid until Close.
func (s *Stream) Handle() uintptr { return uintptr(s.s) }

func (s *Stream) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// CopyAsync queues a copy of src into dst on s (lengths must match). The bytes are in place
// after s.Synchronize returns nil. The copy waits on the device for Pending buffers. A
// host-to-host copy keeps the stream's order too: on a device stream it waits for the
// copies queued before it (a staging buffer a device copy fills or reads), and it is done
// when CopyAsync returns.
func CopyAsync(s *Stream, dst, src *Buffer) error {
	if s == nil {
		return fmt.Errorf("devicebuf: async copy on a nil stream")
	}
	p, err := plan(dst, src)
	if err != nil || dst.n == 0 {
		return err
	}
	if p.dir == 0 {
		if s.isClosed() {
			return fmt.Errorf("devicebuf: stream: %w", net.ErrClosed)
		}
		if !retainAll(dst, src) {
			return ErrReleased
		}
		defer releaseAll(dst, src)
		if s.d != nil {
			if err := s.Synchronize(); err != nil {
				return fmt.Errorf("devicebuf: copy %s <- %s after the stream's earlier copies: %w", dst, src, err)
			}
		}
		return hostCopy(dst, src)
	}
	if s.d == nil {
		return fmt.Errorf("devicebuf: host-only stream cannot copy %s <- %s", dst, src)
	}
	// The references the queued copy keeps until it is known complete, taken first: a
	// last Release racing the call fails it with ErrReleased instead.
	if !retainAll(dst, src) {
		return ErrReleased
	}
	for _, b := range [...]*Buffer{src, dst} {
		if err := b.WaitOn(s); err != nil {
			releaseAll(dst, src)
			return fmt.Errorf("devicebuf: async copy %s <- %s: %w", dst, src, err)
		}
	}
	s.life.RLock()
	defer s.life.RUnlock()
	if s.isClosed() {
		releaseAll(dst, src)
		return fmt.Errorf("devicebuf: stream: %w", net.ErrClosed)
	}
	q := queued{bufs: [2]*Buffer{dst, src}}
	for _, b := range q.bufs {
		if b.a.goMem {
			if q.pins == nil {
				q.pins = new(runtime.Pinner)
			}
			q.pins.Pin(&b.a.host[0])
		}
	}
	if err := s.d.Memcpy(p.dir, dst.a.dev, dst.ptr, src.a.dev, src.ptr, dst.n, s.s); err != nil {
		q.done()
		return fmt.Errorf("devicebuf: async copy %s <- %s: %w", dst, src, err)
	}
	s.mu.Lock()
	s.pending = append(s.pending, q)
	s.mu.Unlock()
	return nil
}

func (q queued) done() {
	if q.pins != nil {
		q.pins.Unpin()
	}
	for _, b := range q.bufs {
		if b != nil {
			_ = b.Release()
		}
	}
}

// Synchronize waits until every copy queued on s before the call is complete. After a
// failure, the buffers of those copies stay referenced (the device may still run them) until
// a later Synchronize succeeds.
func (s *Stream) Synchronize() error {
	s.life.RLock()
	defer s.life.RUnlock()
	done, err := s.takePending()
	if err != nil {
		return err
	}
	return s.sync(done)
}

// takePending returns the copies queued on s so far and leaves none (life
// held): each of them was queued on the device before it was listed.
func (s *Stream) takePending() ([]queued, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("devicebuf: stream: %w", net.ErrClosed)
	}
	done := s.pending
	s.pending = nil
	return done, nil
}

// sync waits for the device stream and then lets go of done, copies queued
// before. A failed wait lets go of nothing (keep).
func (s *Stream) sync(done []queued) error {
	if s.d != nil {
		if err := s.d.StreamSynchronize(s.s); err != nil {
			s.keep(done)
			return fmt.Errorf("devicebuf: cuStreamSynchronize: %w", err)
		}
	}
	letGo(done)
	return nil
}

// keep holds on to done, copies a failed wait of s left unknown: a failure
// that is not sticky leaves the stream's work going, and a buffer given back
// under a copy could be written while another transfer holds it, or freed
// under the device. They wait for s's next wait, pending again ahead of the
// copies queued since, or, s being closed, stay held for good (stranded):
// memory lost rather than bytes gone astray.
func (s *Stream) keep(done []queued) {
	if len(done) == 0 {
		return
	}
	s.mu.Lock()
	if !s.closed {
		s.pending = append(done, s.pending...)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	stranded.Lock()
	stranded.q = append(stranded.q, done...)
	stranded.Unlock()
}

// stranded holds the copies of closed streams whose last wait failed, and
// the synchronous copies and memsets whose wait failed: their buffers'
// references, and the pins of Go memory among them, which a Pinner
// collected while pinning would report.
var stranded struct {
	sync.Mutex
	q []queued
}

// strandUnsettled holds bufs for good, with a reference of its own on each,
// where err says the device work that reads or writes them was queued and
// may still run (driver.ErrUnsettled): the caller's references go as usual,
// and the memory is lost rather than reused under that work.
func strandUnsettled(err error, bufs ...*Buffer) {
	if !errors.Is(err, driver.ErrUnsettled) {
		return
	}
	var q queued
	for i, b := range bufs {
		q.bufs[i] = b.Retain()
	}
	stranded.Lock()
	stranded.q = append(stranded.q, q)
	stranded.Unlock()
}

// letGo lets go of the buffers of complete copies.
func letGo(done []queued) {
	for _, q := range done {
		q.done()
	}
}

// Close waits for queued copies and destroys the stream. It is idempotent; afterwards calls
// return an error wrapping net.ErrClosed. Where its wait fails, the buffers of the copies
// queued stay referenced for good: their memory is lost rather than reused under a copy.
func (s *Stream) Close() error {
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	done := s.pending
	s.pending = nil
	s.mu.Unlock()
	err := s.sync(done)
	switch {
	case s.d == nil:
	case s.adopted:
		if e := s.d.StreamDisown(s.s); e != nil && err == nil {
			err = fmt.Errorf("devicebuf: let go of an adopted stream: %w", e)
		}
	default:
		if e := s.d.StreamDestroy(s.s); e != nil && err == nil {
			err = fmt.Errorf("devicebuf: cuStreamDestroy: %w", e)
		}
	}
	live.streams.Add(-1)
	return err
}
