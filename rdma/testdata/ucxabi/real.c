// The checks evaluated under the real UCX headers, and every function and callback
// signature of rdma/ucxabi_funcs.h compared with the real one at compile time.
#include <ucp/api/ucp.h>

#include "checks.h"
#include "entry.h"
#include "ucxabi_funcs.h"

UCXABI_TABLE(ucxabi_real);

#define CHECK_FUNC(ret, name, args)                                      \
	_Static_assert(__builtin_types_compatible_p(__typeof__(&name), ret(*) args), \
	               "ucxabi_funcs.h: signature of " #name " differs from ucp.h");
UCXABI_FUNCS(CHECK_FUNC)

#define CHECK_CALLBACK(ret, name, args)                            \
	_Static_assert(__builtin_types_compatible_p(name, ret(*) args), \
	               "ucxabi_funcs.h: callback type " #name " differs from ucp.h");
UCXABI_CALLBACKS(CHECK_CALLBACK)
