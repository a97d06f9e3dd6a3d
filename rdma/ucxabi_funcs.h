// The UCX functions ucx.c looks up in libucp.so.0 and the callback types it hands to UCX,
// with their signatures as documented in ucp/api/ucp.h (API 1.13).
//
// UCXABI_FUNCS(X) calls X(return type, name, parameter list) once per function; ucx.c turns
// each into a function pointer and a dlsym. UCXABI_CALLBACKS(X) does the same per callback
// type; ucxabi.h turns each into a function pointer typedef.
//
// This file names types but declares none, so the ABI test can expand the same lists under
// the real UCX headers and compare each signature with the real one.
#ifndef GDRPC_RDMA_UCXABI_FUNCS_H
#define GDRPC_RDMA_UCXABI_FUNCS_H

#define UCXABI_CALLBACKS(X)                                                                        \
	X(void, ucp_request_init_callback_t, (void *request))                                          \
	X(void, ucp_request_cleanup_callback_t, (void *request))                                       \
	X(ucs_status_t, ucp_am_recv_callback_t,                                                        \
	  (void *arg, const void *header, size_t header_length, void *data, size_t length,             \
	   const ucp_am_recv_param_t *param))                                                          \
	X(void, ucp_send_nbx_callback_t, (void *request, ucs_status_t status, void *user_data))        \
	X(void, ucp_listener_accept_callback_t, (ucp_ep_h ep, void *arg))                              \
	X(void, ucp_listener_conn_callback_t, (ucp_conn_request_h conn_request, void *arg))            \
	X(void, ucp_err_handler_cb_t, (void *arg, ucp_ep_h ep, ucs_status_t status))

#define UCXABI_FUNCS(X)                                                                            \
	X(ucs_status_t, ucp_config_read,                                                               \
	  (const char *env_prefix, const char *filename, ucp_config_t **config_p))                     \
	X(ucs_status_t, ucp_config_modify, (ucp_config_t * config, const char *name, const char *value)) \
	X(void, ucp_config_release, (ucp_config_t * config))                                           \
	X(ucs_status_t, ucp_init_version,                                                              \
	  (unsigned api_major_version, unsigned api_minor_version, const ucp_params_t *params,        \
	   const ucp_config_t *config, ucp_context_h *context_p))                                      \
	X(void, ucp_cleanup, (ucp_context_h context_p))                                                \
	X(ucs_status_t, ucp_context_query, (ucp_context_h context_p, ucp_context_attr_t * attr))       \
	X(void, ucp_context_print_info, (const ucp_context_h context, FILE *stream))                   \
	X(const char *, ucp_get_version_string, (void))                                                \
	X(ucs_status_t, ucp_worker_create,                                                             \
	  (ucp_context_h context, const ucp_worker_params_t *params, ucp_worker_h *worker_p))          \
	X(void, ucp_worker_destroy, (ucp_worker_h worker))                                             \
	X(unsigned, ucp_worker_progress, (ucp_worker_h worker))                                        \
	X(ucs_status_t, ucp_worker_get_efd, (ucp_worker_h worker, int *fd))                            \
	X(ucs_status_t, ucp_worker_arm, (ucp_worker_h worker))                                         \
	X(ucs_status_t, ucp_worker_signal, (ucp_worker_h worker))                                      \
	X(ucs_status_ptr_t, ucp_worker_flush_nbx, (ucp_worker_h worker, const ucp_request_param_t *param)) \
	X(ucs_status_t, ucp_worker_set_am_recv_handler,                                                \
	  (ucp_worker_h worker, const ucp_am_handler_param_t *param))                                  \
	X(ucs_status_t, ucp_listener_create,                                                           \
	  (ucp_worker_h worker, const ucp_listener_params_t *params, ucp_listener_h *listener_p))      \
	X(void, ucp_listener_destroy, (ucp_listener_h listener))                                       \
	X(ucs_status_t, ucp_listener_query, (ucp_listener_h listener, ucp_listener_attr_t * attr))     \
	X(ucs_status_t, ucp_listener_reject, (ucp_listener_h listener, ucp_conn_request_h conn_request)) \
	X(ucs_status_t, ucp_conn_request_query,                                                        \
	  (ucp_conn_request_h conn_request, ucp_conn_request_attr_t * attr))                           \
	X(ucs_status_t, ucp_ep_create,                                                                 \
	  (ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p))                        \
	X(ucs_status_ptr_t, ucp_ep_close_nbx, (ucp_ep_h ep, const ucp_request_param_t *param))         \
	X(ucs_status_t, ucp_ep_query, (ucp_ep_h ep, ucp_ep_attr_t * attr))                             \
	X(void, ucp_ep_print_info, (ucp_ep_h ep, FILE *stream))                                        \
	X(ucs_status_ptr_t, ucp_ep_flush_nbx, (ucp_ep_h ep, const ucp_request_param_t *param))         \
	X(ucs_status_ptr_t, ucp_stream_send_nbx,                                                       \
	  (ucp_ep_h ep, const void *buffer, size_t count, const ucp_request_param_t *param))          \
	X(ssize_t, ucp_stream_worker_poll,                                                             \
	  (ucp_worker_h worker, ucp_stream_poll_ep_t * poll_eps, size_t max_eps, unsigned flags))      \
	X(ucs_status_ptr_t, ucp_stream_recv_data_nb, (ucp_ep_h ep, size_t * length))                   \
	X(void, ucp_stream_data_release, (ucp_ep_h ep, void *data))                                    \
	X(ucs_status_ptr_t, ucp_am_send_nbx,                                                           \
	  (ucp_ep_h ep, unsigned id, const void *header, size_t header_length, const void *buffer,    \
	   size_t count, const ucp_request_param_t *param))                                            \
	X(ucs_status_t, ucp_mem_map,                                                                   \
	  (ucp_context_h context, const ucp_mem_map_params_t *params, ucp_mem_h *memh_p))              \
	X(ucs_status_t, ucp_mem_unmap, (ucp_context_h context, ucp_mem_h memh))                        \
	X(ucs_status_t, ucp_mem_query, (const ucp_mem_h memh, ucp_mem_attr_t *attr))                   \
	X(ucs_status_t, ucp_rkey_pack,                                                                 \
	  (ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p, size_t *size_p))               \
	X(void, ucp_rkey_buffer_release, (void *rkey_buffer))                                          \
	X(ucs_status_t, ucp_ep_rkey_unpack, (ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p)) \
	X(void, ucp_rkey_destroy, (ucp_rkey_h rkey))                                                   \
	X(ucs_status_t, ucp_rkey_ptr, (ucp_rkey_h rkey, uint64_t raddr, void **addr_p))               \
	X(ucs_status_ptr_t, ucp_put_nbx,                                                               \
	  (ucp_ep_h ep, const void *buffer, size_t count, uint64_t remote_addr, ucp_rkey_h rkey,      \
	   const ucp_request_param_t *param))                                                          \
	X(ucs_status_ptr_t, ucp_get_nbx,                                                               \
	  (ucp_ep_h ep, void *buffer, size_t count, uint64_t remote_addr, ucp_rkey_h rkey,            \
	   const ucp_request_param_t *param))                                                          \
	X(void, ucp_request_free, (void *request))                                                     \
	X(void, ucp_request_cancel, (ucp_worker_h worker, void *request))                              \
	X(const char *, ucs_status_string, (ucs_status_t status))

#endif
