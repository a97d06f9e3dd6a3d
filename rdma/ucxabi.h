// The part of the UCX (UCP/UCS) ABI that ucx.c calls, declared here so the package builds
// without the UCX development headers: libucp.so.0 is opened at run time, nothing links
// against it.
//
// Names, values and layouts follow the UCX API documentation (ucp/api/ucp.h,
// ucp/api/ucp_def.h, ucs/type/status.h, ucs/type/thread_mode.h, ucs/memory/memory_type.h,
// ucs/config/types.h, ucs/type/cpu_set.h) at API version 1.13. libucp.so.0 keeps that ABI
// in later releases: parameter and attribute structs only grow at their end, and UCX reads
// or writes a field only when its bit is set in the struct's field_mask (op_attr_mask,
// recv_attr). So every struct below is the complete 1.13 layout, callers zero it before
// use, and they set a field only together with its mask bit.
//
// Handles stay opaque pointers. Only what ucx.c uses is declared, plus the members of the
// structs it uses that it never sets, to keep their layout. Function and callback
// signatures are listed in ucxabi_funcs.h.
//
// testdata/ucxabi checks every size, offset, constant and function signature here against
// the real headers (TestUCXABI).
#ifndef GDRPC_RDMA_UCXABI_H
#define GDRPC_RDMA_UCXABI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/types.h>

// The API version these declarations follow, passed to ucp_init_version.
#define UCP_API_MAJOR 1
#define UCP_API_MINOR 13

// ---- ucs: status codes, memory and thread modes ---------------------------

// ucs_status_t is a packed (one byte, signed) enum: functions return it in a byte.
typedef enum {
	UCS_OK = 0,
	UCS_INPROGRESS = 1,
	UCS_ERR_NO_MEMORY = -4,
	UCS_ERR_INVALID_PARAM = -5,
	UCS_ERR_UNSUPPORTED = -22,
	UCS_ERR_LAST = -100,
} __attribute__((packed)) ucs_status_t;

// A request pointer, NULL for immediate success, or a status cast to a pointer.
typedef void *ucs_status_ptr_t;

#define UCS_PTR_IS_ERR(_ptr) (((uintptr_t)(_ptr)) >= ((uintptr_t)UCS_ERR_LAST))
#define UCS_PTR_STATUS(_ptr) ((ucs_status_t)(intptr_t)(_ptr))

typedef enum {
	UCS_MEMORY_TYPE_HOST = 0,
	UCS_MEMORY_TYPE_CUDA = 1,
} ucs_memory_type_t;

typedef enum {
	UCS_THREAD_MODE_SINGLE = 0,
	UCS_THREAD_MODE_SERIALIZED = 1,
	UCS_THREAD_MODE_MULTI = 2,
} ucs_thread_mode_t;

typedef struct ucs_sock_addr {
	const struct sockaddr *addr;
	socklen_t addrlen;
} ucs_sock_addr_t;

// A CPU set of 1024 bits, in unsigned longs.
typedef struct {
	unsigned long ucs_bits[1024 / (8 * sizeof(unsigned long))];
} ucs_cpu_set_t;

// ---- opaque handles ---------------------------------------------------------

typedef struct ucp_config ucp_config_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_listener *ucp_listener_h;
typedef struct ucp_conn_request *ucp_conn_request_h;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;
typedef struct ucp_address ucp_address_t;
typedef uint64_t ucp_datatype_t;

// ---- callbacks ------------------------------------------------------------------

#include "ucxabi_funcs.h"

typedef struct ucp_am_recv_param ucp_am_recv_param_t;

#define UCXABI_CALLBACK_TYPEDEF(ret, name, args) typedef ret(*name) args;
UCXABI_CALLBACKS(UCXABI_CALLBACK_TYPEDEF)
#undef UCXABI_CALLBACK_TYPEDEF

// ---- context ------------------------------------------------------------------

enum {
	UCP_PARAM_FIELD_FEATURES = 1u << 0,
	UCP_PARAM_FIELD_REQUEST_SIZE = 1u << 1,
	UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1u << 5,
	UCP_PARAM_FIELD_NAME = 1u << 8,
};

enum {
	UCP_FEATURE_RMA = 1u << 1,
	UCP_FEATURE_WAKEUP = 1u << 4,
	UCP_FEATURE_STREAM = 1u << 5,
	UCP_FEATURE_AM = 1u << 6,
};

typedef struct ucp_params {
	uint64_t field_mask;
	uint64_t features;
	size_t request_size;
	ucp_request_init_callback_t request_init;
	ucp_request_cleanup_callback_t request_cleanup;
	uint64_t tag_sender_mask;
	int mt_workers_shared;
	size_t estimated_num_eps;
	size_t estimated_num_ppn;
	const char *name;
} ucp_params_t;

enum {
	UCP_ATTR_FIELD_MEMORY_TYPES = 1u << 2,
};

#define UCP_ENTITY_NAME_MAX 32

typedef struct ucp_context_attr {
	uint64_t field_mask;
	size_t request_size;
	ucs_thread_mode_t thread_mode;
	uint64_t memory_types; // bit (1 << ucs_memory_type_t) per registrable type
	char name[UCP_ENTITY_NAME_MAX];
} ucp_context_attr_t;

// ---- worker -------------------------------------------------------------------

enum {
	UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1u << 0,
	UCP_WORKER_PARAM_FIELD_CLIENT_ID = 1u << 8,
};

typedef struct ucp_worker_params {
	uint64_t field_mask;
	ucs_thread_mode_t thread_mode;
	ucs_cpu_set_t cpu_mask;
	unsigned events;
	void *user_data;
	int event_fd;
	uint64_t flags;
	const char *name;
	size_t am_alignment;
	uint64_t client_id;
} ucp_worker_params_t;

// ---- active messages ----------------------------------------------------------

enum {
	UCP_AM_HANDLER_PARAM_FIELD_ID = 1u << 0,
	UCP_AM_HANDLER_PARAM_FIELD_CB = 1u << 2,
	UCP_AM_HANDLER_PARAM_FIELD_ARG = 1u << 3,
};

enum {
	UCP_AM_RECV_ATTR_FIELD_REPLY_EP = 1u << 0,
};

enum {
	UCP_AM_SEND_FLAG_REPLY = 1u << 0,
	UCP_AM_SEND_FLAG_EAGER = 1u << 1,
};

// What UCX tells an active message handler; recv_attr says which fields are valid.
struct ucp_am_recv_param {
	uint64_t recv_attr;
	ucp_ep_h reply_ep;
};

typedef struct ucp_am_handler_param {
	uint64_t field_mask;
	unsigned id;
	uint32_t flags;
	ucp_am_recv_callback_t cb;
	void *arg;
} ucp_am_handler_param_t;

// ---- operations ---------------------------------------------------------------

enum {
	UCP_OP_ATTR_FIELD_CALLBACK = 1u << 1,
	UCP_OP_ATTR_FIELD_USER_DATA = 1u << 2,
	UCP_OP_ATTR_FIELD_FLAGS = 1u << 4,
	UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1u << 6,
	UCP_OP_ATTR_FIELD_MEMH = 1u << 8,
};

// Arguments common to the *_nbx calls. Only cb.send of the callbacks is declared: the
// union's other members are function pointers of the same size.
typedef struct {
	uint32_t op_attr_mask;
	uint32_t flags;
	void *request;
	union {
		ucp_send_nbx_callback_t send;
	} cb;
	ucp_datatype_t datatype;
	void *user_data;
	void *reply_buffer;
	ucs_memory_type_t memory_type;
	union {
		size_t *length;
	} recv_info;
	ucp_mem_h memh;
} ucp_request_param_t;

// One endpoint with stream data, as ucp_stream_worker_poll fills an array of them: its
// size is fixed, not versioned.
typedef struct ucp_stream_poll_ep {
	ucp_ep_h ep;
	void *user_data;
	unsigned flags;
	uint8_t reserved[16];
} ucp_stream_poll_ep_t;

// ---- listener -----------------------------------------------------------------

enum {
	UCP_LISTENER_PARAM_FIELD_SOCK_ADDR = 1u << 0,
	UCP_LISTENER_PARAM_FIELD_CONN_HANDLER = 1u << 2,
};

enum {
	UCP_LISTENER_ATTR_FIELD_SOCKADDR = 1u << 0,
};

enum {
	UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR = 1u << 0,
	UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID = 1u << 1,
};

typedef struct ucp_listener_accept_handler {
	ucp_listener_accept_callback_t cb;
	void *arg;
} ucp_listener_accept_handler_t;

typedef struct ucp_listener_conn_handler {
	ucp_listener_conn_callback_t cb;
	void *arg;
} ucp_listener_conn_handler_t;

typedef struct ucp_listener_params {
	uint64_t field_mask;
	ucs_sock_addr_t sockaddr;
	ucp_listener_accept_handler_t accept_handler;
	ucp_listener_conn_handler_t conn_handler;
} ucp_listener_params_t;

typedef struct ucp_listener_attr {
	uint64_t field_mask;
	struct sockaddr_storage sockaddr;
} ucp_listener_attr_t;

typedef struct ucp_conn_request_attr {
	uint64_t field_mask;
	struct sockaddr_storage client_address;
	uint64_t client_id;
} ucp_conn_request_attr_t;

// ---- endpoints ----------------------------------------------------------------

enum {
	UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1u << 1,
	UCP_EP_PARAM_FIELD_ERR_HANDLER = 1u << 2,
	UCP_EP_PARAM_FIELD_USER_DATA = 1u << 3,
	UCP_EP_PARAM_FIELD_SOCK_ADDR = 1u << 4,
	UCP_EP_PARAM_FIELD_FLAGS = 1u << 5,
	UCP_EP_PARAM_FIELD_CONN_REQUEST = 1u << 6,
};

enum {
	UCP_EP_PARAMS_FLAGS_CLIENT_SERVER = 1u << 0,
	UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID = 1u << 2,
};

typedef enum {
	UCP_ERR_HANDLING_MODE_NONE = 0,
	UCP_ERR_HANDLING_MODE_PEER = 1,
} ucp_err_handling_mode_t;

typedef struct ucp_err_handler {
	ucp_err_handler_cb_t cb;
	void *arg;
} ucp_err_handler_t;

typedef struct ucp_ep_params {
	uint64_t field_mask;
	const ucp_address_t *address;
	ucp_err_handling_mode_t err_mode;
	ucp_err_handler_t err_handler;
	void *user_data;
	unsigned flags;
	ucs_sock_addr_t sockaddr;
	ucp_conn_request_h conn_request;
	const char *name;
	ucs_sock_addr_t local_sockaddr;
} ucp_ep_params_t;

enum {
	UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR = 1u << 1,
	UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR = 1u << 2,
};

typedef struct ucp_ep_attr {
	uint64_t field_mask;
	char name[UCP_ENTITY_NAME_MAX];
	struct sockaddr_storage local_sockaddr;
	struct sockaddr_storage remote_sockaddr;
} ucp_ep_attr_t;

enum {
	UCP_EP_CLOSE_FLAG_FORCE = 1u << 0,
};

// ---- memory -------------------------------------------------------------------

enum {
	UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1u << 0,
	UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1u << 1,
	UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1u << 2,
	UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1u << 4,
};

enum {
	UCP_MEM_MAP_ALLOCATE = 1u << 1,
};

typedef struct ucp_mem_map_params {
	uint64_t field_mask;
	void *address;
	size_t length;
	unsigned flags;
	unsigned prot;
	ucs_memory_type_t memory_type;
} ucp_mem_map_params_t;

enum {
	UCP_MEM_ATTR_FIELD_ADDRESS = 1u << 0,
	UCP_MEM_ATTR_FIELD_LENGTH = 1u << 1,
};

typedef struct ucp_mem_attr {
	uint64_t field_mask;
	void *address;
	size_t length;
	ucs_memory_type_t mem_type;
} ucp_mem_attr_t;

#endif
