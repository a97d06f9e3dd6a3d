//go:build cgo && !nocuda

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;

#define GDR_CUDA_ERROR_NOT_FOUND_SYMBOL (-1)

static struct {
	void *lib;
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDriverGetVersion)(int *);
	CUresult (*cuDeviceGetCount)(int *);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice);
	CUresult (*cuDeviceGetName)(char *, int, CUdevice);
	CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice);
	CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
	CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*cuCtxPushCurrent)(CUcontext);
	CUresult (*cuCtxPopCurrent)(CUcontext *);
	CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
	CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int);
	CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
	CUresult (*cuMemFree)(CUdeviceptr);
	CUresult (*cuPointerSetAttribute)(const void *, int, CUdeviceptr);
	CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
	CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
	CUresult (*cuMemHostUnregister)(void *);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
	CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
	CUresult (*cuStreamCreate)(CUstream *, unsigned int);
	CUresult (*cuStreamSynchronize)(CUstream);
	CUresult (*cuStreamDestroy)(CUstream);
	CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
	CUresult (*cuEventCreate)(CUevent *, unsigned int);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuEventQuery)(CUevent);
	CUresult (*cuEventDestroy)(CUevent);
	CUresult (*cuIpcGetEventHandle)(CUipcEventHandle *, CUevent);
	CUresult (*cuIpcOpenEventHandle)(CUevent *, CUipcEventHandle);
	CUresult (*cuFlushGPUDirectRDMAWrites)(int, int);
	CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
	CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
	CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
	CUresult (*cuGetErrorString)(CUresult, const char **);
	CUresult (*cuGetErrorName)(CUresult, const char **);
} gdr_cu;

// gdr_cu_load opens libcuda and resolves the entry points. It returns NULL on success, else
// a message (static or from dlerror, valid until the next dl call).
static const char *gdr_cu_load(const char *name) {
	void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		return e ? e : "dlopen failed";
	}
#define SYM(field, sym) do { \
		*(void **)(&gdr_cu.field) = dlsym(h, sym); \
		if (gdr_cu.field == NULL) { dlclose(h); return "libcuda.so.1 lacks " sym; } \
	} while (0)
#define SYM2(field, sym, alt) do { \
		*(void **)(&gdr_cu.field) = dlsym(h, sym); \
		if (gdr_cu.field == NULL) *(void **)(&gdr_cu.field) = dlsym(h, alt); \
		if (gdr_cu.field == NULL) { dlclose(h); return "libcuda.so.1 lacks " sym; } \
	} while (0)
	SYM(cuInit, "cuInit");
	SYM(cuDriverGetVersion, "cuDriverGetVersion");
	SYM(cuDeviceGetCount, "cuDeviceGetCount");
	SYM(cuDeviceGet, "cuDeviceGet");
	SYM2(cuDeviceGetUuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid");
	SYM(cuDeviceGetName, "cuDeviceGetName");
	SYM(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
	SYM(cuDeviceTotalMem, "cuDeviceTotalMem_v2");
	SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute");
	SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	SYM2(cuCtxPushCurrent, "cuCtxPushCurrent_v2", "cuCtxPushCurrent");
	SYM2(cuCtxPopCurrent, "cuCtxPopCurrent_v2", "cuCtxPopCurrent");
	SYM(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
	SYM(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess");
	SYM(cuMemAlloc, "cuMemAlloc_v2");
	SYM(cuMemFree, "cuMemFree_v2");
	SYM(cuPointerSetAttribute, "cuPointerSetAttribute");
	SYM(cuMemGetAddressRange, "cuMemGetAddressRange_v2");
	SYM(cuMemHostRegister, "cuMemHostRegister_v2");
	SYM(cuMemHostUnregister, "cuMemHostUnregister");
	SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
	SYM(cuMemcpyPeerAsync, "cuMemcpyPeerAsync");
	SYM(cuMemsetD8Async, "cuMemsetD8Async");
	SYM(cuStreamCreate, "cuStreamCreate");
	SYM(cuStreamSynchronize, "cuStreamSynchronize");
	SYM2(cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy");
	SYM(cuStreamWaitEvent, "cuStreamWaitEvent");
	SYM(cuEventCreate, "cuEventCreate");
	SYM(cuEventRecord, "cuEventRecord");
	SYM(cuEventSynchronize, "cuEventSynchronize");
	SYM(cuEventQuery, "cuEventQuery");
	SYM2(cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy");
	SYM(cuIpcGetEventHandle, "cuIpcGetEventHandle");
	SYM(cuIpcOpenEventHandle, "cuIpcOpenEventHandle");
	SYM(cuIpcGetMemHandle, "cuIpcGetMemHandle");
	SYM2(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle");
	SYM(cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
	SYM(cuGetErrorString, "cuGetErrorString");
	SYM(cuGetErrorName, "cuGetErrorName");
	// Optional (CUDA 11.3+): absent means no flush is possible.
	*(void **)(&gdr_cu.cuFlushGPUDirectRDMAWrites) = dlsym(h, "cuFlushGPUDirectRDMAWrites");
#undef SYM
#undef SYM2
	gdr_cu.lib = h;
	return NULL;
}

static CUresult gdr_cu_init(void) { return gdr_cu.cuInit(0); }
static CUresult gdr_cu_driver_version(int *v) { return gdr_cu.cuDriverGetVersion(v); }
static CUresult gdr_cu_device_count(int *n) { return gdr_cu.cuDeviceGetCount(n); }

static CUresult gdr_cu_device_uuid(int ord, char *out) {
	CUdevice d;
	CUresult r = gdr_cu.cuDeviceGet(&d, ord);
	if (r) return r;
	CUuuid u;
	r = gdr_cu.cuDeviceGetUuid(&u, d);
	if (r) return r;
	memcpy(out, u.bytes, 16);
	return 0;
}

static CUresult gdr_cu_device_name(int ord, char *out, int n) {
	CUdevice d;
	CUresult r = gdr_cu.cuDeviceGet(&d, ord);
	if (r) return r;
	return gdr_cu.cuDeviceGetName(out, n, d);
}

static CUresult gdr_cu_device_busid(int ord, char *out, int n) {
	CUdevice d;
	CUresult r = gdr_cu.cuDeviceGet(&d, ord);
	if (r) return r;
	return gdr_cu.cuDeviceGetPCIBusId(out, n, d);
}

static CUresult gdr_cu_device_mem(int ord, size_t *out) {
	CUdevice d;
	CUresult r = gdr_cu.cuDeviceGet(&d, ord);
	if (r) return r;
	return gdr_cu.cuDeviceTotalMem(out, d);
}

static CUresult gdr_cu_device_attr(int ord, int attr, int *out) {
	CUdevice d;
	CUresult r = gdr_cu.cuDeviceGet(&d, ord);
	if (r) return r;
	return gdr_cu.cuDeviceGetAttribute(out, attr, d);
}

static CUresult gdr_cu_ctx_retain(int ord, CUcontext *out) {
	CUdevice d;
	CUresult r = gdr_cu.cuDeviceGet(&d, ord);
	if (r) return r;
	return gdr_cu.cuDevicePrimaryCtxRetain(out, d);
}

static void gdr_cu_pop(void) {
	CUcontext prev;
	gdr_cu.cuCtxPopCurrent(&prev);
}

// gdr_cu_enable_peer lets the primary contexts a (device da) and b (device db) map each
// other's memory where the devices allow it (NVLink or PCIe peer to peer), so that copies
// between them run device to device; without it the driver stages them through host memory.
// Devices that cannot reach each other both ways are left as they are (0). Access enabled
// before (by us or by the application) is not an error, and a retry after a failure half-way
// enables what is left.
static CUresult gdr_cu_enable_peer(CUcontext a, int da, CUcontext b, int db) {
	CUdevice x, y;
	int ab = 0, ba = 0;
	CUresult r = gdr_cu.cuDeviceGet(&x, da);
	if (!r) r = gdr_cu.cuDeviceGet(&y, db);
	if (!r) r = gdr_cu.cuDeviceCanAccessPeer(&ab, x, y);
	if (!r) r = gdr_cu.cuDeviceCanAccessPeer(&ba, y, x);
	if (r || !(ab && ba)) return r;
	if ((r = gdr_cu.cuCtxPushCurrent(a)) != 0) return r;
	r = gdr_cu.cuCtxEnablePeerAccess(b, 0);
	gdr_cu_pop();
	if (r && r != 704) return r; // 704: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
	if ((r = gdr_cu.cuCtxPushCurrent(b)) != 0) return r;
	r = gdr_cu.cuCtxEnablePeerAccess(a, 0);
	gdr_cu_pop();
	return r == 704 ? 0 : r;
}

// Every wrapper below that needs a context pushes it on the calling thread and pops it
// before returning, so the thread's own current context (the application's, or none) is
// unchanged after the call.
#define GDR_IN_CTX(c, call) do { \
		CUresult r_ = gdr_cu.cuCtxPushCurrent(c); \
		if (r_) return r_; \
		r_ = (call); \
		gdr_cu_pop(); \
		return r_; \
	} while (0)

static CUresult gdr_cu_mem_alloc(CUcontext c, size_t n, CUdeviceptr *out) {
	GDR_IN_CTX(c, gdr_cu.cuMemAlloc(out, n));
}

static CUresult gdr_cu_mem_free(CUcontext c, CUdeviceptr p) {
	GDR_IN_CTX(c, gdr_cu.cuMemFree(p));
}

static unsigned int gdr_one = 1;

static CUresult gdr_cu_sync_memops(CUcontext c, CUdeviceptr p) {
	GDR_IN_CTX(c, gdr_cu.cuPointerSetAttribute(&gdr_one, 6, p)); // CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
}

static CUresult gdr_cu_address_range(CUcontext c, CUdeviceptr p, CUdeviceptr *base, size_t *size) {
	GDR_IN_CTX(c, gdr_cu.cuMemGetAddressRange(base, size, p));
}

static CUresult gdr_cu_host_register(CUcontext c, uintptr_t p, size_t n) {
	GDR_IN_CTX(c, gdr_cu.cuMemHostRegister((void *)p, n, 1)); // CU_MEMHOSTREGISTER_PORTABLE
}

static CUresult gdr_cu_host_unregister(CUcontext c, uintptr_t p) {
	GDR_IN_CTX(c, gdr_cu.cuMemHostUnregister((void *)p));
}

static CUresult gdr_cu_memcpy_in(int dir, CUcontext dstc, uintptr_t dst, CUcontext srcc,
		uintptr_t src, size_t n, CUstream s, int *queued) {
	CUresult r;
	switch (dir) {
	case 1: r = gdr_cu.cuMemcpyHtoDAsync((CUdeviceptr)dst, (const void *)src, n, s); break;
	case 2: r = gdr_cu.cuMemcpyDtoHAsync((void *)dst, (CUdeviceptr)src, n, s); break;
	case 3: r = gdr_cu.cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, s); break;
	case 4: r = gdr_cu.cuMemcpyPeerAsync((CUdeviceptr)dst, dstc, (CUdeviceptr)src, srcc, n, s); break;
	default: return 1; // CUDA_ERROR_INVALID_VALUE
	}
	if (r || !queued) return r;
	*queued = 1;
	return gdr_cu.cuStreamSynchronize(s);
}

// dir: 1 HtoD, 2 DtoH, 3 DtoD (same context), 4 peer. The copy is queued on s; with queued
// given, it is waited for before returning, and *queued is set once the copy was queued (a
// failure then is the wait's).
static CUresult gdr_cu_memcpy(CUcontext c, int dir, CUcontext dstc, uintptr_t dst, CUcontext srcc,
		uintptr_t src, size_t n, uintptr_t st, int *queued) {
	GDR_IN_CTX(c, gdr_cu_memcpy_in(dir, dstc, dst, srcc, src, n, (CUstream)st, queued));
}

static CUresult gdr_cu_memset_in(CUdeviceptr p, size_t n, CUstream s, int *queued) {
	CUresult r = gdr_cu.cuMemsetD8Async(p, 0, n, s);
	if (r) return r;
	*queued = 1;
	return gdr_cu.cuStreamSynchronize(s);
}

// gdr_cu_memset_zero zeroes n bytes at p on stream st and waits for it; *queued is set once
// the memset was queued (a failure then is the wait's).
static CUresult gdr_cu_memset_zero(CUcontext c, uintptr_t p, size_t n, uintptr_t st, int *queued) {
	GDR_IN_CTX(c, gdr_cu_memset_in((CUdeviceptr)p, n, (CUstream)st, queued));
}

// flags: 0 CU_STREAM_DEFAULT (ordered with the legacy default stream), 1 CU_STREAM_NON_BLOCKING.
static CUresult gdr_cu_stream_create(CUcontext c, unsigned int flags, CUstream *out) {
	GDR_IN_CTX(c, gdr_cu.cuStreamCreate(out, flags));
}

static CUresult gdr_cu_stream_sync(CUcontext c, uintptr_t s) {
	GDR_IN_CTX(c, gdr_cu.cuStreamSynchronize((CUstream)s));
}

static CUresult gdr_cu_stream_destroy(CUcontext c, uintptr_t s) {
	GDR_IN_CTX(c, gdr_cu.cuStreamDestroy((CUstream)s));
}

static CUresult gdr_cu_stream_wait_event(CUcontext c, uintptr_t s, uintptr_t e) {
	GDR_IN_CTX(c, gdr_cu.cuStreamWaitEvent((CUstream)s, (CUevent)e, 0));
}

// flags: CU_EVENT_DISABLE_TIMING (2), with CU_EVENT_INTERPROCESS (4) when interprocess.
static CUresult gdr_cu_event_create(CUcontext c, int interprocess, CUevent *out) {
	GDR_IN_CTX(c, gdr_cu.cuEventCreate(out, interprocess ? 6 : 2));
}

static CUresult gdr_cu_event_record(CUcontext c, uintptr_t e, uintptr_t s) {
	GDR_IN_CTX(c, gdr_cu.cuEventRecord((CUevent)e, (CUstream)s));
}

static CUresult gdr_cu_event_sync(CUcontext c, uintptr_t e) {
	GDR_IN_CTX(c, gdr_cu.cuEventSynchronize((CUevent)e));
}

static CUresult gdr_cu_event_query(CUcontext c, uintptr_t e) {
	GDR_IN_CTX(c, gdr_cu.cuEventQuery((CUevent)e));
}

static CUresult gdr_cu_event_destroy(CUcontext c, uintptr_t e) {
	GDR_IN_CTX(c, gdr_cu.cuEventDestroy((CUevent)e));
}

static CUresult gdr_cu_ipc_event_get_in(uintptr_t e, char *out) {
	CUipcEventHandle h;
	CUresult r = gdr_cu.cuIpcGetEventHandle(&h, (CUevent)e);
	if (r) return r;
	memcpy(out, h.reserved, 64);
	return 0;
}

static CUresult gdr_cu_ipc_event_get(CUcontext c, uintptr_t e, char *out) {
	GDR_IN_CTX(c, gdr_cu_ipc_event_get_in(e, out));
}

static CUresult gdr_cu_ipc_event_open_in(const char *in, CUevent *out) {
	CUipcEventHandle h;
	memcpy(h.reserved, in, 64);
	return gdr_cu.cuIpcOpenEventHandle(out, h);
}

static CUresult gdr_cu_ipc_event_open(CUcontext c, const char *in, CUevent *out) {
	GDR_IN_CTX(c, gdr_cu_ipc_event_open_in(in, out));
}

static CUresult gdr_cu_flush_rdma(CUcontext c) {
	if (gdr_cu.cuFlushGPUDirectRDMAWrites == NULL) return GDR_CUDA_ERROR_NOT_FOUND_SYMBOL;
	// CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER
	GDR_IN_CTX(c, gdr_cu.cuFlushGPUDirectRDMAWrites(0, 100));
}

static CUresult gdr_cu_ipc_get_in(CUdeviceptr p, char *out) {
	CUipcMemHandle h;
	CUresult r = gdr_cu.cuIpcGetMemHandle(&h, p);
	if (r) return r;
	memcpy(out, h.reserved, 64);
	return 0;
}

static CUresult gdr_cu_ipc_get(CUcontext c, CUdeviceptr p, char *out) {
	GDR_IN_CTX(c, gdr_cu_ipc_get_in(p, out));
}

static CUresult gdr_cu_ipc_open_in(const char *in, CUdeviceptr *out) {
	CUipcMemHandle h;
	memcpy(h.reserved, in, 64);
	return gdr_cu.cuIpcOpenMemHandle(out, h, 1); // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
}

static CUresult gdr_cu_ipc_open(CUcontext c, const char *in, CUdeviceptr *out) {
	GDR_IN_CTX(c, gdr_cu_ipc_open_in(in, out));
}

static CUresult gdr_cu_ipc_close(CUcontext c, CUdeviceptr p) {
	GDR_IN_CTX(c, gdr_cu.cuIpcCloseMemHandle(p));
}

// The context hooks for UCX (package rdma calls them through these pointers, on the thread
// that then calls UCX): gdr_cu_hook_push makes a context current and keeps the one it
// replaces; gdr_cu_hook_pop restores it.
static int gdr_cu_hook_push(void *c) { return gdr_cu.cuCtxPushCurrent((CUcontext)c); }
static void gdr_cu_hook_pop(void) { gdr_cu_pop(); }
static uintptr_t gdr_cu_hook_push_fn(void) { return (uintptr_t)&gdr_cu_hook_push; }
static uintptr_t gdr_cu_hook_pop_fn(void) { return (uintptr_t)&gdr_cu_hook_pop; }

static void gdr_cu_error(CUresult r, const char **name, const char **desc) {
	*name = NULL;
	*desc = NULL;
	if (gdr_cu.cuGetErrorName) gdr_cu.cuGetErrorName(r, name);
	if (gdr_cu.cuGetErrorString) gdr_cu.cuGetErrorString(r, desc);
}
*/
import "C"

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// LibraryName is the soname dlopen'ed.
const LibraryName = "libcuda.so.1"

const cudaErrorNoDevice = 100

type real struct {
	once    sync.Once
	initErr error

	mu   sync.Mutex
	ctxs map[int]C.CUcontext

	streams sync.Map // driver.Stream -> int (device)
	events  sync.Map // driver.Event -> int (device)

	// syncStreams keeps, per device, idle streams for Memcpy without a stream.
	// They are blocking streams, so a copy on one is still ordered after work
	// on the legacy default stream. Unlike a copy on the legacy stream, it is
	// not ordered after work on the application's other blocking streams:
	// work that fills a buffer there must be complete before the buffer is
	// copied (as work on non-blocking streams always had to be). In return
	// each copy waits for itself alone: concurrent copies (transfers of
	// several calls at once) neither queue behind one another on the legacy
	// stream nor wait for one another to finish.
	syncStreams sync.Map // int (device) -> *streamList

	// What never changes after cuInit is read once.
	countOnce sync.Once
	count     int
	countErr  error
	uuids     sync.Map // int -> [16]byte
	attrs     sync.Map // attrKey -> int
	peers     sync.Map // [2]int{low, high} device pair -> *peerAccess
}

type streamList struct {
	mu   sync.Mutex
	free []C.CUstream
}

// syncStream returns an idle stream of device dev (context c), made if none is idle; give it
// back with putSyncStream.
func (d *real) syncStream(dev int, c C.CUcontext) (C.CUstream, error) {
	v, ok := d.syncStreams.Load(dev)
	if !ok {
		v, _ = d.syncStreams.LoadOrStore(dev, &streamList{})
	}
	l := v.(*streamList)
	l.mu.Lock()
	if n := len(l.free); n > 0 {
		s := l.free[n-1]
		l.free = l.free[:n-1]
		l.mu.Unlock()
		return s, nil
	}
	l.mu.Unlock()
	var s C.CUstream
	if err := cuErr("cuStreamCreate", C.gdr_cu_stream_create(c, 0, &s)); err != nil {
		return nil, err
	}
	return s, nil
}

func (d *real) putSyncStream(dev int, s C.CUstream) {
	v, _ := d.syncStreams.Load(dev)
	l := v.(*streamList)
	l.mu.Lock()
	l.free = append(l.free, s)
	l.mu.Unlock()
}

// peerAccess is where enabling peer access between two devices stands.
type peerAccess struct {
	done atomic.Bool // enabled, or the devices cannot reach each other
	mu   sync.Mutex
	next time.Time // when an attempt that failed is made again
}

// peerRetry is how long after a failed attempt to enable peer access
// between two devices (a transient shortage of the driver's) the next copy
// between them tries again; the copies meanwhile go staged.
const peerRetry = 10 * time.Second

type attrKey struct {
	dev  int
	attr driver.Attribute
}

var theDriver = newReal()

func newReal() *real { return &real{ctxs: map[int]C.CUcontext{}} }

// Default returns the process's CUDA driver (loaded on first Init).
func Default() driver.Driver { return theDriver }

func cuErr(op string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	if r == C.GDR_CUDA_ERROR_NOT_FOUND_SYMBOL {
		return fmt.Errorf("%s: not in this libcuda: %w", op, driver.ErrNotSupported)
	}
	var name, desc *C.char
	C.gdr_cu_error(r, &name, &desc)
	e := &driver.Error{Op: op, Code: int(r)}
	if name != nil {
		e.Name = C.GoString(name)
	}
	if desc != nil {
		e.Desc = C.GoString(desc)
	}
	return e
}

func (d *real) Init() error {
	d.once.Do(func() {
		cname := C.CString(LibraryName)
		defer C.free(unsafe.Pointer(cname))
		if msg := C.gdr_cu_load(cname); msg != nil {
			d.initErr = fmt.Errorf("devicebuf: CUDA driver: %s: %w", C.GoString(msg), driver.ErrNotSupported)
			return
		}
		if r := C.gdr_cu_init(); r != 0 {
			err := cuErr("cuInit", r)
			if r == cudaErrorNoDevice {
				d.initErr = fmt.Errorf("devicebuf: CUDA driver: no CUDA device: %v: %w", err, driver.ErrNotSupported)
			} else {
				d.initErr = fmt.Errorf("devicebuf: CUDA driver: %v: %w", err, driver.ErrNotSupported)
			}
		}
	})
	return d.initErr
}

func (d *real) DriverVersion() (int, error) {
	if err := d.Init(); err != nil {
		return 0, err
	}
	var v C.int
	return int(v), cuErr("cuDriverGetVersion", C.gdr_cu_driver_version(&v))
}

func (d *real) DeviceCount() (int, error) {
	if err := d.Init(); err != nil {
		return 0, err
	}
	d.countOnce.Do(func() {
		var n C.int
		d.countErr = cuErr("cuDeviceGetCount", C.gdr_cu_device_count(&n))
		d.count = int(n)
	})
	return d.count, d.countErr
}

func (d *real) DeviceUUID(dev int) ([16]byte, error) {
	if u, ok := d.uuids.Load(dev); ok {
		return u.([16]byte), nil
	}
	u, err := d.deviceUUID(dev)
	if err == nil {
		d.uuids.Store(dev, u)
	}
	return u, err
}

func (d *real) deviceUUID(dev int) ([16]byte, error) {
	var u [16]byte
	if err := d.Init(); err != nil {
		return u, err
	}
	var buf [16]C.char
	if err := cuErr("cuDeviceGetUuid", C.gdr_cu_device_uuid(C.int(dev), &buf[0])); err != nil {
		return u, err
	}
	for i := range u {
		u[i] = byte(buf[i])
	}
	return u, nil
}

func (d *real) DeviceName(dev int) (string, error) {
	if err := d.Init(); err != nil {
		return "", err
	}
	var buf [256]C.char
	if err := cuErr("cuDeviceGetName", C.gdr_cu_device_name(C.int(dev), &buf[0], C.int(len(buf)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (d *real) DevicePCIBusID(dev int) (string, error) {
	if err := d.Init(); err != nil {
		return "", err
	}
	var buf [64]C.char
	if err := cuErr("cuDeviceGetPCIBusId", C.gdr_cu_device_busid(C.int(dev), &buf[0], C.int(len(buf)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (d *real) DeviceTotalMem(dev int) (uint64, error) {
	if err := d.Init(); err != nil {
		return 0, err
	}
	var n C.size_t
	return uint64(n), cuErr("cuDeviceTotalMem", C.gdr_cu_device_mem(C.int(dev), &n))
}

// DeviceAttribute reads an attribute; the values devicebuf reads are fixed for the life of
// the process, so each is read from the driver once.
func (d *real) DeviceAttribute(dev int, attr driver.Attribute) (int, error) {
	k := attrKey{dev, attr}
	if v, ok := d.attrs.Load(k); ok {
		return v.(int), nil
	}
	if err := d.Init(); err != nil {
		return 0, err
	}
	var v C.int
	if err := cuErr("cuDeviceGetAttribute", C.gdr_cu_device_attr(C.int(dev), C.int(attr), &v)); err != nil {
		return 0, err
	}
	d.attrs.Store(k, int(v))
	return int(v), nil
}

// ctx returns dev's primary context, retained on first use and kept for the process's life.
func (d *real) ctx(dev int) (C.CUcontext, error) {
	if err := d.Init(); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if c, ok := d.ctxs[dev]; ok {
		return c, nil
	}
	var c C.CUcontext
	if err := cuErr("cuDevicePrimaryCtxRetain", C.gdr_cu_ctx_retain(C.int(dev), &c)); err != nil {
		return nil, err
	}
	d.ctxs[dev] = c
	return c, nil
}

// enablePeer enables peer access between two devices' primary contexts once
// per pair, so peer copies between them take NVLink or PCIe directly. A copy
// needs none: between devices that cannot reach each other, or while enabling
// fails, the driver stages it through host memory, and a failed attempt is
// made again peerRetry later rather than never (a copy that failed for it
// would fail the transfer, and a failure kept for good would slow every
// later one).
func (d *real) enablePeer(da int, a C.CUcontext, db int, b C.CUcontext) {
	k := [2]int{min(da, db), max(da, db)}
	v, _ := d.peers.LoadOrStore(k, &peerAccess{})
	pa := v.(*peerAccess)
	if pa.done.Load() {
		return
	}
	pa.mu.Lock()
	defer pa.mu.Unlock()
	if pa.done.Load() || time.Now().Before(pa.next) {
		return
	}
	if C.gdr_cu_enable_peer(a, C.int(da), b, C.int(db)) != 0 {
		pa.next = time.Now().Add(peerRetry)
		return
	}
	pa.done.Store(true)
}

func (d *real) MemAlloc(dev int, n int) (uintptr, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	if err := cuErr("cuMemAlloc", C.gdr_cu_mem_alloc(c, C.size_t(n), &p)); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

func (d *real) MemFree(dev int, p uintptr) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return cuErr("cuMemFree", C.gdr_cu_mem_free(c, C.CUdeviceptr(p)))
}

func (d *real) SetSyncMemops(dev int, p uintptr) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return cuErr("cuPointerSetAttribute(SYNC_MEMOPS)", C.gdr_cu_sync_memops(c, C.CUdeviceptr(p)))
}

func (d *real) MemAddressRange(dev int, p uintptr) (uintptr, int, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, 0, err
	}
	var base C.CUdeviceptr
	var size C.size_t
	if err := cuErr("cuMemGetAddressRange", C.gdr_cu_address_range(c, C.CUdeviceptr(p), &base, &size)); err != nil {
		return 0, 0, err
	}
	return uintptr(base), int(size), nil
}

// hostCtx is the context host registrations are made in (PORTABLE makes them valid in all).
func (d *real) hostCtx() (C.CUcontext, error) { return d.ctx(0) }

func (d *real) MemHostRegister(p uintptr, n int) error {
	c, err := d.hostCtx()
	if err != nil {
		return err
	}
	return cuErr("cuMemHostRegister", C.gdr_cu_host_register(c, C.uintptr_t(p), C.size_t(n)))
}

func (d *real) MemHostUnregister(p uintptr) error {
	c, err := d.hostCtx()
	if err != nil {
		return err
	}
	return cuErr("cuMemHostUnregister", C.gdr_cu_host_unregister(c, C.uintptr_t(p)))
}

func (d *real) Memcpy(dir driver.Dir, dstDev int, dst uintptr, srcDev int, src uintptr, n int, s driver.Stream) error {
	var cdir C.int
	var ctxDev int
	switch dir {
	case driver.HtoD:
		cdir, ctxDev = 1, dstDev
	case driver.DtoH:
		cdir, ctxDev = 2, srcDev
	case driver.DtoD:
		cdir, ctxDev = 3, dstDev
		if srcDev != dstDev {
			cdir = 4
		}
	default:
		return fmt.Errorf("memcpy: bad direction %d", dir)
	}
	if s != 0 {
		v, ok := d.streams.Load(s)
		if !ok {
			return fmt.Errorf("memcpy: unknown stream %#x", uintptr(s))
		}
		ctxDev = v.(int)
	}
	c, err := d.ctx(ctxDev)
	if err != nil {
		return err
	}
	var dstc, srcc C.CUcontext
	if cdir == 4 {
		if dstc, err = d.ctx(dstDev); err != nil {
			return err
		}
		if srcc, err = d.ctx(srcDev); err != nil {
			return err
		}
		d.enablePeer(dstDev, dstc, srcDev, srcc)
	}
	if s != 0 {
		return cuErr("cuMemcpyAsync", C.gdr_cu_memcpy(c, cdir, dstc, C.uintptr_t(dst), srcc, C.uintptr_t(src), C.size_t(n), C.uintptr_t(s), nil))
	}
	st, err := d.syncStream(ctxDev, c)
	if err != nil {
		return err
	}
	var queued C.int
	r := C.gdr_cu_memcpy(c, cdir, dstc, C.uintptr_t(dst), srcc, C.uintptr_t(src), C.size_t(n), C.uintptr_t(uintptr(unsafe.Pointer(st))), &queued)
	return d.settled(ctxDev, st, "cuMemcpyAsync", r, queued != 0)
}

// settled ends a synchronous copy or memset on the pool's stream st: st goes
// back to the pool, unless the work was queued on it and the wait failed
// (ErrUnsettled), leaving the work of unknown state on st, which then goes
// nowhere: a later copy on it would fail or wait on the same.
func (d *real) settled(dev int, st C.CUstream, call string, r C.CUresult, queued bool) error {
	if r == 0 || !queued {
		d.putSyncStream(dev, st)
		return cuErr(call, r)
	}
	return fmt.Errorf("%w: %w", driver.ErrUnsettled, cuErr("cuStreamSynchronize", r))
}

func (d *real) MemsetZero(dev int, p uintptr, n int) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	st, err := d.syncStream(dev, c)
	if err != nil {
		return err
	}
	var queued C.int
	r := C.gdr_cu_memset_zero(c, C.uintptr_t(p), C.size_t(n), C.uintptr_t(uintptr(unsafe.Pointer(st))), &queued)
	return d.settled(dev, st, "cuMemsetD8Async", r, queued != 0)
}

func (d *real) StreamCreate(dev int, blocking bool) (driver.Stream, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	var s C.CUstream
	flags := C.uint(1)
	if blocking {
		flags = 0
	}
	if err := cuErr("cuStreamCreate", C.gdr_cu_stream_create(c, flags, &s)); err != nil {
		return 0, err
	}
	h := driver.Stream(uintptr(unsafe.Pointer(s)))
	d.streams.Store(h, dev)
	return h, nil
}

func (d *real) streamCtx(s driver.Stream) (C.CUcontext, error) {
	v, ok := d.streams.Load(s)
	if !ok {
		return nil, fmt.Errorf("unknown stream %#x", uintptr(s))
	}
	return d.ctx(v.(int))
}

func (d *real) StreamSynchronize(s driver.Stream) error {
	c, err := d.streamCtx(s)
	if err != nil {
		return err
	}
	return cuErr("cuStreamSynchronize", C.gdr_cu_stream_sync(c, C.uintptr_t(s)))
}

func (d *real) StreamDestroy(s driver.Stream) error {
	c, err := d.streamCtx(s)
	if err != nil {
		return err
	}
	d.streams.Delete(s)
	return cuErr("cuStreamDestroy", C.gdr_cu_stream_destroy(c, C.uintptr_t(s)))
}

func (d *real) StreamAdopt(dev int, s driver.Stream) error {
	if s == 0 {
		return fmt.Errorf("adopt stream: the legacy default stream is not a stream of its own")
	}
	if _, err := d.ctx(dev); err != nil {
		return err
	}
	if _, loaded := d.streams.LoadOrStore(s, dev); loaded {
		return fmt.Errorf("adopt stream: %#x is known already", uintptr(s))
	}
	return nil
}

func (d *real) StreamDisown(s driver.Stream) error {
	if _, ok := d.streams.LoadAndDelete(s); !ok {
		return fmt.Errorf("unknown stream %#x", uintptr(s))
	}
	return nil
}

// streamEventCtx returns the context of stream s for a call that also takes event e.
func (d *real) streamEventCtx(s driver.Stream, e driver.Event) (C.CUcontext, error) {
	if _, ok := d.events.Load(e); !ok {
		return nil, fmt.Errorf("unknown event %#x", uintptr(e))
	}
	return d.streamCtx(s)
}

func (d *real) StreamWaitEvent(s driver.Stream, e driver.Event) error {
	c, err := d.streamEventCtx(s, e)
	if err != nil {
		return err
	}
	return cuErr("cuStreamWaitEvent", C.gdr_cu_stream_wait_event(c, C.uintptr_t(s), C.uintptr_t(e)))
}

func (d *real) newEvent(dev int, e C.CUevent) driver.Event {
	h := driver.Event(uintptr(unsafe.Pointer(e)))
	d.events.Store(h, dev)
	return h
}

func (d *real) eventCtx(e driver.Event) (C.CUcontext, error) {
	v, ok := d.events.Load(e)
	if !ok {
		return nil, fmt.Errorf("unknown event %#x", uintptr(e))
	}
	return d.ctx(v.(int))
}

func (d *real) EventCreate(dev int, interprocess bool) (driver.Event, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	ipc := C.int(0)
	if interprocess {
		ipc = 1
	}
	var e C.CUevent
	if err := cuErr("cuEventCreate", C.gdr_cu_event_create(c, ipc, &e)); err != nil {
		return 0, err
	}
	return d.newEvent(dev, e), nil
}

func (d *real) EventRecord(e driver.Event, s driver.Stream) error {
	c, err := d.streamEventCtx(s, e)
	if err != nil {
		return err
	}
	return cuErr("cuEventRecord", C.gdr_cu_event_record(c, C.uintptr_t(e), C.uintptr_t(s)))
}

func (d *real) EventSynchronize(e driver.Event) error {
	c, err := d.eventCtx(e)
	if err != nil {
		return err
	}
	return cuErr("cuEventSynchronize", C.gdr_cu_event_sync(c, C.uintptr_t(e)))
}

// cudaErrorNotReady is CUDA_ERROR_NOT_READY: cuEventQuery's answer for work not yet done.
const cudaErrorNotReady = 600

func (d *real) EventQuery(e driver.Event) (bool, error) {
	c, err := d.eventCtx(e)
	if err != nil {
		return false, err
	}
	r := C.gdr_cu_event_query(c, C.uintptr_t(e))
	if r == cudaErrorNotReady {
		return false, nil
	}
	return r == 0, cuErr("cuEventQuery", r)
}

func (d *real) EventDestroy(e driver.Event) error {
	c, err := d.eventCtx(e)
	if err != nil {
		return err
	}
	d.events.Delete(e)
	return cuErr("cuEventDestroy", C.gdr_cu_event_destroy(c, C.uintptr_t(e)))
}

func (d *real) IpcGetEventHandle(e driver.Event) ([driver.IPCHandleSize]byte, error) {
	var h [driver.IPCHandleSize]byte
	c, err := d.eventCtx(e)
	if err != nil {
		return h, err
	}
	var buf [driver.IPCHandleSize]C.char
	if err := cuErr("cuIpcGetEventHandle", C.gdr_cu_ipc_event_get(c, C.uintptr_t(e), &buf[0])); err != nil {
		return h, err
	}
	return handleFromC(&buf), nil
}

func (d *real) IpcOpenEventHandle(dev int, h [driver.IPCHandleSize]byte) (driver.Event, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	buf := handleToC(h)
	var e C.CUevent
	if err := cuErr("cuIpcOpenEventHandle", C.gdr_cu_ipc_event_open(c, &buf[0], &e)); err != nil {
		return 0, err
	}
	return d.newEvent(dev, e), nil
}

func (d *real) FlushRDMAWrites(dev int) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return cuErr("cuFlushGPUDirectRDMAWrites", C.gdr_cu_flush_rdma(c))
}

// ThreadContext implements driver.ThreadContexts.
func (d *real) ThreadContext(dev int) (ctx, push, pop uintptr, err error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, 0, 0, err
	}
	return uintptr(c), uintptr(C.gdr_cu_hook_push_fn()), uintptr(C.gdr_cu_hook_pop_fn()), nil
}

var _ driver.ThreadContexts = (*real)(nil)

func (d *real) IpcGetMemHandle(dev int, p uintptr) ([driver.IPCHandleSize]byte, error) {
	var h [driver.IPCHandleSize]byte
	c, err := d.ctx(dev)
	if err != nil {
		return h, err
	}
	var buf [driver.IPCHandleSize]C.char
	if err := cuErr("cuIpcGetMemHandle", C.gdr_cu_ipc_get(c, C.CUdeviceptr(p), &buf[0])); err != nil {
		return h, err
	}
	return handleFromC(&buf), nil
}

func (d *real) IpcOpenMemHandle(dev int, h [driver.IPCHandleSize]byte) (uintptr, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	buf := handleToC(h)
	var p C.CUdeviceptr
	if err := cuErr("cuIpcOpenMemHandle", C.gdr_cu_ipc_open(c, &buf[0], &p)); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

// handleFromC and handleToC convert an IPC handle (memory or event) between Go and C.
func handleFromC(buf *[driver.IPCHandleSize]C.char) (h [driver.IPCHandleSize]byte) {
	for i := range h {
		h[i] = byte(buf[i])
	}
	return h
}

func handleToC(h [driver.IPCHandleSize]byte) (buf [driver.IPCHandleSize]C.char) {
	for i := range h {
		buf[i] = C.char(h[i])
	}
	return buf
}

func (d *real) IpcCloseMemHandle(dev int, p uintptr) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return cuErr("cuIpcCloseMemHandle", C.gdr_cu_ipc_close(c, C.CUdeviceptr(p)))
}
