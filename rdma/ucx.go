//go:build cgo && !nordma

package rdma

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "ucx.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

var loader struct {
	once      sync.Once
	err       error
	ucxFaults bool // the user had UCX handle SIGBUS or SIGSEGV (UCX_ERROR_SIGNALS)
}

// load opens libucp.so.0 once. UCX reads UCX_ERROR_SIGNALS when libucs loads,
// so the default (no UCX signal handlers: Go keeps its crash reports) is put
// in the environment just for the dlopen, unless the user set it.
func load() error {
	loader.once.Do(func() {
		if v, ok := os.LookupEnv("UCX_ERROR_SIGNALS"); ok {
			up := strings.ToUpper(v)
			loader.ucxFaults = strings.Contains(up, "BUS") || strings.Contains(up, "SEGV")
		} else {
			os.Setenv("UCX_ERROR_SIGNALS", "")
			defer os.Unsetenv("UCX_ERROR_SIGNALS")
		}
		ucxFDs.baseline()
		var buf [512]C.char
		if C.rdma_load(&buf[0], C.size_t(len(buf))) != 0 {
			loader.err = fmt.Errorf("%w: %s", ErrNotSupported, C.GoString(&buf[0]))
			return
		}
		ucxFDs.scan()
	})
	return loader.err
}

// goTakesFaults reports whether a memory fault reaches Go's signal handler,
// which direct copies need: not where the user had UCX install its own for
// SIGBUS or SIGSEGV (UCX_ERROR_SIGNALS).
func goTakesFaults() bool { return !loader.ucxFaults }

// DirectCopiesOff says why contexts made without WithDirectCopies make no
// direct copies in this process, or "" when they make them (into a peer's
// memory whose key names a UCX shared-memory segment: where UCX has its
// posix or sysv transport). It loads UCX if need be.
func DirectCopiesOff() string {
	if err := load(); err != nil {
		return err.Error()
	}
	switch {
	case !DirectCopiesDefault():
		return DirectEnv + " is false"
	case !goTakesFaults():
		return "UCX_ERROR_SIGNALS names SIGSEGV or SIGBUS: a fault in the copy must reach Go's handler"
	}
	return ""
}

func envSet(name string) bool {
	_, ok := os.LookupEnv(name)
	return ok
}

func statusString(st int) string { return C.GoString(C.rdma_status_string(C.int(st))) }

// statusError returns nil for UCS_OK, else a *StatusError.
func statusError(op string, st C.int) error {
	if st == statusOK {
		return nil
	}
	return &StatusError{Op: op, Status: int(st), Msg: statusString(int(st))}
}

var def struct {
	once sync.Once
	ctx  *Context
	err  error
}

// Available reports whether UCX can be used in this process: nil, or an error
// wrapping ErrNotSupported with the reason (the loader's message, or the UCX
// call that failed when the Default context was created).
func Available() error {
	if err := load(); err != nil {
		return err
	}
	_, err := Default()
	return err
}

// Default returns the process-wide shared context, created on first use from
// UCX's environment alone. It is never closed (Close on it does nothing), and
// it and its default worker are not counted by Stats.
func Default() (*Context, error) {
	def.once.Do(func() {
		def.ctx, def.err = newContext(nil, true)
		if def.err != nil && !errors.Is(def.err, ErrNotSupported) {
			def.err = fmt.Errorf("%w: %w", ErrNotSupported, def.err)
		}
	})
	return def.ctx, def.err
}

// Context is a UCX context (ucp_context_h) with its default worker. Memory is
// registered on a context; endpoints live on its workers.
type Context struct {
	h         C.ucp_context_h
	info      Info
	opts      *options
	isDefault bool
	def       *Worker
	cuda      atomic.Pointer[cudaHooks] // set by UseCUDA
	protoV1   bool                      // UCX's first protocol selection is in use: no CUDA memory

	peers shares // the workers DialApart keeps, by address (isolate.go)

	mu      sync.Mutex
	closed  bool
	workers map[*Worker]struct{}
	mems    map[*Memory]struct{}
}

// UCX configuration this package sets unless the environment sets it (or one
// of the listed variables):
//   - Peer error handling must not silently drop the shared-memory transports.
//     MM_ERROR_HANDLING is the key both posix and sysv read their
//     ERROR_HANDLING from when it comes through ucp_config_modify (UCX 1.13
//     ignores POSIX_ERROR_HANDLING there); it matters only where UCX_TLS may
//     select them.
//   - One rma_bw lane. This package never uses rendezvous (the stream API is
//     eager-only) and a put or get takes one lane, but UCX gives each endpoint
//     a second rma_bw lane on another device when there is one, and every
//     interface a lane uses is polled by every progress call: a tcp interface
//     costs an epoll_wait system call each time (about 1.5 µs on a virtual
//     machine), which the driver pays on every poll round and a sender after
//     every send. UCX's first protocol selection (the default in UCX 1.13)
//     honours MAX_RNDV_RAILS=1. The newer one (the default in 1.16) adds the
//     lane whatever the rail settings, so contexts also ask for the first
//     (PROTO_ENABLE=n): it is also the one the tests run on 1.13. A UCX that
//     registers CUDA memory keeps the newer one: the first copies small puts
//     of CUDA memory with the CPU.
//   - Exact registrations. With its registration caches on, UCX answers Map
//     with any cached registration that covers the range (for memory UCX
//     allocated, the whole allocation, shared-memory segment included),
//     merges overlapping ones, and keeps them registered after Close. A key
//     packed from a Map then reaches more than the range, and for longer.
//     RCACHE_ENABLE=n (UCP's cache) and IB_RCACHE=n (the InfiniBand memory
//     domain's) make every Map a registration of its own range that ends
//     with Close; on verbs that is a memory registration per Map.
var defaultConfig = []struct {
	key, value string
	unlessEnv  []string
	when       func(tls string) bool // nil: always
}{
	{"MM_ERROR_HANDLING", "y", []string{"UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING", "UCX_MM_ERROR_HANDLING"}, mayUseMM},
	{"MAX_RNDV_RAILS", "1", []string{"UCX_MAX_RNDV_RAILS", "UCX_MAX_RNDV_LANES"}, nil},
	{"PROTO_ENABLE", "n", []string{"UCX_PROTO_ENABLE"}, nil},
	{"RCACHE_ENABLE", "n", []string{"UCX_RCACHE_ENABLE"}, nil},
	// UCX warns about a key no loaded memory domain reads.
	{"IB_RCACHE", "n", []string{"UCX_IB_RCACHE"}, func(string) bool { return hasIBDevices() }},
}

// NewContext creates a UCX context with the features STREAM, RMA, AM and
// WAKEUP, and its default worker. Options set UCX configuration keys unless the
// environment (UCX_<KEY>) already sets them.
func NewContext(opts ...Option) (*Context, error) {
	return newContext(opts, false)
}

func newContext(opts []Option, isDefault bool) (*Context, error) {
	if err := load(); err != nil {
		return nil, err
	}
	o := buildOptions(opts)
	cfg := &options{}
	tls, ok := os.LookupEnv("UCX_TLS")
	if !ok {
		tls = o.config["TLS"]
	}
	for _, d := range defaultConfig {
		if !slices.ContainsFunc(d.unlessEnv, envSet) && (d.when == nil || d.when(tls)) {
			cfg.set(d.key, d.value)
		}
	}
	for _, k := range o.order {
		cfg.set(k, o.config[k])
	}
	c := &Context{opts: o, isDefault: isDefault, workers: map[*Worker]struct{}{}, mems: map[*Memory]struct{}{}}
	c.peers.ctx = c
	if err := c.create(cfg); err != nil {
		return nil, err
	}
	c.info = c.query()
	if c.info.HasMemoryType(MemoryCUDA) && cfg.config["PROTO_ENABLE"] == "n" && !envSet("UCX_PROTO_ENABLE") && !slices.Contains(o.order, "PROTO_ENABLE") {
		// UCX's first protocol selection copies small puts of CUDA memory with
		// the CPU: a CUDA-enabled UCX keeps its own (newer) selection.
		C.rdma_context_destroy(c.h)
		cfg.unset("PROTO_ENABLE")
		if err := c.create(cfg); err != nil {
			return nil, err
		}
		c.info = c.query()
	}
	c.protoV1 = protoV1(cfg)
	w, err := c.newWorker(isDefault, nil)
	if err != nil {
		C.rdma_context_destroy(c.h)
		return nil, err
	}
	c.def = w
	if !isDefault {
		live.contexts.Add(1)
	}
	o.logger.Debug("rdma context created", "version", c.info.Version, "transports", c.info.Transports, "memory_types", c.info.MemoryTypes)
	return c, nil
}

// protoV1 reports whether the context runs UCX's first protocol selection
// (PROTO_ENABLE off, by the environment or cfg), which copies small puts of
// CUDA memory with the CPU.
func protoV1(cfg *options) bool {
	v, ok := os.LookupEnv("UCX_PROTO_ENABLE")
	if !ok {
		v, ok = cfg.config["PROTO_ENABLE"]
	}
	switch strings.ToLower(v) {
	case "n", "no", "0", "off", "false":
		return ok
	}
	return false
}

// create makes the UCX context with cfg's keys, except those the environment
// sets (UCX reads UCX_<KEY> itself).
func (c *Context) create(cfg *options) error {
	var keys, vals []*C.char
	for _, k := range cfg.order {
		if envSet("UCX_" + k) {
			continue
		}
		keys = append(keys, C.CString(k))
		vals = append(vals, C.CString(cfg.config[k]))
	}
	defer func() {
		for i := range keys {
			C.free(unsafe.Pointer(keys[i]))
			C.free(unsafe.Pointer(vals[i]))
		}
	}()
	var kp, vp **C.char
	if len(keys) > 0 {
		// C arrays: a Go slice of C pointers may be passed for the call.
		kp, vp = &keys[0], &vals[0]
	}
	var ebuf [256]C.char
	st := C.rdma_context_create(kp, vp, C.int(len(keys)), &c.h, &ebuf[0], C.size_t(len(ebuf)))
	ucxFDs.scan()
	if st != statusOK {
		return statusError(C.GoString(&ebuf[0]), st)
	}
	return nil
}

func (c *Context) query() Info {
	info := Info{Version: C.GoString(C.rdma_version())}
	mt := uint64(C.rdma_context_memtypes(c.h))
	if mt&(1<<C.UCS_MEMORY_TYPE_HOST) != 0 {
		info.MemoryTypes = append(info.MemoryTypes, MemoryHost)
	}
	if mt&(1<<C.UCS_MEMORY_TYPE_CUDA) != 0 {
		info.MemoryTypes = append(info.MemoryTypes, MemoryCUDA)
	}
	var n C.size_t
	if p := C.rdma_context_info(c.h, &n); p != nil {
		info.Transports = parseTransports(C.GoStringN(p, C.int(n)))
		C.free(unsafe.Pointer(p))
	}
	return info
}

// parseTransports takes "tl/device" names out of ucp_context_print_info's
// resource lines ("#   resource 3  :  md 2  dev 1  flags -- tcp/lo").
func parseTransports(s string) []string {
	var out []string
	for line := range strings.Lines(s) {
		if !strings.Contains(line, "resource") || !strings.Contains(line, "flags") {
			continue
		}
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		t := f[len(f)-1]
		if strings.Contains(t, "/") && !slices.Contains(out, t) {
			out = append(out, t)
		}
	}
	return out
}

// Info reports the UCX version, the transports this context can use and the
// memory types it can register.
func (c *Context) Info() Info {
	i := c.info
	i.Transports = slices.Clone(i.Transports)
	i.MemoryTypes = slices.Clone(i.MemoryTypes)
	return i
}

// Worker returns the context's default worker. Closing it does nothing: it is
// closed with the context.
func (c *Context) Worker() *Worker { return c.def }

// NewWorker creates an extra worker with its own driver goroutine.
func (c *Context) NewWorker() (*Worker, error) {
	return c.newWorker(false, nil)
}

// Close closes the context's workers (and so their endpoints and listeners),
// unmaps memory still mapped and releases the context. It is idempotent. On
// the Default context it does nothing.
func (c *Context) Close() error {
	if c.isDefault {
		return nil
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	workers := make([]*Worker, 0, len(c.workers))
	for w := range c.workers {
		workers = append(workers, w)
	}
	c.mu.Unlock()
	var errs []error
	for _, w := range workers {
		errs = append(errs, w.close())
	}
	c.mu.Lock()
	mems := make([]*Memory, 0, len(c.mems))
	for m := range c.mems {
		mems = append(mems, m)
	}
	c.mu.Unlock()
	for _, m := range mems {
		m.unmap()
	}
	C.rdma_context_destroy(c.h)
	if h := c.cuda.Load(); h != nil {
		h.free()
	}
	live.contexts.Add(-1)
	return errors.Join(errs...)
}

// cudaHooks is what UseCUDA installed: CUDA memory of device d is used with
// contexts[d] current; the workers use device dev's.
type cudaHooks struct {
	src CUDA
	dev int

	mu       sync.Mutex
	contexts map[int]*C.rdma_cuda_t // C memory: UCX calls get a pointer to it
}

// context returns the hooks for CUDA memory of device dev.
func (h *cudaHooks) context(dev int) (*C.rdma_cuda_t, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.contexts == nil {
		return nil, closedError("context")
	}
	if cu, ok := h.contexts[dev]; ok {
		return cu, nil
	}
	ctx, push, pop, err := h.src.ThreadContext(dev)
	if err != nil {
		return nil, fmt.Errorf("rdma: CUDA context of device %d: %w", dev, err)
	}
	if ctx == 0 || push == 0 || pop == 0 {
		return nil, fmt.Errorf("rdma: CUDA context of device %d: no context or hooks", dev)
	}
	cu := (*C.rdma_cuda_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.rdma_cuda_t{}))))
	C.rdma_cuda_init(cu, C.uintptr_t(push), C.uintptr_t(pop), C.uintptr_t(ctx))
	h.contexts[dev] = cu
	return cu, nil
}

// free releases the C copies of the hooks, once nothing can call UCX with them.
func (h *cudaHooks) free() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, cu := range h.contexts {
		C.free(unsafe.Pointer(cu))
	}
	h.contexts = nil
}

// UseCUDA lets the context register and move CUDA memory: every UCX call that
// may touch it (maps, key packing, puts and gets, progress) then runs with a
// CUDA context current on the calling thread, and the thread's own context is
// restored after. The workers use device dev's context; memory mapped with
// MapCUDA uses its own device's. Without UseCUDA, MapCUDA fails even where UCX
// supports CUDA memory. It fails with ErrNotSupported where this UCX cannot
// register CUDA memory. Calling it again does nothing: the first call's hooks
// stay, as the workers and UCX's CUDA transports keep the contexts they saw.
func (c *Context) UseCUDA(src CUDA, dev int) error {
	if !c.info.HasMemoryType(MemoryCUDA) {
		return fmt.Errorf("%w: UCX %s cannot register CUDA memory", ErrNotSupported, c.info.Version)
	}
	if c.protoV1 {
		return fmt.Errorf("%w: UCX's first protocol selection (UCX_PROTO_ENABLE=n) copies CUDA memory with the CPU", ErrNotSupported)
	}
	if c.cuda.Load() != nil {
		return nil
	}
	h := &cudaHooks{src: src, dev: dev, contexts: map[int]*C.rdma_cuda_t{}}
	cu, err := h.context(dev)
	if err != nil {
		return err
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		h.free()
		return closedError("context")
	}
	if !c.cuda.CompareAndSwap(nil, h) {
		c.mu.Unlock()
		h.free()
		return nil // a concurrent call won; its hooks are the ones in use
	}
	workers := make([]*Worker, 0, len(c.workers))
	for w := range c.workers {
		workers = append(workers, w)
	}
	c.mu.Unlock()
	for _, w := range workers {
		w.useCUDA(cu)
	}
	return nil
}

// CanMap reports whether memory of type mt can be registered now: host memory
// always, CUDA memory where UCX supports it and UseCUDA was called.
func (c *Context) CanMap(mt MemoryType) bool {
	switch mt {
	case MemoryHost:
		return true
	case MemoryCUDA:
		return c.info.HasMemoryType(MemoryCUDA) && !c.protoV1 && c.cuda.Load() != nil
	}
	return false
}

// Alloc lets UCX allocate n bytes of host memory (UCP_MEM_MAP_ALLOCATE: on
// shared memory transports this is the fast placement) and registers it.
func (c *Context) Alloc(n int) (*Memory, error) {
	if n <= 0 {
		return nil, fmt.Errorf("rdma: alloc %d bytes: invalid length", n)
	}
	return c.mapMem(0, n, MemoryHost, true, nil)
}

// Map registers existing host memory [addr, addr+n), or CUDA memory of the
// device UseCUDA named (see MapCUDA).
func (c *Context) Map(addr uintptr, n int, mt MemoryType) (*Memory, error) {
	switch mt {
	case MemoryHost:
		if addr == 0 || n <= 0 {
			return nil, fmt.Errorf("rdma: map %#x+%d: invalid region", addr, n)
		}
		return c.mapMem(addr, n, mt, false, nil)
	case MemoryCUDA:
		h := c.cuda.Load()
		if h == nil {
			return c.MapCUDA(addr, n, 0)
		}
		return c.MapCUDA(addr, n, h.dev)
	}
	return nil, fmt.Errorf("rdma: map: unknown memory type %d", mt)
}

// MapCUDA registers CUDA memory [addr, addr+n) of device dev. It fails with
// ErrNotSupported unless UCX supports CUDA memory and UseCUDA was called: a
// UCX without CUDA support, or one called on a thread without a CUDA context,
// takes a device pointer for host memory.
func (c *Context) MapCUDA(addr uintptr, n int, dev int) (*Memory, error) {
	if addr == 0 || n <= 0 {
		return nil, fmt.Errorf("rdma: map %#x+%d: invalid region", addr, n)
	}
	if !c.info.HasMemoryType(MemoryCUDA) {
		return nil, fmt.Errorf("%w: UCX %s cannot register %s memory", ErrNotSupported, c.info.Version, MemoryCUDA)
	}
	h := c.cuda.Load()
	if h == nil {
		return nil, fmt.Errorf("%w: no CUDA contexts for UCX (Context.UseCUDA)", ErrNotSupported)
	}
	cu, err := h.context(dev)
	if err != nil {
		return nil, err
	}
	return c.mapMem(addr, n, MemoryCUDA, false, cu)
}

func (c *Context) mapMem(addr uintptr, n int, mt MemoryType, alloc bool, cu *C.rdma_cuda_t) (*Memory, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, closedError("context")
	}
	var h C.ucp_mem_h
	var oaddr unsafe.Pointer
	var olen C.size_t
	cuda, al := C.int(0), C.int(0)
	if mt == MemoryCUDA {
		cuda = 1
	}
	if alloc {
		al = 1
	}
	st := C.rdma_mem_map(c.h, cu, C.uintptr_t(addr), C.size_t(n), cuda, al, &h, &oaddr, &olen)
	if st != statusOK {
		return nil, fmt.Errorf("rdma: register memory: %w", statusError("ucp_mem_map", st))
	}
	m := &Memory{ctx: c, h: h, cu: cu, p: oaddr, addr: uintptr(oaddr), n: n, mt: mt}
	c.mems[m] = struct{}{}
	live.memories.Add(1)
	return m, nil
}

// Memory is a registered memory region. Remote peers reach it through the key
// PackKey returns.
type Memory struct {
	ctx  *Context
	h    C.ucp_mem_h
	cu   *C.rdma_cuda_t // the CUDA context of CUDA memory; nil for host memory
	p    unsafe.Pointer // C or device memory: never Go memory
	addr uintptr
	n    int
	mt   MemoryType

	mu       sync.Mutex
	refs     int // operations in flight
	closed   bool
	unmapped bool
}

// Addr returns the region's address.
func (m *Memory) Addr() uintptr { return m.addr }

// Len returns the region's length.
func (m *Memory) Len() int { return m.n }

// Type returns the region's memory type.
func (m *Memory) Type() MemoryType { return m.mt }

// Bytes returns host memory as a slice over the region (C memory: it must not
// be used after Close), nil for CUDA memory.
func (m *Memory) Bytes() []byte {
	if m.mt != MemoryHost {
		return nil
	}
	return unsafe.Slice((*byte)(m.p), m.n)
}

// PackKey returns the region's remote key in this package's framing, for a
// peer's Endpoint.UnpackKey.
func (m *Memory) PackKey() ([]byte, error) {
	if err := m.acquire(); err != nil {
		return nil, err
	}
	defer m.release()
	var buf unsafe.Pointer
	var n C.size_t
	st := C.rdma_rkey_pack(m.ctx.h, m.cu, m.h, &buf, &n)
	if st != statusOK {
		return nil, fmt.Errorf("rdma: pack key: %w", statusError("ucp_rkey_pack", st))
	}
	rk := C.GoBytes(buf, C.int(n))
	C.rdma_rkey_buffer_release(buf)
	return encodeKey(packedKey{memType: m.mt, base: uint64(m.addr), length: uint64(m.n), rkey: rk}), nil
}

func (m *Memory) acquire() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return closedError("memory")
	}
	m.refs++
	return nil
}

func (m *Memory) release() {
	m.mu.Lock()
	m.refs--
	last := m.closed && m.refs == 0
	m.mu.Unlock()
	if last {
		m.unmap()
	}
}

// Close unregisters the region (and frees it when UCX allocated it) once the
// operations using it completed. It is idempotent.
func (m *Memory) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	now := m.refs == 0
	m.mu.Unlock()
	if now {
		return m.unmap()
	}
	return nil
}

func (m *Memory) unmap() error {
	m.mu.Lock()
	if m.unmapped {
		m.mu.Unlock()
		return nil
	}
	m.unmapped = true
	m.closed = true
	m.mu.Unlock()
	c := m.ctx
	c.mu.Lock()
	delete(c.mems, m)
	st := C.rdma_mem_unmap(c.h, m.cu, m.h)
	c.mu.Unlock()
	live.memories.Add(-1)
	return statusError("ucp_mem_unmap", st)
}
