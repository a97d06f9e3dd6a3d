package devicebuf

import (
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"sync"
	"time"
)

// Registrar registers memory with the RDMA layer. Register is called once per pool region,
// when the region is created; the returned release runs when the region is freed (idle, or
// at Close). reg is what Buffer.Registration returns for buffers carved from the region.
type Registrar interface {
	Register(ptr uintptr, n int, kind Kind, device int) (reg any, release func() error, err error)
}

// PoolConfig configures NewPool.
type PoolConfig struct {
	// Backing is where regions come from. If nil (and Regions is nil), a host allocator.
	Backing Allocator
	// Regions, if not nil, makes regions of n bytes instead of Backing (for example memory
	// allocated by UCX, or a user's own region). The pool owns and releases what it returns.
	// Regions must not return Go memory.
	Regions func(n int) (*Buffer, error)
	// Registrar, if not nil, registers each region once when it is created; regions stay
	// registered until they are freed (see IdleTimeout) or Close.
	Registrar Registrar
	// Classes are the block sizes, ascending. If nil, powers of two from 4 KiB to 64 MiB.
	Classes []int
	// MaxBytes bounds the total bytes of regions. If zero, 1 GiB.
	MaxBytes int64
	// RegionBytes is the size of a region carved into blocks of the classes smaller than it,
	// at most a third of MaxBytes (so that blocks of three classes fit the bound together);
	// a class as large or larger gets regions of one block. If zero, 4 MiB.
	RegionBytes int
	// Oversize gives an allocation above the largest class a region of its own (counted in
	// MaxBytes, freed when the buffer is released). If false, such allocations fail with an
	// error wrapping ErrExhausted.
	Oversize bool
	// IdleTimeout is how long a region with no block handed out is kept before it is freed
	// (deregistered and given back to its source), so that memory taken for a burst, or for
	// transfers that were refused or aborted, does not stay pinned. If zero, 30 s; negative
	// keeps such regions until Close. Whatever the timeout, regions with no block handed out
	// are freed at once when an allocation of another class needs their room under MaxBytes.
	IdleTimeout time.Duration
	// Clock drives IdleTimeout. If nil, the system clock.
	Clock Clock
}

// DefaultPoolIdleTimeout is PoolConfig.IdleTimeout's default.
const DefaultPoolIdleTimeout = 30 * time.Second

// Clock is the time source of a pool's idle trimming (tests drive a fake one).
type Clock interface {
	Now() time.Time
	// AfterFunc arranges for f to run once d has passed, never from within AfterFunc itself
	// (the pool calls it with its lock held); stop cancels that and reports whether it did.
	AfterFunc(d time.Duration, f func()) (stop func() bool)
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) AfterFunc(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }

// PoolStats are a pool's counters.
type PoolStats struct {
	Regions       int   // regions alive
	RegionBytes   int64 // bytes of regions alive
	Registrations int64 // Registrar registrations made over the pool's life
	InUse         int   // buffers handed out and not yet returned
	BytesInUse    int64 // bytes of the blocks handed out and not yet returned
	Hits          int64 // allocations served from a free block
	Misses        int64 // allocations that created a region
	Exhausted     int64 // allocations refused with ErrExhausted
	Waits         int64 // times an allocation waited for a region of its class being made
	Freed         int64 // regions freed before Close: idle too long, or room for another class
}

// Pool hands out buffers carved from large regions in size classes. Regions are created on
// demand (up to MaxBytes) and registered once; released buffers go back to their class's
// free list. A region none of whose blocks is handed out is freed after IdleTimeout, or at
// once when another class needs its room. A class grows one region at a time: allocations
// that find no free block while a region of their class is being made wait for it and take
// its blocks, so a burst grows the pool by what it asks for, not by a region per caller.
// A Pool is an Allocator; it is safe for concurrent use.
type Pool struct {
	cfg PoolConfig

	mu          sync.Mutex
	grown       *sync.Cond // broadcast when a class's growth ends (and at Close)
	kind        Kind
	dev         int
	classes     []poolClass
	sizes       []int // classes[i].size
	regions     map[*poolRegion]struct{}
	total       int64
	inUse       int
	bytesInUse  int64
	stats       PoolStats
	closed      bool
	closeFreed  bool
	regionsMade bool
	trimArmed   bool        // a call of trim is scheduled
	stopTrim    func() bool // cancels it
}

type poolClass struct {
	size    int
	free    []poolBlock
	growing bool // a region of this class is being made
}

type poolRegion struct {
	buf       *Buffer
	size      int
	reg       any
	release   func() error
	ci        int       // class index; -1 for an oversize region
	used      int       // blocks handed out
	idleSince time.Time // when used last dropped to zero
}

type poolBlock struct {
	r   *poolRegion
	ptr uintptr
	ci  int // class index; -1 for an oversize region
}

// Payload pools' classes (NewPayloadPool): every power of two from the smallest
// payload that travels out-of-band by default to the largest a class serves.
const (
	payloadClassMin = 64 << 10
	payloadClassMax = 8 << 30
)

// NewPayloadPool returns a pool for received payloads of any size in memory from backing
// (devicebuf.NewCUDAAllocator for a GPU): blocks of every power of two from 64 KiB to
// 8 GiB, each reused by later payloads of its class (on a GPU, so is a sender's CUDA IPC
// mapping of it), and a region of its own for a payload over 8 GiB. maxBytes bounds the
// memory it holds, blocks in use and idle ones: an allocation that does not fit fails
// with ErrExhausted, so size it for the largest payloads in flight at once. It is what
// gdrcodec.WithReceiveAllocator wants for GPU memory: a bare CUDA allocator allocates,
// frees, and has the sender map anew, every payload.
func NewPayloadPool(backing Allocator, maxBytes int64) (*Pool, error) {
	if backing == nil || maxBytes <= 0 {
		return nil, fmt.Errorf("devicebuf: payload pool needs a backing allocator and a positive bound (got %v, %d bytes)", backing, maxBytes)
	}
	var classes []int
	for c := payloadClassMin; c <= payloadClassMax; c <<= 1 {
		classes = append(classes, c)
	}
	return NewPool(PoolConfig{Backing: backing, Classes: classes, MaxBytes: maxBytes, Oversize: true})
}

// NewPool returns a pool configured by cfg. It creates no region until the first Alloc.
func NewPool(cfg PoolConfig) (*Pool, error) {
	if cfg.Backing == nil && cfg.Regions == nil {
		cfg.Backing = NewHostAllocator()
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = 1 << 30
	}
	if cfg.MaxBytes < 0 {
		return nil, fmt.Errorf("devicebuf: pool MaxBytes %d", cfg.MaxBytes)
	}
	if cfg.RegionBytes == 0 {
		cfg.RegionBytes = 4 << 20
	}
	if cfg.RegionBytes < 0 {
		return nil, fmt.Errorf("devicebuf: pool RegionBytes %d", cfg.RegionBytes)
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultPoolIdleTimeout
	}
	if cfg.Clock == nil {
		cfg.Clock = systemClock{}
	}
	classes := slices.Clone(cfg.Classes)
	if classes == nil {
		for s := 4 << 10; s <= 64<<20; s <<= 1 {
			classes = append(classes, s)
		}
	}
	if len(classes) == 0 {
		return nil, errors.New("devicebuf: pool with no size classes")
	}
	slices.Sort(classes)
	classes = slices.Compact(classes)
	if classes[0] <= 0 {
		return nil, fmt.Errorf("devicebuf: pool size class %d", classes[0])
	}
	p := &Pool{cfg: cfg, kind: Host, dev: -1, regions: map[*poolRegion]struct{}{}}
	p.grown = sync.NewCond(&p.mu)
	if cfg.Backing != nil {
		p.kind, p.dev = cfg.Backing.Kind(), cfg.Backing.Device()
	}
	for _, s := range classes {
		p.classes = append(p.classes, poolClass{size: s})
	}
	p.sizes = classes
	return p, nil
}

// Kind returns the kind of the pool's memory (for a pool fed by Regions alone, that of its
// first region; Host before one exists).
func (p *Pool) Kind() Kind {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.kind
}

// Device returns the CUDA ordinal of the pool's memory (-1 for host).
func (p *Pool) Device() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dev
}

// regionSize is the size of a region for class size s: RegionBytes' worth
// of its blocks, or one block. A region of several blocks takes at most a
// third of MaxBytes, so that blocks of three classes fit the bound together
// (a region of RegionBytes would not fit a pool bounded below it at all).
func (p *Pool) regionSize(s int) int {
	rb := p.cfg.RegionBytes
	if third := p.cfg.MaxBytes / 3; int64(rb) > third {
		rb = int(third)
	}
	if s >= rb {
		return s
	}
	return rb / s * s
}

// Alloc returns a buffer of n bytes from the smallest class that fits (from a larger class's
// free block if its own has none and the pool may not grow). It fails with an error wrapping
// ErrExhausted when no block is free and MaxBytes forbids a new region even after freeing
// the regions with no block handed out, and with one wrapping net.ErrClosed after Close.
func (p *Pool) Alloc(n int) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("devicebuf: alloc of %d bytes", n)
	}
	p.mu.Lock()
	ci, _ := slices.BinarySearch(p.sizes, n)
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, fmt.Errorf("devicebuf: pool: %w", net.ErrClosed)
		}
		if ci == len(p.classes) {
			return p.allocOversize(n) // unlocks
		}
		if b, ok := p.popLocked(ci); ok {
			p.stats.Hits++
			return p.handOutLocked(b, n), nil // unlocks
		}
		c := &p.classes[ci]
		if c.growing {
			// The region on its way may have a block for this call too. The wait lasts
			// as long as making one region does.
			p.stats.Waits++
			p.grown.Wait()
			continue
		}
		rs := p.regionSize(c.size)
		var victims []*poolRegion
		if over := p.overBoundLocked(rs); over > 0 {
			for j := ci + 1; j < len(p.classes); j++ {
				if b, ok := p.popLocked(j); ok {
					p.stats.Hits++
					return p.handOutLocked(b, n), nil
				}
			}
			victims = p.reclaimLocked(over)
			if victims == nil {
				p.stats.Exhausted++
				err := fmt.Errorf("devicebuf: pool has no free block of %d bytes (class %d) and %d of %d region bytes are in use: %w",
					n, c.size, p.total, p.cfg.MaxBytes, ErrExhausted)
				p.mu.Unlock()
				return nil, err
			}
		}
		c.growing = true
		r, err := p.growLocked(rs, ci, victims)
		c.growing = false
		p.grown.Broadcast()
		if err != nil {
			p.mu.Unlock()
			return nil, err
		}
		cs := c.size
		for off := rs - cs; off > 0; off -= cs {
			c.free = append(c.free, poolBlock{r: r, ptr: r.buf.ptr + uintptr(off), ci: ci})
		}
		return p.handOutLocked(poolBlock{r: r, ptr: r.buf.ptr, ci: ci}, n), nil
	}
}

// overBoundLocked returns how many bytes past MaxBytes a new region of n bytes would take
// the pool, or 0 if it fits. It subtracts from what is left of the bound (the bytes held
// never exceed it): their sum with n could wrap negative near the largest int64.
func (p *Pool) overBoundLocked(n int) int64 {
	if left := p.cfg.MaxBytes - p.total; int64(n) > left {
		return int64(n) - left
	}
	return 0
}

// reclaimLocked takes out of the pool, longest idle first, regions with no block handed out
// that hold at least need bytes between them, and returns them for the caller to free
// (without p.mu held). It takes none if they hold less.
func (p *Pool) reclaimLocked(need int64) []*poolRegion {
	var idle []*poolRegion
	var have int64
	for r := range p.regions {
		if r.ci >= 0 && r.used == 0 {
			idle = append(idle, r)
			have += int64(r.size)
		}
	}
	if have < need {
		return nil
	}
	slices.SortFunc(idle, func(a, b *poolRegion) int { return a.idleSince.Compare(b.idleSince) })
	have = 0
	for i, r := range idle {
		p.dropRegionLocked(r)
		if have += int64(r.size); have >= need {
			return idle[:i+1]
		}
	}
	return idle
}

// dropRegionLocked takes r, which has no block handed out, out of the pool.
func (p *Pool) dropRegionLocked(r *poolRegion) {
	delete(p.regions, r)
	p.total -= int64(r.size)
	p.stats.Freed++
	c := &p.classes[r.ci]
	c.free = slices.DeleteFunc(c.free, func(b poolBlock) bool { return b.r == r })
}

// trim frees the regions that have had no block handed out for IdleTimeout, and schedules
// itself again for the next region that will have.
func (p *Pool) trim() {
	p.mu.Lock()
	p.trimArmed = false
	if p.closed {
		p.mu.Unlock()
		return
	}
	now := p.cfg.Clock.Now()
	var victims []*poolRegion
	next := time.Duration(-1)
	for r := range p.regions {
		if r.ci < 0 || r.used > 0 {
			continue
		}
		if left := r.idleSince.Add(p.cfg.IdleTimeout).Sub(now); left > 0 {
			if next < 0 || left < next {
				next = left
			}
			continue
		}
		victims = append(victims, r)
	}
	for _, r := range victims {
		p.dropRegionLocked(r)
	}
	if next >= 0 {
		p.armTrimLocked(next)
	}
	p.mu.Unlock()
	for _, r := range victims {
		_ = p.freeRegion(r)
	}
}

// armTrimLocked schedules trim in d unless it is scheduled already.
func (p *Pool) armTrimLocked(d time.Duration) {
	if p.cfg.IdleTimeout < 0 || p.trimArmed || p.closed {
		return
	}
	p.trimArmed = true
	p.stopTrim = p.cfg.Clock.AfterFunc(d, p.trim)
}

func (p *Pool) popLocked(ci int) (poolBlock, bool) {
	c := &p.classes[ci]
	if len(c.free) == 0 {
		return poolBlock{}, false
	}
	b := c.free[len(c.free)-1]
	c.free = c.free[:len(c.free)-1]
	return b, true
}

func (p *Pool) blockSize(b poolBlock) int {
	if b.ci < 0 {
		return b.r.size
	}
	return p.classes[b.ci].size
}

// handOutLocked makes the buffer for b and unlocks p.mu.
func (p *Pool) handOutLocked(b poolBlock, n int) *Buffer {
	b.r.used++
	p.inUse++
	p.bytesInUse += int64(p.blockSize(b))
	p.mu.Unlock()
	ra := b.r.buf.a
	a := &allocation{
		kind: ra.kind, dev: ra.dev, uuid: ra.uuid, drv: ra.drv,
		base: ra.base, host: ra.host,
		region: b.r.buf, reg: b.r.reg,
		free: func() { p.put(b) },
	}
	return a.newHandle(b.ptr, n)
}

// allocOversize serves n above the largest class; called with p.mu held, unlocks it.
func (p *Pool) allocOversize(n int) (*Buffer, error) {
	if !p.cfg.Oversize {
		p.stats.Exhausted++
		p.mu.Unlock()
		return nil, fmt.Errorf("devicebuf: %d bytes exceed the pool's largest class (%d) and Oversize is off: %w",
			n, p.classes[len(p.classes)-1].size, ErrExhausted)
	}
	if int64(n) > p.cfg.MaxBytes || n > math.MaxInt-pageSize {
		// Refused before rounding, which would overflow near the largest int.
		p.stats.Exhausted++
		p.mu.Unlock()
		return nil, fmt.Errorf("devicebuf: %d bytes exceed the pool's MaxBytes (%d): %w", n, p.cfg.MaxBytes, ErrExhausted)
	}
	rs := roundPage(n)
	var victims []*poolRegion
	if over := p.overBoundLocked(rs); over > 0 {
		victims = p.reclaimLocked(over)
		if victims == nil {
			p.stats.Exhausted++
			err := fmt.Errorf("devicebuf: pool cannot make an oversize region of %d bytes: %d of %d region bytes are in use: %w",
				rs, p.total, p.cfg.MaxBytes, ErrExhausted)
			p.mu.Unlock()
			return nil, err
		}
	}
	r, err := p.growLocked(rs, -1, victims)
	if err != nil {
		p.mu.Unlock()
		return nil, err
	}
	return p.handOutLocked(poolBlock{r: r, ptr: r.buf.ptr, ci: -1}, n), nil
}

// growLocked makes a region of n bytes for class ci (-1: oversize) after freeing victims,
// regions already taken out of the pool to make room (the caller checked MaxBytes). It is
// called with p.mu held, drops it while regions are freed, made and registered, and returns
// with it held.
func (p *Pool) growLocked(n, ci int, victims []*poolRegion) (*poolRegion, error) {
	p.total += int64(n) // reserved while p.mu is dropped
	p.mu.Unlock()
	for _, v := range victims {
		_ = p.freeRegion(v)
	}
	r, err := p.newRegion(n)
	p.mu.Lock()
	if err == nil && p.closed {
		p.mu.Unlock()
		_ = p.freeRegion(r)
		p.mu.Lock()
		err = fmt.Errorf("devicebuf: pool: %w", net.ErrClosed)
	}
	if err != nil {
		p.total -= int64(n)
		return nil, err
	}
	p.stats.Misses++
	r.ci = ci
	p.regions[r] = struct{}{}
	return r, nil
}

// newRegion makes and registers a region of n bytes (without p.mu held).
func (p *Pool) newRegion(n int) (*poolRegion, error) {
	var buf *Buffer
	var err error
	if p.cfg.Regions != nil {
		buf, err = p.cfg.Regions(n)
	} else {
		buf, err = p.cfg.Backing.Alloc(n)
	}
	if err != nil {
		return nil, fmt.Errorf("devicebuf: pool region of %d bytes: %w", n, err)
	}
	if buf.Len() < n || buf.GoMemory() {
		_ = buf.Release()
		return nil, fmt.Errorf("devicebuf: pool region source returned %d bytes (Go memory: %v) for %d", buf.Len(), buf.GoMemory(), n)
	}
	r := &poolRegion{buf: buf, size: n}
	if p.cfg.Registrar != nil {
		r.reg, r.release, err = p.cfg.Registrar.Register(buf.Ptr(), n, buf.Kind(), buf.Device())
		if err != nil {
			_ = buf.Release()
			return nil, fmt.Errorf("devicebuf: register pool region of %d bytes: %w", n, err)
		}
		if r.release == nil {
			r.release = func() error { return nil } // nothing to undo, but counted as one
		}
		live.registrations.Add(1)
	}
	live.regions.Add(1)
	p.mu.Lock()
	if p.cfg.Registrar != nil {
		p.stats.Registrations++
	}
	if !p.regionsMade && p.cfg.Backing == nil {
		p.kind, p.dev = buf.Kind(), buf.Device()
	}
	p.regionsMade = true
	p.mu.Unlock()
	return r, nil
}

// freeRegion deregisters and releases r (without p.mu held).
func (p *Pool) freeRegion(r *poolRegion) error {
	var err error
	if r.release != nil {
		if e := r.release(); e != nil {
			err = fmt.Errorf("devicebuf: deregister pool region: %w", e)
		}
		live.registrations.Add(-1)
	}
	live.regions.Add(-1)
	if e := r.buf.Release(); e != nil && err == nil {
		err = e
	}
	return err
}

// put takes back a block whose last handle was released.
func (p *Pool) put(b poolBlock) {
	p.mu.Lock()
	p.inUse--
	p.bytesInUse -= int64(p.blockSize(b))
	var free []*poolRegion
	switch {
	case p.closed:
		if p.inUse == 0 && !p.closeFreed {
			free = p.takeRegionsLocked()
		}
	case b.ci < 0:
		delete(p.regions, b.r)
		p.total -= int64(b.r.size)
		free = []*poolRegion{b.r}
	default:
		c := &p.classes[b.ci]
		c.free = append(c.free, b)
		if b.r.used--; b.r.used == 0 {
			b.r.idleSince = p.cfg.Clock.Now()
			p.armTrimLocked(p.cfg.IdleTimeout)
		}
	}
	p.mu.Unlock()
	for _, r := range free {
		_ = p.freeRegion(r)
	}
}

func (p *Pool) takeRegionsLocked() []*poolRegion {
	p.closeFreed = true
	rs := make([]*poolRegion, 0, len(p.regions))
	for r := range p.regions {
		rs = append(rs, r)
	}
	clear(p.regions)
	for i := range p.classes {
		p.classes[i].free = nil
	}
	for _, r := range rs {
		p.total -= int64(r.size) // a region being grown keeps its reservation until it is dropped
	}
	return rs
}

// Stats returns the pool's counters.
func (p *Pool) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.Regions = len(p.regions)
	s.RegionBytes = p.total
	s.InUse = p.inUse
	s.BytesInUse = p.bytesInUse
	return s
}

// Close stops allocation and frees the regions (deregistering them). If buffers are still
// out, it reports how many and the regions are freed when the last one is released. Close
// is idempotent; Alloc afterwards fails with an error wrapping net.ErrClosed.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.grown.Broadcast()
	if p.trimArmed {
		p.stopTrim()
		p.trimArmed = false
	}
	if p.inUse > 0 {
		n := p.inUse
		p.mu.Unlock()
		return fmt.Errorf("devicebuf: pool closed with %d buffers outstanding; its regions are freed when they are released", n)
	}
	rs := p.takeRegionsLocked()
	p.mu.Unlock()
	var errs []error
	for _, r := range rs {
		if err := p.freeRegion(r); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

var _ Allocator = (*Pool)(nil)
