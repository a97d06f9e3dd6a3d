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

// An owner that announces a pull's bytes on a bulk stream, sends part of
// them and stalls past the transfer timeout breaks the protocol as one that
// keeps a stream open after its bytes does (TestBulkStreamReadToClose):
// once the reader's deadline and a short grace for the owner's close passed
// (its push ends at its own timeout), the session ends, rather than stay up,
// and the stream's handler with it, for one more transfer timeout.
func TestHostileBulkStallEndsSessionAtReadDeadline(t *testing.T) {
	const timeout = 4 * time.Second // the grace: a second
	setTransferConfig(t, TransferConfig{Timeout: timeout})
	var owner atomic.Pointer[transport.Session]
	stalled := make(chan net.Conn, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		if s != owner.Load() {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		stalled <- halfBulk(t, s, m)
		return true
	})
	opts := []transport.Option{transport.WithMode(transport.ModeTCP), transport.WithLanes(false)}
	_, cs, ss, _, _ := lanePair(t, opts, opts)
	owner.Store(ss)

	d := Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: 1 << 20, Kind: devicebuf.Host, Device: -1}
	_, _, err := FetchNew(context.Background(), d, devicebuf.NewHostAllocator().Alloc)
	// Given up at its timeout, or failed as the session ends at the
	// reader's deadline just after it.
	require.Contains(t, []TransferErrorKind{TransferTimeout, TransferUnavailable}, kindOfErr(t, err))
	c := waitFor(t, stalled, "the owner's stalled stream")
	defer c.Close()
	// The reader stops at its deadline, and the abandoned pull settles.
	require.Eventually(t, func() bool { return reservedPulls(cs) == 0 }, testTimeout, time.Millisecond)
	select {
	case <-cs.Done():
	case <-time.After(timeout / 2):
		t.Fatalf("the session outlived, by %v, the read deadline of a bulk stream its owner stalled", timeout/2)
	}
	require.ErrorContains(t, cs.Err(), "past the transfer timeout")
}
