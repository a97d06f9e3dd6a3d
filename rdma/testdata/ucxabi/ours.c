// The checks evaluated under gdrpc's own declarations (rdma/ucxabi.h).
#include "ucxabi.h"

#include "checks.h"
#include "entry.h"

UCXABI_TABLE(ucxabi_ours);
