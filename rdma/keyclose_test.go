//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// TestKeyClosedDuringPut: a key closed while a put with it is in flight
// stays with UCX until the put completes (UCX uses a request's key until
// then), the put's bytes all arrive, and a put started after the close
// fails. Over TCP a put completes only as the peer's worker progresses, so
// holding the server's worker keeps a 64 MiB put in flight.
func TestKeyClosedDuringPut(t *testing.T) {
	c := newContext(t, "tcp")
	cw, sw := newWorker(t, c), newWorker(t, c)
	client, _ := pairOn(t, cw, sw)
	const n = 64 << 20
	dst, _, rk := exposed(t, c, client, n)
	src, err := c.Alloc(n)
	require.NoError(t, err)
	defer src.Close()
	want := pattern(n, 7)
	copy(src.Bytes(), want)
	keys := rdma.Stats().RemoteKeys

	releaseServer := sw.Hold()
	serverHeld := true
	defer func() {
		if serverHeld {
			releaseServer()
		}
	}()
	releaseClient := cw.Hold()
	put := make(chan error, 1)
	go func() { put <- client.Put(testCtx(t), src, 0, n, uint64(dst.Addr()), rk) }()
	require.Eventually(t, func() bool { return cw.Queued() == 1 }, 10*time.Second, time.Millisecond, "the put is submitted")
	releaseClient() // serves the put's submission: its first pieces are issued

	require.NoError(t, rk.Close())
	require.Equal(t, keys, rdma.Stats().RemoteKeys, "the key went while a put used it")
	select {
	case err := <-put:
		t.Fatalf("the put completed with the server's worker held: %v", err)
	default:
	}
	err = client.PutBytes(testCtx(t), make([]byte, 8), uint64(dst.Addr()), rk)
	requireClosedErr(t, err)

	releaseServer()
	serverHeld = false
	require.NoError(t, <-put)
	require.NoError(t, client.Flush(testCtx(t)))
	require.Equal(t, keys-1, rdma.Stats().RemoteKeys, "the key outlived its last put")
	require.True(t, bytes.Equal(want, dst.Bytes()), "the put's bytes")
}
