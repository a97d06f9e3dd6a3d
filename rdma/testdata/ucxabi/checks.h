// Every size, offset and constant rdma/ucxabi.h declares. ours.c evaluates the list under
// ucxabi.h, real.c under the UCX headers, and main.c compares the two tables.
//
//   SIZE(T)        sizeof(T), equal in both.
//   VSIZE(T)       sizeof a field_mask-versioned struct: equal when both declare the same
//                  API version, else ours no larger (UCX structs grow only at their end).
//   OPAQUE(T)      an incomplete type: only its name is checked.
//   FIELD(T, m)    offsetof and sizeof of member m, equal in both.
//   CONST(c)       the value of a constant or constant expression, equal in both.
//   ATMOST(c)      ours no larger than the real value (the API version declared).
//
// TestUCXABIComplete fails when ucxabi.h declares something this list does not check.
#define UCXABI_CHECKS(SIZE, VSIZE, OPAQUE, FIELD, CONST, ATMOST)                   \
	CONST(UCP_API_MAJOR)                                                         \
	ATMOST(UCP_API_MINOR)                                                        \
	/* ucs */                                                                    \
	SIZE(ucs_status_t)                                                           \
	CONST((long long)(ucs_status_t)UCS_ERR_LAST)                                 \
	CONST(UCS_OK)                                                                \
	CONST(UCS_INPROGRESS)                                                        \
	CONST(UCS_ERR_NO_MEMORY)                                                     \
	CONST(UCS_ERR_INVALID_PARAM)                                                 \
	CONST(UCS_ERR_UNSUPPORTED)                                                   \
	CONST(UCS_ERR_LAST)                                                          \
	SIZE(ucs_status_ptr_t)                                                       \
	CONST(UCS_PTR_IS_ERR((void *)(intptr_t)UCS_ERR_NO_MEMORY))                   \
	CONST(UCS_PTR_IS_ERR((void *)(intptr_t)UCS_ERR_LAST))                        \
	CONST(UCS_PTR_IS_ERR((void *)(uintptr_t)4096))                               \
	CONST(UCS_PTR_IS_ERR((void *)0))                                             \
	CONST(UCS_PTR_STATUS((void *)(intptr_t)UCS_ERR_UNSUPPORTED))                 \
	SIZE(ucs_memory_type_t)                                                      \
	CONST(UCS_MEMORY_TYPE_HOST)                                                  \
	CONST(UCS_MEMORY_TYPE_CUDA)                                                  \
	SIZE(ucs_thread_mode_t)                                                      \
	CONST(UCS_THREAD_MODE_SINGLE)                                                \
	CONST(UCS_THREAD_MODE_SERIALIZED)                                            \
	CONST(UCS_THREAD_MODE_MULTI)                                                 \
	SIZE(ucs_sock_addr_t)                                                        \
	FIELD(ucs_sock_addr_t, addr)                                                 \
	FIELD(ucs_sock_addr_t, addrlen)                                              \
	SIZE(ucs_cpu_set_t)                                                          \
	FIELD(ucs_cpu_set_t, ucs_bits)                                               \
	/* handles */                                                                \
	OPAQUE(ucp_config_t)                                                         \
	OPAQUE(ucp_address_t)                                                        \
	SIZE(ucp_context_h)                                                          \
	SIZE(ucp_worker_h)                                                           \
	SIZE(ucp_ep_h)                                                               \
	SIZE(ucp_listener_h)                                                         \
	SIZE(ucp_conn_request_h)                                                     \
	SIZE(ucp_mem_h)                                                              \
	SIZE(ucp_rkey_h)                                                             \
	SIZE(ucp_datatype_t)                                                         \
	/* context */                                                                \
	CONST(UCP_PARAM_FIELD_FEATURES)                                              \
	CONST(UCP_PARAM_FIELD_REQUEST_SIZE)                                          \
	CONST(UCP_PARAM_FIELD_MT_WORKERS_SHARED)                                     \
	CONST(UCP_PARAM_FIELD_NAME)                                                  \
	CONST(UCP_FEATURE_RMA)                                                       \
	CONST(UCP_FEATURE_WAKEUP)                                                    \
	CONST(UCP_FEATURE_STREAM)                                                    \
	CONST(UCP_FEATURE_AM)                                                        \
	VSIZE(ucp_params_t)                                                          \
	FIELD(ucp_params_t, field_mask)                                              \
	FIELD(ucp_params_t, features)                                                \
	FIELD(ucp_params_t, request_size)                                            \
	FIELD(ucp_params_t, request_init)                                            \
	FIELD(ucp_params_t, request_cleanup)                                         \
	FIELD(ucp_params_t, tag_sender_mask)                                         \
	FIELD(ucp_params_t, mt_workers_shared)                                       \
	FIELD(ucp_params_t, estimated_num_eps)                                       \
	FIELD(ucp_params_t, estimated_num_ppn)                                       \
	FIELD(ucp_params_t, name)                                                    \
	CONST(UCP_ATTR_FIELD_MEMORY_TYPES)                                           \
	CONST(UCP_ENTITY_NAME_MAX)                                                   \
	VSIZE(ucp_context_attr_t)                                                    \
	FIELD(ucp_context_attr_t, field_mask)                                        \
	FIELD(ucp_context_attr_t, request_size)                                      \
	FIELD(ucp_context_attr_t, thread_mode)                                       \
	FIELD(ucp_context_attr_t, memory_types)                                      \
	FIELD(ucp_context_attr_t, name)                                              \
	/* worker */                                                                 \
	CONST(UCP_WORKER_PARAM_FIELD_THREAD_MODE)                                    \
	CONST(UCP_WORKER_PARAM_FIELD_CLIENT_ID)                                      \
	VSIZE(ucp_worker_params_t)                                                   \
	FIELD(ucp_worker_params_t, field_mask)                                       \
	FIELD(ucp_worker_params_t, thread_mode)                                      \
	FIELD(ucp_worker_params_t, cpu_mask)                                         \
	FIELD(ucp_worker_params_t, events)                                           \
	FIELD(ucp_worker_params_t, user_data)                                        \
	FIELD(ucp_worker_params_t, event_fd)                                         \
	FIELD(ucp_worker_params_t, flags)                                            \
	FIELD(ucp_worker_params_t, name)                                             \
	FIELD(ucp_worker_params_t, am_alignment)                                     \
	FIELD(ucp_worker_params_t, client_id)                                        \
	/* active messages */                                                        \
	CONST(UCP_AM_HANDLER_PARAM_FIELD_ID)                                         \
	CONST(UCP_AM_HANDLER_PARAM_FIELD_CB)                                         \
	CONST(UCP_AM_HANDLER_PARAM_FIELD_ARG)                                        \
	CONST(UCP_AM_RECV_ATTR_FIELD_REPLY_EP)                                       \
	CONST(UCP_AM_SEND_FLAG_REPLY)                                                \
	CONST(UCP_AM_SEND_FLAG_EAGER)                                                \
	VSIZE(ucp_am_recv_param_t)                                                   \
	FIELD(struct ucp_am_recv_param, recv_attr)                                   \
	FIELD(struct ucp_am_recv_param, reply_ep)                                    \
	VSIZE(ucp_am_handler_param_t)                                                \
	FIELD(ucp_am_handler_param_t, field_mask)                                    \
	FIELD(ucp_am_handler_param_t, id)                                            \
	FIELD(ucp_am_handler_param_t, flags)                                         \
	FIELD(ucp_am_handler_param_t, cb)                                            \
	FIELD(ucp_am_handler_param_t, arg)                                           \
	/* operations */                                                             \
	CONST(UCP_OP_ATTR_FIELD_CALLBACK)                                            \
	CONST(UCP_OP_ATTR_FIELD_USER_DATA)                                           \
	CONST(UCP_OP_ATTR_FIELD_FLAGS)                                               \
	CONST(UCP_OP_ATTR_FIELD_MEMORY_TYPE)                                         \
	CONST(UCP_OP_ATTR_FIELD_MEMH)                                                \
	VSIZE(ucp_request_param_t)                                                   \
	FIELD(ucp_request_param_t, op_attr_mask)                                     \
	FIELD(ucp_request_param_t, flags)                                            \
	FIELD(ucp_request_param_t, request)                                          \
	FIELD(ucp_request_param_t, cb)                                               \
	FIELD(ucp_request_param_t, cb.send)                                          \
	FIELD(ucp_request_param_t, datatype)                                         \
	FIELD(ucp_request_param_t, user_data)                                        \
	FIELD(ucp_request_param_t, reply_buffer)                                     \
	FIELD(ucp_request_param_t, memory_type)                                      \
	FIELD(ucp_request_param_t, recv_info)                                        \
	FIELD(ucp_request_param_t, recv_info.length)                                 \
	FIELD(ucp_request_param_t, memh)                                             \
	SIZE(ucp_stream_poll_ep_t)                                                   \
	FIELD(ucp_stream_poll_ep_t, ep)                                              \
	FIELD(ucp_stream_poll_ep_t, user_data)                                       \
	FIELD(ucp_stream_poll_ep_t, flags)                                           \
	FIELD(ucp_stream_poll_ep_t, reserved)                                        \
	/* listener */                                                               \
	CONST(UCP_LISTENER_PARAM_FIELD_SOCK_ADDR)                                    \
	CONST(UCP_LISTENER_PARAM_FIELD_CONN_HANDLER)                                 \
	CONST(UCP_LISTENER_ATTR_FIELD_SOCKADDR)                                      \
	CONST(UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR)                               \
	CONST(UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID)                                 \
	SIZE(ucp_listener_accept_handler_t)                                          \
	FIELD(ucp_listener_accept_handler_t, cb)                                     \
	FIELD(ucp_listener_accept_handler_t, arg)                                    \
	SIZE(ucp_listener_conn_handler_t)                                            \
	FIELD(ucp_listener_conn_handler_t, cb)                                       \
	FIELD(ucp_listener_conn_handler_t, arg)                                      \
	VSIZE(ucp_listener_params_t)                                                 \
	FIELD(ucp_listener_params_t, field_mask)                                     \
	FIELD(ucp_listener_params_t, sockaddr)                                       \
	FIELD(ucp_listener_params_t, accept_handler)                                 \
	FIELD(ucp_listener_params_t, conn_handler)                                   \
	VSIZE(ucp_listener_attr_t)                                                   \
	FIELD(ucp_listener_attr_t, field_mask)                                       \
	FIELD(ucp_listener_attr_t, sockaddr)                                         \
	VSIZE(ucp_conn_request_attr_t)                                               \
	FIELD(ucp_conn_request_attr_t, field_mask)                                   \
	FIELD(ucp_conn_request_attr_t, client_address)                               \
	FIELD(ucp_conn_request_attr_t, client_id)                                    \
	/* endpoints */                                                              \
	CONST(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)                                  \
	CONST(UCP_EP_PARAM_FIELD_ERR_HANDLER)                                        \
	CONST(UCP_EP_PARAM_FIELD_USER_DATA)                                          \
	CONST(UCP_EP_PARAM_FIELD_SOCK_ADDR)                                          \
	CONST(UCP_EP_PARAM_FIELD_FLAGS)                                              \
	CONST(UCP_EP_PARAM_FIELD_CONN_REQUEST)                                       \
	CONST(UCP_EP_PARAMS_FLAGS_CLIENT_SERVER)                                     \
	CONST(UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID)                                    \
	SIZE(ucp_err_handling_mode_t)                                                \
	CONST(UCP_ERR_HANDLING_MODE_NONE)                                            \
	CONST(UCP_ERR_HANDLING_MODE_PEER)                                            \
	SIZE(ucp_err_handler_t)                                                      \
	FIELD(ucp_err_handler_t, cb)                                                 \
	FIELD(ucp_err_handler_t, arg)                                                \
	VSIZE(ucp_ep_params_t)                                                       \
	FIELD(ucp_ep_params_t, field_mask)                                           \
	FIELD(ucp_ep_params_t, address)                                              \
	FIELD(ucp_ep_params_t, err_mode)                                             \
	FIELD(ucp_ep_params_t, err_handler)                                          \
	FIELD(ucp_ep_params_t, user_data)                                            \
	FIELD(ucp_ep_params_t, flags)                                                \
	FIELD(ucp_ep_params_t, sockaddr)                                             \
	FIELD(ucp_ep_params_t, conn_request)                                         \
	FIELD(ucp_ep_params_t, name)                                                 \
	FIELD(ucp_ep_params_t, local_sockaddr)                                       \
	CONST(UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR)                                      \
	CONST(UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR)                                     \
	VSIZE(ucp_ep_attr_t)                                                         \
	FIELD(ucp_ep_attr_t, field_mask)                                             \
	FIELD(ucp_ep_attr_t, name)                                                   \
	FIELD(ucp_ep_attr_t, local_sockaddr)                                         \
	FIELD(ucp_ep_attr_t, remote_sockaddr)                                        \
	CONST(UCP_EP_CLOSE_FLAG_FORCE)                                               \
	/* memory */                                                                 \
	CONST(UCP_MEM_MAP_PARAM_FIELD_ADDRESS)                                       \
	CONST(UCP_MEM_MAP_PARAM_FIELD_LENGTH)                                        \
	CONST(UCP_MEM_MAP_PARAM_FIELD_FLAGS)                                         \
	CONST(UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)                                   \
	CONST(UCP_MEM_MAP_ALLOCATE)                                                  \
	VSIZE(ucp_mem_map_params_t)                                                  \
	FIELD(ucp_mem_map_params_t, field_mask)                                      \
	FIELD(ucp_mem_map_params_t, address)                                         \
	FIELD(ucp_mem_map_params_t, length)                                          \
	FIELD(ucp_mem_map_params_t, flags)                                           \
	FIELD(ucp_mem_map_params_t, prot)                                            \
	FIELD(ucp_mem_map_params_t, memory_type)                                     \
	CONST(UCP_MEM_ATTR_FIELD_ADDRESS)                                            \
	CONST(UCP_MEM_ATTR_FIELD_LENGTH)                                             \
	VSIZE(ucp_mem_attr_t)                                                        \
	FIELD(ucp_mem_attr_t, field_mask)                                            \
	FIELD(ucp_mem_attr_t, address)                                               \
	FIELD(ucp_mem_attr_t, length)                                                \
	FIELD(ucp_mem_attr_t, mem_type)
