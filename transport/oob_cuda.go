package transport

import (
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
)

// useCUDA lets rc register and move CUDA memory where both the loaded UCX and
// the CUDA driver can: UCX calls that may touch CUDA memory then run with a
// CUDA context current on the calling thread. Elsewhere rc keeps refusing CUDA
// memory, and GPU payloads take another path (cuda-ipc, staged, stream).
func useCUDA(rc *rdma.Context) {
	if rc == nil || rc.CanMap(rdma.MemoryCUDA) || !rc.Info().HasMemoryType(rdma.MemoryCUDA) {
		return
	}
	t, err := devicebuf.CUDAThreadContexts()
	if err != nil {
		return
	}
	if err := rc.UseCUDA(t, 0); err != nil {
		cfg().Logger.Warn("UCX supports CUDA memory but cannot use this process's CUDA contexts", "err", err)
	}
}

// canRegister reports whether rc can register memory of type mt now.
func canRegister(rc *rdma.Context, mt rdma.MemoryType) bool { return rc.CanMap(mt) }
