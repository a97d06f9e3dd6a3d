// C side of the UCX binding: libucp is loaded at run time (dlopen), every UCX
// call goes through the helpers below, all made on a worker's owner thread
// except the context-level ones (context, memory maps, rkey pack).
#ifndef GDRPC_RDMA_UCX_H
#define GDRPC_RDMA_UCX_H

#include <stddef.h>
#include <stdint.h>

#include "ucxabi.h"

// Event kinds pushed by UCX callbacks into a worker's event ring.
enum {
	RDMA_EV_REQ = 1,    // request id completed with status
	RDMA_EV_EP_ERR = 2, // endpoint id failed with status
	RDMA_EV_CONN = 3,   // listener id got conn request ptr
	RDMA_EV_FIN = 4,    // peer endpoint ptr (reply ep) sent FIN
	RDMA_EV_STREAM = 5, // endpoint id has stream data
	RDMA_EV_FINACK = 6, // peer endpoint ptr (reply ep) processed our FIN
};

typedef struct {
	int32_t kind;
	int32_t status;
	uint64_t id;
	uintptr_t ptr;
} rdma_event_t;

// CUDA context hooks (from package devicebuf): UCX calls that may touch CUDA memory run
// with ctx current on the calling thread, the thread's previous context restored after.
// push returns 0 (CUDA_SUCCESS) when ctx became current. A zero value means no hooks.
typedef struct {
	int (*push)(void *ctx);
	void (*pop)(void);
	void *ctx;
} rdma_cuda_t;

typedef struct rdma_worker rdma_worker_t;

typedef struct rdma_listener rdma_listener_t;

typedef struct {
	ucp_ep_h ep;
	rdma_worker_t *w;
	uint64_t id;
	// current stream fragment being consumed
	void *cur;
	size_t cur_off, cur_len;
} rdma_ep_t;

// loading and context
int rdma_load(char *err, size_t errlen);
const char *rdma_status_string(int status);
const char *rdma_version(void);

int rdma_context_create(const char **keys, const char **values, int n, ucp_context_h *out, char *err, size_t errlen);
void rdma_context_destroy(ucp_context_h ctx);
uint64_t rdma_context_memtypes(ucp_context_h ctx);
char *rdma_context_info(ucp_context_h ctx, size_t *len); // free()

// worker
int rdma_worker_create(ucp_context_h ctx, uint64_t client_id, rdma_worker_t **out);
void rdma_worker_destroy(rdma_worker_t *w);
int rdma_worker_signal(rdma_worker_t *w);
// set the hooks every later call on w runs under (push/pop are C function pointers)
void rdma_worker_set_cuda(rdma_worker_t *w, const rdma_cuda_t *cu);
void rdma_cuda_init(rdma_cuda_t *cu, uintptr_t push, uintptr_t pop, uintptr_t ctx);
// progress: loops ucp_worker_progress (at most max rounds), polls streams; returns work done.
unsigned rdma_worker_progress(rdma_worker_t *w, int max);
// take events out of the ring; returns number copied.
int rdma_worker_events(rdma_worker_t *w, rdma_event_t *out, int max);
// arm the worker: UCS_OK, or UCS_ERR_BUSY with events to progress
int rdma_worker_arm(rdma_worker_t *w);
// poll the efd for at most timeout_ms; 1 = woke, 0 = timeout, <0 = -errno
int rdma_worker_wait(rdma_worker_t *w, int timeout_ms);
// a close-on-exec, non-blocking duplicate of the worker's event fd (an epoll
// fd), for Go's poller; -errno on failure
int rdma_worker_dup_efd(rdma_worker_t *w);
// returns status or request pointer packed: *req set when in progress
int rdma_worker_flush(rdma_worker_t *w, uint64_t id, void **req);

// listener: ip is 4 or 16 bytes
int rdma_listener_create(rdma_worker_t *w, uint64_t id, const uint8_t *ip, int iplen, int port, rdma_listener_t **out);
void rdma_listener_destroy(rdma_listener_t *l);
int rdma_listener_port(rdma_listener_t *l);
int rdma_conn_request_addr(uintptr_t req, uint8_t *ip, int *iplen, int *port);
int rdma_conn_request_client_id(uintptr_t req, uint64_t *id);
int rdma_listener_reject(rdma_listener_t *l, uintptr_t req);

// endpoints
int rdma_ep_connect(rdma_worker_t *w, uint64_t id, const uint8_t *ip, int iplen, int port, int send_id, rdma_ep_t **out);
int rdma_ep_accept(rdma_worker_t *w, uint64_t id, uintptr_t req, rdma_ep_t **out);
int rdma_ep_addrs(rdma_ep_t *e, uint8_t *lip, int *liplen, int *lport, uint8_t *rip, int *riplen, int *rport);
int rdma_ep_close(rdma_worker_t *w, rdma_ep_t *e, uint64_t id, void **req); // force close
void rdma_ep_free(rdma_ep_t *e);
char *rdma_ep_info(rdma_ep_t *e, size_t *len); // free()
int rdma_ep_flush(rdma_worker_t *w, rdma_ep_t *e, uint64_t id, void **req);
int rdma_ep_fin(rdma_worker_t *w, rdma_ep_t *e, int ack, uint64_t id, void **req);
int rdma_stream_send(rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, uint64_t id, void **req);
// copy up to cap bytes of received stream data into dst; *more=1 when data is known to remain.
size_t rdma_stream_read(rdma_ep_t *e, void *dst, size_t cap, int *more);
void rdma_stream_release(rdma_ep_t *e);
// put/get: cuda says the local buffer is CUDA memory; memh is its registration (NULL: none).
int rdma_put(rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, int cuda, ucp_mem_h memh, uint64_t remote, ucp_rkey_h rkey, uint64_t id, void **req);
int rdma_get(rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, int cuda, ucp_mem_h memh, uint64_t remote, ucp_rkey_h rkey, uint64_t id, void **req);
void rdma_request_free(void *req);
void rdma_request_cancel(rdma_worker_t *w, void *req);

// memory
// memory: cu (NULL for host memory) is made current around calls on CUDA memory
int rdma_mem_map(ucp_context_h ctx, const rdma_cuda_t *cu, uintptr_t addr, size_t n, int cuda, int alloc, ucp_mem_h *out, void **oaddr, size_t *olen);
int rdma_mem_unmap(ucp_context_h ctx, const rdma_cuda_t *cu, ucp_mem_h m);
int rdma_rkey_pack(ucp_context_h ctx, const rdma_cuda_t *cu, ucp_mem_h m, void **buf, size_t *len);
void rdma_rkey_buffer_release(void *buf);
int rdma_rkey_unpack(rdma_ep_t *e, const void *buf, ucp_rkey_h *out);
void rdma_rkey_destroy(rdma_worker_t *w, ucp_rkey_h k);
int rdma_rkey_ptr(ucp_rkey_h k, uint64_t raddr, void **out);

#endif
