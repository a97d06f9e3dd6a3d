package oob

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

// readingInto reports whether a bulk reader is writing into the destination
// of pull req.
func readingInto(req uint64) bool {
	pulls.Lock()
	defer pulls.Unlock()
	p := pulls.m[req]
	return p != nil && p.reading != nil
}

// reservedPulls returns the pulls through s not yet settled.
func reservedPulls(s *transport.Session) int {
	b := &stateOf(s).bounds
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pulls
}

// An owner that sends part of a pull's bytes on a bulk stream or the bulk
// lane, stalls, and then answers with a FIN (failed, or ok for a path the
// pull did not offer) does not hold the caller: Fetch returns with the FIN,
// long before the bulk reader's deadline (the transfer timeout). The
// destination stays reserved until the reader stopped, and goes then.
func TestStalledBulkThenFIN(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lanes bool
		st    finStatus
		path  Path
		err   string
	}{
		{"multiplexed/fin-failed", false, finFailed, PathNone, "owner refused: nope"},
		{"multiplexed/fin-ok-unoffered-path", false, finOK, PathRDMA, "not offered"},
		{"lane/fin-failed", true, finFailed, PathNone, "owner refused: nope"},
		{"lane/fin-ok-unoffered-path", true, finOK, PathRDMA, "not offered"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const timeout = 5 * time.Second
			setTransferConfig(t, TransferConfig{Timeout: timeout})
			var owner atomic.Pointer[transport.Session]
			stalled := make(chan net.Conn, 1) // the bulk stream, or the lane, mid-transfer
			interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
				if s != owner.Load() {
					return false
				}
				m, err := parseRTR(p)
				require.NoError(t, err)
				link := stateOf(s).link
				if tc.lanes {
					// A frame of laneFrameMax bytes, of which half arrives.
					f := laneFrame{kind: laneData, req: m.Req, total: m.Length, n: laneFrameMax}
					_, err = link.Lane().Write(append(f.marshal(), make([]byte, laneFrameMax/2)...))
					require.NoError(t, err)
					stalled <- link.Lane()
				} else {
					c, err := link.OpenBulk(context.Background())
					require.NoError(t, err)
					_, err = c.Write(append(bulkHeader(m.Req, m.Length), make([]byte, m.Length/2)...))
					require.NoError(t, err)
					stalled <- c
				}
				require.Eventually(t, func() bool { return readingInto(m.Req) }, testTimeout, time.Millisecond, "the receiver reads into the destination")
				f := &fin{Req: m.Req, Status: tc.st, Path: tc.path, Msg: "nope"}
				require.NoError(t, sendControl(context.Background(), s, ctlFIN, f.marshal()))
				return true
			})
			opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(tc.lanes)}
			_, cs, ss, _, _ := lanePair(t, opts, opts)
			owner.Store(ss)
			require.Equal(t, tc.lanes, stateOf(ss).link.Lane() != nil)

			const n = 1 << 20
			dst, err := devicebuf.NewHostAllocator().Alloc(n)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			start := time.Now()
			_, err = Fetch(ctx, Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, dst)
			elapsed := time.Since(start)
			require.ErrorContains(t, err, tc.err)
			require.Less(t, elapsed, timeout/2, "Fetch waited for the stalled bulk reader")

			// The reader may still write into the destination: it stays
			// reserved until the reader stops.
			dst.Release()
			require.False(t, dst.Released(), "the destination went while a reader wrote into it")
			require.Equal(t, 1, reservedPulls(cs), "the pull's reservation")
			c := waitFor(t, stalled, "the stalled transfer")
			if tc.lanes {
				_, err = c.Write(make([]byte, laneFrameMax/2)) // the rest of the frame: the lane carries on
				require.NoError(t, err)
			} else {
				require.NoError(t, c.Close())
			}
			require.Eventually(t, func() bool { return dst.Released() && reservedPulls(cs) == 0 }, testTimeout, time.Millisecond, "the pull settles once the reader stopped")
			require.Zero(t, numPulls())
			requireLive(t, cs)
			requireLive(t, ss)
		})
	}
}

// A FIN ok for a path the owner writes by itself (offered), while a bulk
// reader it started still writes into the destination, fails the pull at
// once: the destination is not the caller's while the reader may write.
func TestStalledBulkThenFINOfferedPath(t *testing.T) {
	const timeout = 5 * time.Second
	setTransferConfig(t, TransferConfig{Timeout: timeout})
	rc := ucxContext(t, "tcp")
	var owner atomic.Pointer[transport.Session]
	stalled := make(chan net.Conn, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		require.NotZero(t, m.Offers&PathRDMA)
		c, err := stateOf(s).link.OpenBulk(context.Background())
		require.NoError(t, err)
		_, err = c.Write(append(bulkHeader(m.Req, m.Length), make([]byte, m.Length/2)...))
		require.NoError(t, err)
		stalled <- c
		require.Eventually(t, func() bool { return readingInto(m.Req) }, testTimeout, time.Millisecond, "the receiver reads into the destination")
		f := &fin{Req: m.Req, Status: finOK, Path: PathRDMA}
		require.NoError(t, sendControl(context.Background(), s, ctlFIN, f.marshal()))
		return true
	})
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX), transport.WithLanes(false)}
	_, cs, ss, _, _ := lanePair(t, ucx, ucx)
	owner.Store(ss)

	const n = 1 << 20
	dst, err := HostPool(rc).Alloc(n)
	require.NoError(t, err)
	start := time.Now()
	_, err = Fetch(testContext(t), Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, dst)
	require.ErrorContains(t, err, "bulk data still arriving")
	require.Less(t, time.Since(start), timeout/2, "Fetch waited for the stalled bulk reader")
	dst.Release()
	require.False(t, dst.Released(), "the destination went while a reader wrote into it")
	require.NoError(t, (<-stalled).Close())
	require.Eventually(t, func() bool { return dst.Released() && reservedPulls(cs) == 0 }, testTimeout, time.Millisecond, "the pull settles once the reader stopped")
	requireLive(t, cs)
}
