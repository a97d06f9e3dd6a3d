//go:build cgo && !nordma

#define _GNU_SOURCE
#include "ucx.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

// ---- run-time loading of libucp -------------------------------------------

// One pointer per UCX function, typed from its declared signature.
#define DECL(ret, name, args) static ret(*p_##name) args;
UCXABI_FUNCS(DECL)
#undef DECL

static void *ucp_handle;

int rdma_load(char *err, size_t errlen)
{
	if (ucp_handle != NULL) {
		return 0;
	}
	void *h = dlopen("libucp.so.0", RTLD_NOW | RTLD_GLOBAL);
	if (h == NULL) {
		snprintf(err, errlen, "%s", dlerror());
		return -1;
	}
#define LOAD(ret, name, args)                                           \
	p_##name = (ret(*) args)dlsym(h, #name);                            \
	if (p_##name == NULL) {                                             \
		snprintf(err, errlen, "libucp.so.0: missing symbol %s", #name); \
		return -1;                                                      \
	}
	UCXABI_FUNCS(LOAD)
#undef LOAD
	ucp_handle = h;
	return 0;
}

const char *rdma_status_string(int status)
{
	return p_ucs_status_string((ucs_status_t)status);
}

const char *rdma_version(void) { return p_ucp_get_version_string(); }

typedef struct {
	uint64_t id;
} rdma_req_t;

// ---- context -----------------------------------------------------------------

int rdma_context_create(const char **keys, const char **values, int n, ucp_context_h *out, char *err, size_t errlen)
{
	ucp_config_t *config;
	ucs_status_t st = p_ucp_config_read(NULL, NULL, &config);
	if (st != UCS_OK) {
		snprintf(err, errlen, "ucp_config_read");
		return st;
	}
	for (int i = 0; i < n; i++) {
		st = p_ucp_config_modify(config, keys[i], values[i]);
		if (st != UCS_OK) {
			snprintf(err, errlen, "ucp_config_modify %s=%s", keys[i], values[i]);
			p_ucp_config_release(config);
			return st;
		}
	}
	ucp_params_t params;
	memset(&params, 0, sizeof(params));
	params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
	                    UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_REQUEST_SIZE;
	params.request_size = sizeof(rdma_req_t);
	params.features = UCP_FEATURE_STREAM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP | UCP_FEATURE_AM;
	params.mt_workers_shared = 1;
	params.name = "gdrpc";
	st = p_ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, out);
	p_ucp_config_release(config);
	if (st != UCS_OK) {
		snprintf(err, errlen, "ucp_init");
	}
	return st;
}

void rdma_context_destroy(ucp_context_h ctx) { p_ucp_cleanup(ctx); }

uint64_t rdma_context_memtypes(ucp_context_h ctx)
{
	ucp_context_attr_t attr;
	memset(&attr, 0, sizeof(attr));
	attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	if (p_ucp_context_query(ctx, &attr) != UCS_OK) {
		return 1ull << UCS_MEMORY_TYPE_HOST;
	}
	return attr.memory_types;
}

char *rdma_context_info(ucp_context_h ctx, size_t *len)
{
	char *buf = NULL;
	FILE *f = open_memstream(&buf, len);
	if (f == NULL) {
		return NULL;
	}
	p_ucp_context_print_info(ctx, f);
	fclose(f);
	return buf;
}

// ---- worker and its event ring ----------------------------------------------

// Active message ids: FIN (the peer closes: everything it sent precedes this)
// and FIN-ACK (the FIN was processed: the closer may release the endpoint).
#define RDMA_FIN_AM_ID 0x6764
#define RDMA_FINACK_AM_ID 0x6765

struct rdma_worker {
	ucp_worker_h w;
	rdma_cuda_t cu; // set by the worker's lock holder only
	int efd;
	pthread_mutex_t mu; // guards the ring: callbacks may run on UCX's async thread
	rdma_event_t *ev;
	int nev, cap;
};

void rdma_cuda_init(rdma_cuda_t *cu, uintptr_t push, uintptr_t pop, uintptr_t ctx)
{
	cu->push = (int (*)(void *))push;
	cu->pop = (void (*)(void))pop;
	cu->ctx = (void *)ctx;
}

// cuda_enter makes cu's context current on this thread; it returns 1 when cuda_leave must
// restore the previous one, 0 when there are no hooks, -1 when the context could not be made
// current.
static int cuda_enter(const rdma_cuda_t *cu)
{
	if (cu == NULL || cu->push == NULL) {
		return 0;
	}
	return cu->push(cu->ctx) == 0 ? 1 : -1;
}

static void cuda_leave(const rdma_cuda_t *cu, int entered)
{
	if (entered == 1) {
		cu->pop();
	}
}

static void push_event(rdma_worker_t *w, int kind, int status, uint64_t id, uintptr_t ptr)
{
	pthread_mutex_lock(&w->mu);
	if (w->nev == w->cap) {
		int ncap = w->cap ? 2 * w->cap : 64;
		rdma_event_t *n = realloc(w->ev, ncap * sizeof(*n));
		if (n == NULL) {
			pthread_mutex_unlock(&w->mu);
			abort(); // out of memory: losing a completion would hang a caller
		}
		w->ev = n;
		w->cap = ncap;
	}
	rdma_event_t *e = &w->ev[w->nev++];
	e->kind = kind;
	e->status = status;
	e->id = id;
	e->ptr = ptr;
	pthread_mutex_unlock(&w->mu);
}

static ucs_status_t fin_cb(void *arg, const void *header, size_t header_length, void *data,
                           size_t length, const ucp_am_recv_param_t *param)
{
	if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
		push_event(arg, RDMA_EV_FIN, 0, 0, (uintptr_t)param->reply_ep);
	}
	return UCS_OK;
}

static ucs_status_t finack_cb(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
	if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
		push_event(arg, RDMA_EV_FINACK, 0, 0, (uintptr_t)param->reply_ep);
	}
	return UCS_OK;
}

int rdma_worker_create(ucp_context_h ctx, uint64_t client_id, rdma_worker_t **out)
{
	rdma_worker_t *w = calloc(1, sizeof(*w));
	if (w == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	pthread_mutex_init(&w->mu, NULL);
	ucp_worker_params_t wp;
	memset(&wp, 0, sizeof(wp));
	wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_CLIENT_ID;
	wp.thread_mode = UCS_THREAD_MODE_SERIALIZED; // any goroutine holding the worker's lock calls in
	wp.client_id = client_id;                    // sent with each connection request (SEND_CLIENT_ID)
	ucs_status_t st = p_ucp_worker_create(ctx, &wp, &w->w);
	if (st != UCS_OK) {
		free(w);
		return st;
	}
	st = p_ucp_worker_get_efd(w->w, &w->efd);
	if (st == UCS_OK) {
		ucp_am_handler_param_t ap;
		memset(&ap, 0, sizeof(ap));
		ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
		                UCP_AM_HANDLER_PARAM_FIELD_ARG;
		ap.id = RDMA_FIN_AM_ID;
		ap.cb = fin_cb;
		ap.arg = w;
		st = p_ucp_worker_set_am_recv_handler(w->w, &ap);
		if (st == UCS_OK) {
			ap.id = RDMA_FINACK_AM_ID;
			ap.cb = finack_cb;
			st = p_ucp_worker_set_am_recv_handler(w->w, &ap);
		}
	}
	if (st != UCS_OK) {
		p_ucp_worker_destroy(w->w);
		free(w);
		return st;
	}
	*out = w;
	return UCS_OK;
}

void rdma_worker_destroy(rdma_worker_t *w)
{
	int in = cuda_enter(&w->cu);
	p_ucp_worker_destroy(w->w);
	cuda_leave(&w->cu, in);
	pthread_mutex_destroy(&w->mu);
	free(w->ev);
	free(w);
}

int rdma_worker_signal(rdma_worker_t *w) { return p_ucp_worker_signal(w->w); }

void rdma_worker_set_cuda(rdma_worker_t *w, const rdma_cuda_t *cu) { w->cu = *cu; }

unsigned rdma_worker_progress(rdma_worker_t *w, int max)
{
	unsigned total = 0;
	int in = cuda_enter(&w->cu);
	for (int i = 0; i < max; i++) {
		unsigned n = p_ucp_worker_progress(w->w);
		total += n;
		if (n == 0) {
			break;
		}
	}
	cuda_leave(&w->cu, in);
	ucp_stream_poll_ep_t eps[16];
	for (;;) {
		ssize_t n = p_ucp_stream_worker_poll(w->w, eps, 16, 0);
		if (n <= 0) {
			break;
		}
		for (ssize_t i = 0; i < n; i++) {
			push_event(w, RDMA_EV_STREAM, 0, ((rdma_ep_t *)eps[i].user_data)->id, 0);
		}
		total += n;
		if (n < 16) {
			break;
		}
	}
	return total;
}

int rdma_worker_events(rdma_worker_t *w, rdma_event_t *out, int max)
{
	pthread_mutex_lock(&w->mu);
	int n = w->nev < max ? w->nev : max;
	memcpy(out, w->ev, n * sizeof(*out));
	memmove(w->ev, w->ev + n, (w->nev - n) * sizeof(*out));
	w->nev -= n;
	pthread_mutex_unlock(&w->mu);
	return n;
}

int rdma_worker_arm(rdma_worker_t *w) { return p_ucp_worker_arm(w->w); }

int rdma_worker_dup_efd(rdma_worker_t *w)
{
	int fd = fcntl(w->efd, F_DUPFD_CLOEXEC, 0);
	if (fd < 0) {
		return -errno;
	}
	// O_NONBLOCK lands on the description UCX's descriptor shares: UCX only
	// calls epoll_wait and epoll_ctl on it, and rdma_worker_wait poll, none
	// of which the flag changes.
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
		int e = errno;
		close(fd);
		return -e;
	}
	return fd;
}

int rdma_worker_wait(rdma_worker_t *w, int timeout_ms)
{
	struct pollfd p = {.fd = w->efd, .events = POLLIN};
	int r = poll(&p, 1, timeout_ms);
	if (r < 0) {
		return errno == EINTR ? 1 : -errno;
	}
	return r;
}

// Every request carries our id in its user area (ucp_params.request_size);
// user_data is the worker. A completion callback cannot run before the nbx
// call that made the request returns (no UCP_OP_ATTR_FLAG_NO_IMM_CMPL), and the
// id is written right after that return, on the same thread.
static void req_cb(void *req, ucs_status_t status, void *user_data)
{
	push_event((rdma_worker_t *)user_data, RDMA_EV_REQ, status, ((rdma_req_t *)req)->id, (uintptr_t)req);
}

static int ret_req(ucs_status_ptr_t p, uint64_t id, void **req)
{
	*req = NULL;
	if (p == NULL) {
		return UCS_OK;
	}
	if (UCS_PTR_IS_ERR(p)) {
		return UCS_PTR_STATUS(p);
	}
	((rdma_req_t *)p)->id = id;
	*req = p;
	return UCS_INPROGRESS;
}

static void op_param(ucp_request_param_t *rp, rdma_worker_t *w)
{
	memset(rp, 0, sizeof(*rp));
	rp->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
	rp->cb.send = req_cb;
	rp->user_data = w;
}

int rdma_worker_flush(rdma_worker_t *w, uint64_t id, void **req)
{
	ucp_request_param_t rp;
	op_param(&rp, w);
	int in = cuda_enter(&w->cu);
	int st = ret_req(p_ucp_worker_flush_nbx(w->w, &rp), id, req);
	cuda_leave(&w->cu, in);
	return st;
}

// ---- addresses ---------------------------------------------------------------

static int make_sockaddr(const uint8_t *ip, int iplen, int port, struct sockaddr_storage *ss, socklen_t *sl)
{
	memset(ss, 0, sizeof(*ss));
	if (iplen == 4) {
		struct sockaddr_in *s = (struct sockaddr_in *)ss;
		s->sin_family = AF_INET;
		s->sin_port = htons(port);
		memcpy(&s->sin_addr, ip, 4);
		*sl = sizeof(*s);
		return 0;
	}
	if (iplen == 16) {
		struct sockaddr_in6 *s = (struct sockaddr_in6 *)ss;
		s->sin6_family = AF_INET6;
		s->sin6_port = htons(port);
		memcpy(&s->sin6_addr, ip, 16);
		*sl = sizeof(*s);
		return 0;
	}
	return -1;
}

static void split_sockaddr(const struct sockaddr_storage *ss, uint8_t *ip, int *iplen, int *port)
{
	if (ss->ss_family == AF_INET) {
		const struct sockaddr_in *s = (const struct sockaddr_in *)ss;
		memcpy(ip, &s->sin_addr, 4);
		*iplen = 4;
		*port = ntohs(s->sin_port);
	} else if (ss->ss_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)ss;
		memcpy(ip, &s->sin6_addr, 16);
		*iplen = 16;
		*port = ntohs(s->sin6_port);
	} else {
		*iplen = 0;
		*port = 0;
	}
}

// ---- listener ------------------------------------------------------------------

struct rdma_listener {
	ucp_listener_h l;
	rdma_worker_t *w;
	uint64_t id;
};

static void conn_cb(ucp_conn_request_h req, void *arg)
{
	rdma_listener_t *l = arg;
	push_event(l->w, RDMA_EV_CONN, 0, l->id, (uintptr_t)req);
}

int rdma_listener_create(rdma_worker_t *w, uint64_t id, const uint8_t *ip, int iplen, int port, rdma_listener_t **out)
{
	struct sockaddr_storage ss;
	socklen_t sl;
	if (make_sockaddr(ip, iplen, port, &ss, &sl) != 0) {
		return UCS_ERR_INVALID_PARAM;
	}
	ucp_listener_params_t lp;
	memset(&lp, 0, sizeof(lp));
	lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
	lp.sockaddr.addr = (struct sockaddr *)&ss;
	lp.sockaddr.addrlen = sl;
	rdma_listener_t *l = calloc(1, sizeof(*l));
	if (l == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	l->w = w;
	l->id = id;
	lp.conn_handler.cb = conn_cb;
	lp.conn_handler.arg = l;
	ucs_status_t st = p_ucp_listener_create(w->w, &lp, &l->l);
	if (st != UCS_OK) {
		free(l);
		return st;
	}
	*out = l;
	return UCS_OK;
}

void rdma_listener_destroy(rdma_listener_t *l)
{
	p_ucp_listener_destroy(l->l);
	free(l);
}

int rdma_listener_port(rdma_listener_t *l)
{
	ucp_listener_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
	if (p_ucp_listener_query(l->l, &a) != UCS_OK) {
		return -1;
	}
	uint8_t ip[16];
	int iplen, port;
	split_sockaddr(&a.sockaddr, ip, &iplen, &port);
	return port;
}

int rdma_conn_request_addr(uintptr_t req, uint8_t *ip, int *iplen, int *port)
{
	ucp_conn_request_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
	ucs_status_t st = p_ucp_conn_request_query((ucp_conn_request_h)req, &a);
	if (st != UCS_OK) {
		return st;
	}
	split_sockaddr(&a.client_address, ip, iplen, port);
	return UCS_OK;
}

int rdma_conn_request_client_id(uintptr_t req, uint64_t *id)
{
	ucp_conn_request_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
	ucs_status_t st = p_ucp_conn_request_query((ucp_conn_request_h)req, &a);
	if (st != UCS_OK) {
		return st;
	}
	*id = a.client_id;
	return UCS_OK;
}

int rdma_listener_reject(rdma_listener_t *l, uintptr_t req)
{
	return p_ucp_listener_reject(l->l, (ucp_conn_request_h)req);
}

// ---- endpoints -----------------------------------------------------------------

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
	rdma_ep_t *e = arg;
	push_event(e->w, RDMA_EV_EP_ERR, status, e->id, 0);
}

static int ep_create(rdma_worker_t *w, uint64_t id, ucp_ep_params_t *ep, rdma_ep_t **out)
{
	rdma_ep_t *e = calloc(1, sizeof(*e));
	if (e == NULL) {
		return UCS_ERR_NO_MEMORY;
	}
	ep->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER |
	                  UCP_EP_PARAM_FIELD_USER_DATA;
	ep->err_mode = UCP_ERR_HANDLING_MODE_PEER;
	ep->err_handler.cb = ep_err_cb;
	ep->err_handler.arg = e;
	ep->user_data = e;
	e->w = w;
	e->id = id;
	ucs_status_t st = p_ucp_ep_create(w->w, ep, &e->ep);
	if (st != UCS_OK) {
		free(e);
		return st;
	}
	*out = e;
	return UCS_OK;
}

int rdma_ep_connect(rdma_worker_t *w, uint64_t id, const uint8_t *ip, int iplen, int port, int send_id, rdma_ep_t **out)
{
	struct sockaddr_storage ss;
	socklen_t sl;
	if (make_sockaddr(ip, iplen, port, &ss, &sl) != 0) {
		return UCS_ERR_INVALID_PARAM;
	}
	ucp_ep_params_t ep;
	memset(&ep, 0, sizeof(ep));
	ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
	ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
	if (send_id) {
		ep.flags |= UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID; // the worker's client id, for an isolating listener
	}
	ep.sockaddr.addr = (struct sockaddr *)&ss;
	ep.sockaddr.addrlen = sl;
	return ep_create(w, id, &ep, out);
}

int rdma_ep_accept(rdma_worker_t *w, uint64_t id, uintptr_t req, rdma_ep_t **out)
{
	ucp_ep_params_t ep;
	memset(&ep, 0, sizeof(ep));
	ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
	ep.conn_request = (ucp_conn_request_h)req;
	return ep_create(w, id, &ep, out);
}

int rdma_ep_addrs(rdma_ep_t *e, uint8_t *lip, int *liplen, int *lport, uint8_t *rip, int *riplen, int *rport)
{
	ucp_ep_attr_t a;
	memset(&a, 0, sizeof(a));
	a.field_mask = UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR | UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR;
	ucs_status_t st = p_ucp_ep_query(e->ep, &a);
	if (st != UCS_OK) {
		return st;
	}
	split_sockaddr(&a.local_sockaddr, lip, liplen, lport);
	split_sockaddr(&a.remote_sockaddr, rip, riplen, rport);
	return UCS_OK;
}

int rdma_ep_close(rdma_worker_t *w, rdma_ep_t *e, uint64_t id, void **req)
{
	ucp_request_param_t rp;
	op_param(&rp, w);
	rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
	rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
	rdma_stream_release(e);
	int in = cuda_enter(&w->cu);
	int st = ret_req(p_ucp_ep_close_nbx(e->ep, &rp), id, req);
	cuda_leave(&w->cu, in);
	return st;
}

void rdma_ep_free(rdma_ep_t *e) { free(e); }

char *rdma_ep_info(rdma_ep_t *e, size_t *len)
{
	char *buf = NULL;
	FILE *f = open_memstream(&buf, len);
	if (f == NULL) {
		return NULL;
	}
	p_ucp_ep_print_info(e->ep, f);
	fclose(f);
	return buf;
}

int rdma_ep_flush(rdma_worker_t *w, rdma_ep_t *e, uint64_t id, void **req)
{
	ucp_request_param_t rp;
	op_param(&rp, w);
	int in = cuda_enter(&w->cu);
	int st = ret_req(p_ucp_ep_flush_nbx(e->ep, &rp), id, req);
	cuda_leave(&w->cu, in);
	return st;
}

// host_param is op_param for a send from gdrpc's own host memory. Without the memory
// type a UCX with memory-type detection (a CUDA-enabled build) looks every send's buffer
// up, and where its memory-type cache cannot tell it asks the CUDA driver.
static void host_param(ucp_request_param_t *rp, rdma_worker_t *w)
{
	op_param(rp, w);
	rp->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
	rp->memory_type = UCS_MEMORY_TYPE_HOST;
}

int rdma_ep_fin(rdma_worker_t *w, rdma_ep_t *e, int ack, uint64_t id, void **req)
{
	ucp_request_param_t rp;
	host_param(&rp, w);
	rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
	rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
	return ret_req(p_ucp_am_send_nbx(e->ep, ack ? RDMA_FINACK_AM_ID : RDMA_FIN_AM_ID, NULL, 0, NULL, 0, &rp), id, req);
}

int rdma_stream_send(rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, uint64_t id, void **req)
{
	ucp_request_param_t rp;
	host_param(&rp, w);
	return ret_req(p_ucp_stream_send_nbx(e->ep, (void *)buf, n, &rp), id, req);
}

size_t rdma_stream_read(rdma_ep_t *e, void *dst, size_t cap, int *more)
{
	size_t done = 0;
	*more = 0;
	while (done < cap) {
		if (e->cur == NULL) {
			size_t len = 0;
			ucs_status_ptr_t p = p_ucp_stream_recv_data_nb(e->ep, &len);
			if (p == NULL || UCS_PTR_IS_ERR(p)) {
				return done;
			}
			e->cur = p;
			e->cur_off = 0;
			e->cur_len = len;
		}
		size_t k = e->cur_len - e->cur_off;
		if (k > cap - done) {
			k = cap - done;
		}
		memcpy((char *)dst + done, (char *)e->cur + e->cur_off, k);
		done += k;
		e->cur_off += k;
		if (e->cur_off == e->cur_len) {
			p_ucp_stream_data_release(e->ep, e->cur);
			e->cur = NULL;
		}
	}
	// dst is full: more only if UCX holds more (kept in cur for the next read).
	if (e->cur == NULL) {
		size_t len = 0;
		ucs_status_ptr_t p = p_ucp_stream_recv_data_nb(e->ep, &len);
		if (p != NULL && !UCS_PTR_IS_ERR(p)) {
			e->cur = p;
			e->cur_off = 0;
			e->cur_len = len;
		}
	}
	*more = e->cur != NULL;
	return done;
}

void rdma_stream_release(rdma_ep_t *e)
{
	if (e->cur != NULL) {
		p_ucp_stream_data_release(e->ep, e->cur);
		e->cur = NULL;
	}
}

// rma_param adds what gdrpc knows of the local buffer, so UCX neither detects its memory
// type nor looks its registration up.
static void rma_param(ucp_request_param_t *rp, rdma_worker_t *w, int cuda, ucp_mem_h memh)
{
	op_param(rp, w);
	rp->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
	rp->memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
	if (memh != NULL) {
		rp->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
		rp->memh = memh;
	}
}

// rma runs a put or a get. A CUDA buffer needs the worker's context current: without it
// UCX would take the device pointer for host memory.
static int rma(int get, rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, int cuda, ucp_mem_h memh, uint64_t remote, ucp_rkey_h rkey, uint64_t id, void **req)
{
	ucp_request_param_t rp;
	rma_param(&rp, w, cuda, memh);
	int in = cuda_enter(&w->cu);
	if (cuda && in != 1) {
		cuda_leave(&w->cu, in);
		return UCS_ERR_UNSUPPORTED;
	}
	ucs_status_ptr_t sp = get ? p_ucp_get_nbx(e->ep, (void *)buf, n, remote, rkey, &rp)
	                          : p_ucp_put_nbx(e->ep, (void *)buf, n, remote, rkey, &rp);
	cuda_leave(&w->cu, in);
	return ret_req(sp, id, req);
}

int rdma_put(rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, int cuda, ucp_mem_h memh, uint64_t remote, ucp_rkey_h rkey, uint64_t id, void **req)
{
	return rma(0, w, e, buf, n, cuda, memh, remote, rkey, id, req);
}

int rdma_get(rdma_worker_t *w, rdma_ep_t *e, uintptr_t buf, size_t n, int cuda, ucp_mem_h memh, uint64_t remote, ucp_rkey_h rkey, uint64_t id, void **req)
{
	return rma(1, w, e, buf, n, cuda, memh, remote, rkey, id, req);
}

void rdma_request_free(void *req) { p_ucp_request_free(req); }

void rdma_request_cancel(rdma_worker_t *w, void *req)
{
	p_ucp_request_cancel(w->w, req);
}

// ---- memory --------------------------------------------------------------------

int rdma_mem_map(ucp_context_h ctx, const rdma_cuda_t *cu, uintptr_t addr, size_t n, int cuda, int alloc, ucp_mem_h *out, void **oaddr, size_t *olen)
{
	ucp_mem_map_params_t mp;
	memset(&mp, 0, sizeof(mp));
	mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
	                UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
	mp.address = (void *)addr;
	mp.length = n;
	mp.flags = alloc ? UCP_MEM_MAP_ALLOCATE : 0;
	mp.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
	int in = cuda_enter(cu);
	if (cuda && in != 1) {
		cuda_leave(cu, in);
		return UCS_ERR_UNSUPPORTED;
	}
	ucs_status_t st = p_ucp_mem_map(ctx, &mp, out);
	if (st == UCS_OK) {
		ucp_mem_attr_t a;
		memset(&a, 0, sizeof(a));
		a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
		st = p_ucp_mem_query(*out, &a);
		if (st != UCS_OK) {
			p_ucp_mem_unmap(ctx, *out);
		} else {
			*oaddr = a.address;
			*olen = a.length;
		}
	}
	cuda_leave(cu, in);
	return st;
}

int rdma_mem_unmap(ucp_context_h ctx, const rdma_cuda_t *cu, ucp_mem_h m)
{
	int in = cuda_enter(cu);
	int st = p_ucp_mem_unmap(ctx, m);
	cuda_leave(cu, in);
	return st;
}

int rdma_rkey_pack(ucp_context_h ctx, const rdma_cuda_t *cu, ucp_mem_h m, void **buf, size_t *len)
{
	int in = cuda_enter(cu);
	int st = p_ucp_rkey_pack(ctx, m, buf, len);
	cuda_leave(cu, in);
	return st;
}

void rdma_rkey_buffer_release(void *buf) { p_ucp_rkey_buffer_release(buf); }

int rdma_rkey_unpack(rdma_ep_t *e, const void *buf, ucp_rkey_h *out)
{
	int in = cuda_enter(&e->w->cu);
	int st = p_ucp_ep_rkey_unpack(e->ep, buf, out);
	cuda_leave(&e->w->cu, in);
	return st;
}

// rdma_rkey_ptr asks UCX for a pointer of this process to the peer's address raddr, which
// exists where the key names a shared-memory segment UCX attached when it unpacked the key.
int rdma_rkey_ptr(ucp_rkey_h k, uint64_t raddr, void **out)
{
	*out = NULL;
	return p_ucp_rkey_ptr(k, raddr, out);
}

void rdma_rkey_destroy(rdma_worker_t *w, ucp_rkey_h k)
{
	int in = cuda_enter(&w->cu);
	p_ucp_rkey_destroy(k);
	cuda_leave(&w->cu, in);
}
