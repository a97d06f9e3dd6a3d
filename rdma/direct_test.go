//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"encoding/binary"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// Keys of memory a peer of this host allocated with Alloc take direct copies
// over shared memory; other keys, other transports, and contexts that turn
// them off take UCX's puts and gets. Either way the bytes arrive.
func TestDirectCopies(t *testing.T) {
	forEachPairing(t, func(t *testing.T, tls string, pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint)) {
		shm := tls == transports[0].tls
		for _, on := range []bool{true, false} {
			c, err := rdma.NewContext(rdma.WithTransports(tls), rdma.WithDirectCopies(on))
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, c.Close()) })
			client, _ := pair(t, c)
			ctx := testCtx(t)
			// cached pieces; pieces shared by goroutines; the last one short
			for _, n := range []int{3<<20 + 5, 67<<20 + 3} {
				dst, _, rk := exposed(t, c, client, n)
				require.Equal(t, shm && on, rk.Direct(), "key of Alloc memory")
				mb, maddr := mmapped(t, n)
				mapped, err := c.Map(maddr, len(mb), rdma.MemoryHost)
				require.NoError(t, err)
				defer mapped.Close()
				packed, err := mapped.PackKey()
				require.NoError(t, err)
				mk, err := client.UnpackKey(packed)
				require.NoError(t, err)
				defer mk.Close()
				require.False(t, mk.Direct(), "key of private memory")

				want := pattern(n, 7)
				require.NoError(t, client.PutBytes(ctx, want, uint64(dst.Addr()), rk))
				require.NoError(t, client.Flush(ctx))
				require.True(t, bytes.Equal(want, dst.Bytes()))
				clear(mb)
				require.NoError(t, client.Get(ctx, mapped, 0, n, uint64(dst.Addr()), rk))
				require.True(t, bytes.Equal(want, mb))
			}
		}
	})
}

// A key whose region lies elsewhere than the segment UCX attached for it
// would name other memory of this process, through direct copies or UCX's
// puts alike: it is refused.
func TestDirectKeyOverclaims(t *testing.T) {
	c := newContext(t, transports[0].tls)
	client, _ := pair(t, c)
	m, packed, rk := exposed(t, c, client, 1<<20)
	require.True(t, rk.Direct())
	seg := rk.SegmentAt()
	own, err := c.Alloc(1 << 20) // this process's own shared memory
	require.NoError(t, err)
	defer own.Close()
	require.NoError(t, rk.Close()) // its segment detached: the next attach takes its place
	for name, reframe := range map[string]func(k []byte){
		"own memory": func(k []byte) {
			// the region shifted so that UCX's pointer lands in own
			binary.BigEndian.PutUint64(k[8:], uint64(m.Addr())+uint64(own.Addr()-seg))
		},
		"longer": func(k []byte) {
			binary.BigEndian.PutUint64(k[16:], binary.BigEndian.Uint64(k[16:])+1<<30)
		},
		"earlier": func(k []byte) {
			binary.BigEndian.PutUint64(k[8:], uint64(m.Addr())-1<<30)
			binary.BigEndian.PutUint64(k[16:], binary.BigEndian.Uint64(k[16:])+1<<30)
		},
	} {
		t.Run(name, func(t *testing.T) {
			k := bytes.Clone(packed)
			reframe(k)
			_, err := client.UnpackKey(k)
			require.ErrorIs(t, err, rdma.ErrBadKey)
			require.ErrorContains(t, err, "outside its segment")
		})
	}
}

// directKey returns an endpoint over shared memory and n bytes of its peer's
// memory with a key that takes direct copies.
func directKey(t *testing.T, n int) (*rdma.Context, *rdma.Endpoint, *rdma.Memory, *rdma.RemoteKey) {
	c := newContext(t, transports[0].tls)
	client, _ := pair(t, c)
	dst, _, rk := exposed(t, c, client, n)
	require.True(t, rk.Direct())
	return c, client, dst, rk
}

// Closing a key while direct copies run waits for those under way; the puts
// that follow fail as closed.
func TestDirectKeyCloseDuringPuts(t *testing.T) {
	const n = 16 << 20
	c, client, dst, rk := directKey(t, n)
	src, err := c.Alloc(n)
	require.NoError(t, err)
	defer src.Close()
	ctx := testCtx(t)
	const putters = 3
	first := make(chan struct{}, putters)
	errs := make(chan error, putters)
	for range putters {
		go func() {
			var err error
			for i := 0; err == nil; i++ {
				err = client.Put(ctx, src, 0, n, uint64(dst.Addr()), rk)
				if i == 0 {
					first <- struct{}{}
				}
			}
			errs <- err
		}()
	}
	for range putters {
		<-first
	}
	require.NoError(t, rk.Close())
	for range putters {
		require.ErrorIs(t, <-errs, net.ErrClosed)
	}
}

// Closing a key waits for the direct copy under way, which completes.
func TestDirectKeyCloseCompletesStartedPut(t *testing.T) {
	const n = 256 << 20
	_, client, dst, rk := directKey(t, n)
	src := pattern(n, 9)
	errc := make(chan error, 1)
	// A put runs for tens of milliseconds: a test goroutine descheduled that
	// long misses it, and puts the same bytes again.
	put := func() { go func() { errc <- client.PutBytes(testCtx(t), src, uint64(dst.Addr()), rk) }() }
	put()
	deadline := time.Now().Add(30 * time.Second)
	for !rk.Copying() {
		select {
		case err := <-errc:
			require.NoError(t, err, "a put before the key was closed")
			put() // it ended unseen
		default:
		}
		require.True(t, time.Now().Before(deadline), "no put was seen copying")
		runtime.Gosched()
	}
	require.NoError(t, rk.Close())
	require.False(t, rk.Copying())
	require.NoError(t, <-errc)
	require.True(t, bytes.Equal(src, dst.Bytes()))
	require.ErrorIs(t, client.PutBytes(testCtx(t), src[:1], uint64(dst.Addr()), rk), net.ErrClosed)
}
