package oob

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

// TestNoPutAfterFetchFailed: a receiver whose session ends while the owner's
// put into its destination is under way gets the destination back from
// Fetch only once the session's endpoint is released: UCX copies a put that
// arrives to the address it names until then, and the caller may hand the
// memory to someone else as soon as Fetch returns.
func TestNoPutAfterFetchFailed(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{Abandoned: time.Hour}})
	rc := ucxContext(t, "tcp")
	const n = 64 << 20
	var owner *transport.Session
	ownerSet := make(chan struct{})
	started := make(chan struct{}, 1)
	putDone := make(chan error, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		<-ownerSet
		if s != owner {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		require.NotZero(t, m.Offers&PathRDMA)
		// The put goes in one piece, as one into GPU memory does: the
		// key's header and its rkey name CUDA memory.
		key := bytes.Clone(m.RKey)
		key[5], key[28+8] = 1, 1
		ep := s.Endpoint()
		k, err := ep.UnpackKey(key)
		require.NoError(t, err)
		go func() {
			defer k.Close()
			err := ep.PutBytes(context.Background(), bytes.Repeat([]byte{0xab}, n), m.RAddr, k)
			if err == nil {
				err = ep.Flush(context.Background())
			}
			putDone <- err
		}()
		started <- struct{}{}
		return true
	})
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX)}
	_, cs, ss, _, _ := lanePair(t, ucx, ucx)
	owner = ss
	close(ownerSet)

	buf := make([]byte, n)
	dst := devicebuf.HostFromBytes(buf)
	defer dst.Release()
	go func() {
		<-started
		_ = cs.Close() // the receiver's session ends while the put goes
	}()
	_, err := Fetch(context.Background(), Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, dst)
	require.Error(t, err)
	clear(buf) // the caller's again
	<-putDone
	<-cs.Released() // nothing lands after this
	require.Zero(t, n-bytes.Count(buf, []byte{0}), "bytes the owner's put wrote after Fetch returned")
	require.Eventually(t, func() bool { return numPulls() == 0 }, 10*time.Second, time.Millisecond)
}
