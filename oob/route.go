package oob

import (
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// gpuDomains are the memory domains through which UCX moves GPU memory
// without the CPU: its cuda_ipc on one host, InfiniBand/RoCE verbs with
// GPUDirect RDMA across hosts.
var gpuDomains = map[string]bool{"cuda_ipc": true, "ib": true}

// gpuDirect reports whether GPU memory should go through UCX itself on ep: rc
// registers CUDA memory and a lane for large puts reaches a GPU domain. Over
// tcp UCX copies GPU memory through host memory piece by piece, slower than
// the staged path's pipelined copies into registered host buffers.
func gpuDirect(rc *rdma.Context, ep *rdma.Endpoint) bool {
	if !rc.CanMap(rdma.MemoryCUDA) {
		return false
	}
	domains, err := ep.RMADomains()
	if err != nil {
		return false
	}
	for _, d := range domains {
		if gpuDomains[d] {
			return true
		}
	}
	return false
}

// rmaOverTCPOnly reports whether every lane of ep for large puts is UCX's
// tcp transport (see tcpPutsBeatStream).
func rmaOverTCPOnly(ep *rdma.Endpoint) bool {
	domains, err := ep.RMADomains()
	if err != nil {
		return false
	}
	for _, d := range domains {
		if d != "tcp" {
			return false
		}
	}
	return true
}

// tcpPutsBeatStream reports whether, between two hosts, puts over UCX rc's tcp
// transport move bytes faster than the session's stream path on its bulk
// lane: from UCX 1.18 on they do, before they do not (the README's two-host
// rows).
func tcpPutsBeatStream(rc *rdma.Context) bool {
	return rc.Info().AtLeast(1, 18)
}

// streamFirst reports whether a transfer of n bytes on s takes the stream
// path rather than puts (into a destination or a receive space) where both
// would do: between two hosts whose UCX lanes for large puts are all tcp,
// always before UCX 1.18, and from 1.18 on for host memory on both ends that
// the session's wide lane carries (over the kernel's TCP it outran 1.18's tcp
// puts from 4 MiB on; GPU memory staged through those puts stayed ahead of
// the stream: the README's two-host rows).
func streamFirst(s *transport.Session, n uint64, host bool) bool {
	ep, rc := s.Endpoint(), s.RDMAContext()
	if s.PeerSameHost() || ep == nil || rc == nil || !rmaOverTCPOnly(ep) {
		return false
	}
	return !tcpPutsBeatStream(rc) || host && s.WideLaneFor(n)
}
