package devicebuf

import (
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
// those streams, as before handing a buffer to gdrpc).
func Copy(dst, src *Buffer) error {
	p, err := plan(dst, src)
	if err != nil || dst.n == 0 {
		return err
	}
	if p.dir == 0 {
		return hostCopy(dst, src)
	}
	err = p.d.Memcpy(p.dir, dst.a.dev, dst.ptr, src.a.dev, src.ptr, dst.n, 0)
	runtime.KeepAlive(dst.a)
	runtime.KeepAlive(src.a)
	if err != nil {
		return fmt.Errorf("devicebuf: copy %s <- %s: %w", dst, src, err)
	}
	return nil
}

// Clear sets every byte of b to zero and returns when they are: a memset on the device for
// CUDA memory (the CPU never touches it), in place for host memory.
func Clear(b *Buffer) error {
	if b.n == 0 {
		return nil
	}
	if b.Kind() == Host {
		hb, err := b.HostBytes()
		if err != nil {
			return err
		}
		clear(hb)
		return nil
	}
	d, err := checkDevice(b.a.dev)
	if err != nil {
		return err
	}
	err = d.MemsetZero(b.a.dev, b.ptr, b.n)
	runtime.KeepAlive(b.a)
	if err != nil {
		return fmt.Errorf("devicebuf: clear %s: %w", b, err)
	}
	return nil
}

// Stream is an ordered queue of copies on one CUDA device (a CUDA stream). Copies between
// two host buffers run inline. A Stream retains the buffers of every copy queued on it until
// the copy is known complete (Synchronize or Close). Safe for concurrent use.
type Stream struct {
	mu      sync.Mutex
	d       driver.Driver
	dev     int
	s       driver.Stream
	pending []*Buffer
	pins    runtime.Pinner
	closed  bool
}

// NewStream creates a stream on CUDA device dev. dev == -1 makes a host-only stream (no
// CUDA needed) on which only host-to-host copies may be queued.
func NewStream(device int) (*Stream, error) {
	st := &Stream{dev: device}
	if device >= 0 {
		d, err := checkDevice(device)
		if err != nil {
			return nil, err
		}
		s, err := d.StreamCreate(device)
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

// Device returns the stream's CUDA ordinal (-1 for a host-only stream).
func (s *Stream) Device() int { return s.dev }

// CopyAsync queues a copy of src into dst on s (lengths must match). The bytes are in place
// after s.Synchronize returns nil. Host-to-host copies run before CopyAsync returns.
func CopyAsync(s *Stream, dst, src *Buffer) error {
	p, err := plan(dst, src)
	if err != nil || dst.n == 0 {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("devicebuf: stream: %w", net.ErrClosed)
	}
	if p.dir == 0 {
		return hostCopy(dst, src)
	}
	if s.d == nil {
		return fmt.Errorf("devicebuf: host-only stream cannot copy %s <- %s", dst, src)
	}
	for _, b := range [...]*Buffer{dst, src} {
		if b.a.goMem {
			s.pins.Pin(&b.a.host[0])
		}
	}
	if err := s.d.Memcpy(p.dir, dst.a.dev, dst.ptr, src.a.dev, src.ptr, dst.n, s.s); err != nil {
		return fmt.Errorf("devicebuf: async copy %s <- %s: %w", dst, src, err)
	}
	s.pending = append(s.pending, dst.Retain(), src.Retain())
	return nil
}

// Synchronize waits until every copy queued on s is complete.
func (s *Stream) Synchronize() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("devicebuf: stream: %w", net.ErrClosed)
	}
	return s.syncLocked()
}

func (s *Stream) syncLocked() error {
	var err error
	if s.d != nil {
		if e := s.d.StreamSynchronize(s.s); e != nil {
			err = fmt.Errorf("devicebuf: cuStreamSynchronize: %w", e)
		}
	}
	for _, b := range s.pending {
		_ = b.Release()
	}
	s.pending = s.pending[:0]
	s.pins.Unpin()
	return err
}

// Close waits for queued copies and destroys the stream. It is idempotent; afterwards calls
// return an error wrapping net.ErrClosed.
func (s *Stream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	err := s.syncLocked()
	if s.d != nil {
		if e := s.d.StreamDestroy(s.s); e != nil && err == nil {
			err = fmt.Errorf("devicebuf: cuStreamDestroy: %w", e)
		}
	}
	live.streams.Add(-1)
	return err
}
