//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// TestRMAInPieces: a large put or get between host memories goes in pieces,
// and what another goroutine submitted to the worker meanwhile runs between
// two of them: an operation queued behind the transfer finds its second piece
// not yet moved. The bytes arrive whole, and a transfer that is not a whole
// number of pieces ends with a short one. (Direct copies, which never hold
// the worker, are off: the pieces are UCX's.)
func TestRMAInPieces(t *testing.T) {
	requireUCX(t)
	c, err := rdma.NewContext(rdma.WithTransports("posix,sysv,cma,tcp"), rdma.WithDirectCopies(false))
	require.NoError(t, err)
	defer c.Close()
	client, _ := pair(t, c)
	ctx := testCtx(t)
	const n = 3*rdma.PieceSize + 5
	far, _, rk := exposed(t, c, client, n)
	near, err := c.Alloc(n)
	require.NoError(t, err)
	defer near.Close()
	w := c.Worker()
	for _, get := range []bool{false, true} {
		t.Run(map[bool]string{false: "put", true: "get"}[get], func(t *testing.T) {
			src, dst := near, far
			if get {
				src, dst = far, near
			}
			want := pattern(n, 11)
			copy(src.Bytes(), want)
			clear(dst.Bytes())
			release := w.Hold()
			done := make(chan error, 1)
			go func() {
				if get {
					done <- client.Get(ctx, near, 0, n, uint64(far.Addr()), rk)
				} else {
					done <- client.Put(ctx, near, 0, n, uint64(far.Addr()), rk)
				}
			}()
			waitQueued(t, w, 1)
			second := make(chan []byte, 1)
			require.NoError(t, w.Submit(func() {
				second <- bytes.Clone(dst.Bytes()[rdma.PieceSize : 2*rdma.PieceSize])
			}))
			release()
			require.NoError(t, <-done)
			require.NoError(t, client.Flush(ctx))
			require.True(t, bytes.Equal(make([]byte, rdma.PieceSize), <-second), "the second piece moved before the operation queued behind the transfer ran")
			require.True(t, bytes.Equal(want, dst.Bytes()), "the bytes that arrived")
		})
	}
}

// waitQueued waits until k operations wait for w's lock.
func waitQueued(t *testing.T, w *rdma.Worker, k int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for w.Queued() < k {
		require.True(t, time.Now().Before(deadline), "%d operations queued, want %d", w.Queued(), k)
		runtime.Gosched()
	}
}

// TestPutReturnsWithItsSource: an endpoint closed while a put in pieces is
// under way issues no further piece, and Put returns only once UCX reads
// its source no more: what the caller writes there afterwards never reaches
// the target. The close comes right after the put issued its first pieces
// (one a round of the worker, held while the put and the close's trigger
// are queued), so that every run shows it.
func TestPutReturnsWithItsSource(t *testing.T) {
	c := newContext(t, "tcp")
	w := c.Worker()
	const n = 16 * rdma.PieceSize
	for _, issued := range []int{1, 3, 8} {
		t.Run(fmt.Sprint(issued), func(t *testing.T) {
			client, _ := pair(t, c)
			m, _, rk := exposed(t, c, client, n)
			clear(m.Bytes())
			src := bytes.Repeat([]byte{0xab}, n)
			release := w.Hold()
			ret := make(chan error, 1)
			go func() { ret <- client.PutBytes(t.Context(), src, uint64(m.Addr()), rk) }()
			waitQueued(t, w, 1) // the put's first piece, issued once the worker runs
			closed := make(chan struct{})
			var after func(k int) func()
			after = func(k int) func() { // runs after the put issued its k-th piece
				return func() {
					if k < issued {
						w.Later(after(k + 1))
						return
					}
					go func() {
						_ = client.Close() // graceful: what was issued goes, with the FIN after it
						close(closed)
					}()
					<-client.Done() // the endpoint ended before the worker's next round
				}
			}
			require.NoError(t, w.Submit(after(1)))
			release()
			err := <-ret
			for i := range src {
				src[i] = 0xcd // the caller's again
			}
			<-closed
			require.Error(t, err, "the put ended with its endpoint")
			if k := bytes.Count(m.Bytes(), []byte{0xcd}); k > 0 {
				// Where they landed says which piece read its source late.
				first, last := bytes.IndexByte(m.Bytes(), 0xcd), bytes.LastIndexByte(m.Bytes(), 0xcd)
				t.Fatalf("%d bytes read from the source after Put returned (%v): at %d-%d, pieces %d-%d",
					k, err, first, last, first/rdma.PieceSize, last/rdma.PieceSize)
			}
			sent := issued * rdma.PieceSize
			require.Equal(t, sent, bytes.Count(m.Bytes()[:sent], []byte{0xab}), "the pieces issued before the close arrived whole")
			require.Equal(t, n-sent, bytes.Count(m.Bytes()[sent:], []byte{0}), "no piece was issued after the close")
		})
	}
}
