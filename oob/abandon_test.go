package oob

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/transport"
)

// A caller that gives up after the owner's FIN came leaves nothing the
// owner could still write into: the pull settles at once, and the session,
// which did nothing wrong, lives on. Before, the pull waited for a second
// FIN until Limits.Abandoned and then ended the session.
func TestAbandonAfterFIN(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{Abandoned: time.Hour}})
	rc := ucxContext(t, "tcp")
	var owner atomic.Pointer[transport.Session]
	offers := make(chan Path, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		offers <- m.Offers
		// The stream path, whose bytes then take longer than the caller waits.
		f := &fin{Req: m.Req, Status: finOK, Path: PathStream}
		require.NoError(t, sendControl(context.Background(), s, ctlFIN, f.marshal()))
		return true
	})
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX)}
	_, cs, ss, _, _ := lanePair(t, ucx, ucx)
	owner.Store(ss)

	const n = 1 << 20
	dst, err := HostPool(rc).Alloc(n)
	require.NoError(t, err)
	defer dst.Release()
	// The owner never sends the bytes: any bound makes the point, and one of
	// seconds lets a loaded machine send the RTR first.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = Fetch(ctx, Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, dst)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotZero(t, waitFor(t, offers, "the RTR")&PathRDMA, "the pull offered a path the owner writes by itself")
	require.Eventually(t, func() bool { return numPulls() == 0 }, 10*time.Second, time.Millisecond, "the abandoned pull settles")
	require.NoError(t, cs.Err(), "the session lives on")
}

// A bulk lane's reader keeps no bounce buffer of a GPU destination past its
// pull: an owner that sends part of each transfer and stalls pins nothing
// once the pulls gave up.
func TestLaneBounceGoesWithPull(t *testing.T) {
	devicebuftest.Install(t, 1)
	const n = 4 << 20
	setTransferConfig(t, TransferConfig{Timeout: 200 * time.Millisecond, Limits: Limits{PullBytes: n, Pulls: 1}})
	var owner atomic.Pointer[transport.Session]
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		body := make([]byte, laneFrameMax)
		for i := range 15 { // most of the reader's 4 MiB bounce buffer, then nothing
			f := laneFrame{kind: laneData, req: m.Req, total: m.Length, off: uint64(i * laneFrameMax), n: laneFrameMax}
			require.NoError(t, stateOf(s).link.WriteLaneFrame(context.Background(), f.total, f.marshal(), body))
		}
		return true
	})
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	_, cs, ss, _, _ := lanePair(t, opts, opts)
	owner.Store(ss)
	require.NotNil(t, stateOf(ss).link.Lane())
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	before := devicebuf.Live().HostBytes
	for range 4 {
		d := Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.CUDA, Device: 0, DeviceUUID: "x", HostID: transport.ID(newToken())}
		b, _, err := FetchNew(context.Background(), d, gpu.Alloc)
		require.Error(t, err)
		require.Nil(t, b)
	}
	require.Eventually(t, func() bool { return numPulls() == 0 }, 10*time.Second, time.Millisecond)
	// A settled pull lets go of its destination last: wait for that too.
	require.Eventually(t, func() bool {
		live := devicebuf.Live()
		return live.HostBytes == before && live.CUDABuffers == 0
	}, 10*time.Second, time.Millisecond, "host memory held for pulls that settled")
}

// A bulk stream is read to its owner's close: the bytes of a pull nobody
// waits for any more go into nothing, and the session lives on; an owner
// that keeps its stream open past the transfer timeout, sending or not,
// ends the session (the multiplexer would keep what it sends on a stream
// closed on this side, up to its window each).
func TestBulkStreamReadToClose(t *testing.T) {
	// The honest stream's megabyte must be read within the timeout, on a
	// loaded machine and under the race detector too: 2 s ran out once
	// while the interop tests' client processes started beside it, and 5 s
	// once more.
	const timeout = 10 * time.Second
	setTransferConfig(t, TransferConfig{Timeout: timeout})
	opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(false)}
	bulk := func(ss *transport.Session, req, n uint64) net.Conn {
		owner := stateOf(ss).link
		require.Nil(t, owner.Lane(), "bulk data goes on multiplexed streams")
		c, err := owner.OpenBulk(context.Background())
		require.NoError(t, err)
		_, err = c.Write(append(bulkHeader(req, n), make([]byte, n)...))
		require.NoError(t, err)
		return c
	}

	// A pull nobody waits for: its bytes, then the owner's close.
	_, honest, ss, _, _ := lanePair(t, opts, opts)
	require.NoError(t, bulk(ss, 12345, 1<<20).Close())

	// A stream left open after its bytes, opened after the first: its
	// session ends once the first one's would have.
	_, cs, ss, _, _ := lanePair(t, opts, opts)
	defer bulk(ss, 12346, 4096).Close()
	select {
	case <-cs.Done():
	case <-time.After(3 * timeout):
		t.Fatal("the session outlived a bulk stream left open")
	}
	require.ErrorContains(t, cs.Err(), "bulk stream left open")
	require.NoError(t, honest.Err(), "the session whose owner closed its stream lives on")
}
