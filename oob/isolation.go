package oob

import (
	"context"
	"fmt"
	"runtime/trace"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// What a peer of an out-of-band transfer may reach, on both sides.
//
// Receiver: a destination is exposed for its transfer alone (registered by
// itself unless the peer is trusted), it is cleared before it is offered to a path on
// which its arrival cannot be counted (rdma, staged, cuda-ipc), and a FIN is
// accepted only for a path the RTR offered. Owner: it writes exactly its
// source's length at the RTR's address, only through transports where the
// receiver's side applies the write (unless the peer is trusted), and it reports a
// failure only once none of its writes can still land.

// receiverApplied are the kinds of memory domains on which the receiver's
// side applies a put: its UCX copies what arrives over TCP, its NIC checks
// the key over verbs. A forged key can then steer the write only within the
// forger's own process. On the others (posix, sysv, xpmem, cma, knem,
// cuda_ipc) the writer maps or addresses the target itself, wherever the key
// says, and UCX checks no bounds.
var receiverApplied = map[string]bool{"tcp": true, "ib": true}

// exposeDestination registers target for a peer's puts: the pool region it
// lies in when peers are trusted (the region's key is reused across
// transfers), else target alone for this transfer.
func exposeDestination(rc *rdma.Context, target *devicebuf.Buffer, trusted bool) (*rdma.Memory, int, func(), error) {
	if trusted {
		return registered(rc, target)
	}
	return registerExactly(rc, target)
}

// ipcAllowed reports whether CUDA IPC may carry transfers over s: a peer on
// this host that this process trusts. A CUDA IPC mapping cannot be revoked, so
// the owner could keep writing into (and reading) the receiver's allocation
// after the transfer; only trusted peers get one.
func ipcAllowed(s *transport.Session) bool { return s.PeerSameHost() && s.TrustsPeer() }

// checkKeyDomains reports why this process must not put with the receiver's
// packed key: it names memory this process would write into itself.
func checkKeyDomains(ep *rdma.Endpoint, packed []byte, trusted bool) error {
	if trusted {
		return nil
	}
	domains, err := ep.KeyDomains(packed)
	if err != nil {
		return err
	}
	return checkDomains(domains, trusted)
}

// checkDomains reports why this process must not put with a key carrying
// domains: memory this process would write into itself. An unpacked key is
// checked again (RemoteKey.Domains): its unpack may have read the lanes
// after KeyDomains did.
func checkDomains(domains []string, trusted bool) error {
	if trusted {
		return nil
	}
	for _, d := range domains {
		if !receiverApplied[d] {
			return fmt.Errorf("the receiver's key names %s memory, which this process would write into itself (peers are not trusted)", d)
		}
	}
	return nil
}

// clearDestination zeroes b before it is offered to a path whose arrival the
// receiver cannot count: a FIN that claims such a path hands over b whatever
// the owner wrote, and b may hold an earlier transfer's bytes. GPU memory is
// cleared by a memset on the device; the CPU never touches it.
func clearDestination(b *devicebuf.Buffer) error {
	defer trace.StartRegion(context.Background(), "gdrpc.clear").End()
	return devicebuf.Clear(b)
}

// checkFINPath reports why a FIN "ok" naming path must be refused for the
// RTR m: a path it did not offer, or none for a payload that has bytes.
func checkFINPath(m *rtr, path Path) error {
	if m.Length == 0 && path == PathNone {
		return nil
	}
	offered := m.Offers | PathStream
	if path == PathNone || path&(path-1) != 0 || offered&path == 0 {
		return fmt.Errorf("the owner reported path %v, which was not offered (%v)", path, offersString(offered))
	}
	return nil
}

func offersString(p Path) string {
	s := ""
	for b := Path(1); b != 0 && b <= PathLocal; b <<= 1 {
		if p&b != 0 {
			if s != "" {
				s += ","
			}
			s += b.String()
		}
	}
	return s
}

// settleWrites waits until every put this process issued on ep has landed at
// the peer or can no longer land (the endpoint failed), however the transfer
// ended: only then may a FIN(failed) let the receiver reuse its destination.
// The wait is bounded by the session's life, not by the transfer's context.
// A peer whose puts do not complete within the transfer timeout (it stopped
// acknowledging them, or its worker no longer progresses them) would hold the
// source, and every withdrawal of it, for as long as it keeps the session up:
// the session is ended then.
func settleWrites(s *transport.Session, ep *rdma.Endpoint) {
	settleWritesWithin(s, ep.Flush, cfgOf(s).Timeout)
}

// settleWritesWithin is settleWrites with the endpoint's flush and the bound
// given.
func settleWritesWithin(s *transport.Session, flush func(context.Context) error, bound time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		t := time.NewTimer(bound)
		defer t.Stop()
		select {
		case <-s.Done():
		case <-t.C:
			// Ended, as when the session ends by itself: its puts are no
			// longer waited for. A flush that returned as the bound passed
			// (both ready, select picks either) ended in time.
			if ctx.Err() == nil {
				abort(s, fmt.Errorf("gdrpc: the peer's puts did not complete within %v of a failed transfer", bound))
			}
		case <-ctx.Done():
		}
		cancel()
	}()
	if err := flush(ctx); err != nil {
		cfgOf(s).Logger.Debug("flush after a failed push", "session", s.ID(), "err", err)
	}
}

// stagedGrain aligns the chunks of a staged transfer: each starts at a
// multiple of it, and each but the last is a multiple of it long.
const stagedGrain = 64 << 10

func roundUp[T ~int | ~uint64](n, to T) T { return (n + to - 1) / to * to }

// chunkCoverage tracks which grains of a staged destination chunks covered,
// so that chunks that do not overlap and add up to the destination's length
// are known to cover all of it.
type chunkCoverage struct {
	total uint64
	grain []uint64 // one bit per stagedGrain
}

func newChunkCoverage(total uint64) *chunkCoverage {
	return &chunkCoverage{total: total, grain: make([]uint64, (total/stagedGrain+64)/64)}
}

// add records the chunk [off, off+n), or reports why it cannot be one.
func (c *chunkCoverage) add(off, n uint64) error {
	if off > c.total || n == 0 || n > c.total-off || off%stagedGrain != 0 || (n%stagedGrain != 0 && off+n != c.total) {
		return fmt.Errorf("chunk [%d, +%d) does not fit a %d-byte destination in %d-byte grains", off, n, c.total, stagedGrain)
	}
	first, end := off/stagedGrain, (off+n+stagedGrain-1)/stagedGrain
	for g := first; g < end; g++ {
		if c.grain[g/64]&(1<<(g%64)) != 0 {
			return fmt.Errorf("chunk [%d, +%d) over an earlier one", off, n)
		}
	}
	for g := first; g < end; g++ {
		c.grain[g/64] |= 1 << (g % 64)
	}
	return nil
}
