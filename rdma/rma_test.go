package rdma_test

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// mmapped returns n bytes of anonymous mmap memory (not the Go heap, so it may
// stay registered) and its address.
func mmapped(t testing.TB, n int) ([]byte, uintptr) {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	t.Cleanup(func() { syscall.Munmap(b) })
	return b, uintptr(unsafe.Pointer(&b[0]))
}

func TestPutGetSizes(t *testing.T) {
	forEachPairing(t, func(t *testing.T, tls string, pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint)) {
		c := newContext(t, tls)
		client, server := pair(t, c)
		ctx := testCtx(t)
		max := sizes(t)[len(sizes(t))-1]
		const off = 13 // unaligned offsets on both sides

		// target: UCX-allocated on the server side
		dst, _, rk := exposed(t, c, client, max+2*off)

		// sources: UCX-allocated and mmapped (Map) memory, and Go memory
		srcA, err := c.Alloc(max + 2*off)
		require.NoError(t, err)
		defer srcA.Close()
		mb, maddr := mmapped(t, max+2*off)
		srcM, err := c.Map(maddr, len(mb), rdma.MemoryHost)
		require.NoError(t, err)
		defer srcM.Close()
		require.Equal(t, maddr, srcM.Addr())

		_ = server
		for i, n := range sizes(t) {
			t.Run(sizeName(n), func(t *testing.T) {
				want := pattern(n, uint64(100+i))
				remote := uint64(dst.Addr()) + off

				// Put from UCX memory
				copy(srcA.Bytes()[off:], want)
				clear(dst.Bytes())
				require.NoError(t, client.Put(ctx, srcA, off, n, remote, rk))
				require.NoError(t, client.Flush(ctx))
				require.True(t, bytes.Equal(want, dst.Bytes()[off:off+n]), "put from Alloc memory")
				require.Zero(t, dst.Bytes()[off-1])
				require.Zero(t, dst.Bytes()[off+n])

				// Put from mapped memory
				copy(mb[off+1:], want)
				clear(dst.Bytes())
				require.NoError(t, client.Put(ctx, srcM, off+1, n, remote, rk))
				require.NoError(t, client.Flush(ctx))
				require.True(t, bytes.Equal(want, dst.Bytes()[off:off+n]), "put from Map memory")

				// PutBytes from Go memory
				clear(dst.Bytes())
				require.NoError(t, client.PutBytes(ctx, want, remote, rk))
				require.NoError(t, c.Worker().Flush(ctx))
				require.True(t, bytes.Equal(want, dst.Bytes()[off:off+n]), "PutBytes")

				// Get back into mapped memory
				clear(mb)
				require.NoError(t, client.Get(ctx, srcM, off+2, n, remote, rk))
				require.True(t, bytes.Equal(want, mb[off+2:off+2+n]), "get")
			})
		}
	})
}

func TestRMABounds(t *testing.T) {
	c := newContext(t, "tcp")
	client, server := pair(t, c)
	ctx := testCtx(t)
	dst, packed, rk := exposed(t, c, client, 4096)
	src, err := c.Alloc(100)
	require.NoError(t, err)
	defer src.Close()
	base := uint64(dst.Addr())

	tests := []struct {
		name string
		err  error
	}{
		{"local past end", client.Put(ctx, src, 50, 51, base, rk)},
		{"local negative offset", client.Put(ctx, src, -1, 10, base, rk)},
		{"negative length", client.Put(ctx, src, 0, -1, base, rk)},
		{"remote before region", client.Put(ctx, src, 0, 10, base-1, rk)},
		{"remote past end", client.Put(ctx, src, 0, 10, base+4090, rk)},
		{"remote overflow", client.PutBytes(ctx, []byte{1}, ^uint64(0), rk)},
		{"get local past end", client.Get(ctx, src, 99, 2, base, rk)},
		{"nil key", client.Put(ctx, src, 0, 1, base, nil)},
		{"nil memory", client.Put(ctx, nil, 0, 1, base, rk)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { require.Error(t, tt.err) })
	}
	// a key unpacked on another endpoint
	rk2, err := server.UnpackKey(packed)
	require.NoError(t, err)
	defer rk2.Close()
	require.Error(t, client.Put(ctx, src, 0, 1, base, rk2))
	// memory of another context
	other := newContext(t, "tcp")
	foreign, err := other.Alloc(100)
	require.NoError(t, err)
	defer foreign.Close()
	require.ErrorContains(t, client.Put(ctx, foreign, 0, 1, base, rk), "another context")
	require.ErrorContains(t, client.Get(ctx, foreign, 0, 1, base, rk), "another context")
	// exactly the region is fine
	require.NoError(t, client.Put(ctx, src, 0, 100, base+4096-100, rk))
	require.NoError(t, client.Put(ctx, src, 0, 0, base, rk))
}

func TestMapCUDANotSupported(t *testing.T) {
	c := newContext(t, "tcp")
	if c.Info().HasMemoryType(rdma.MemoryCUDA) {
		t.Skip("this UCX can register CUDA memory")
	}
	_, err := c.Map(0x7f0000000000, 4096, rdma.MemoryCUDA)
	require.ErrorIs(t, err, rdma.ErrNotSupported)
	require.Equal(t, []rdma.MemoryType{rdma.MemoryHost}, c.Info().MemoryTypes)
	require.Equal(t, "cuda", rdma.MemoryCUDA.String())
	require.Equal(t, "host", rdma.MemoryHost.String())
}

func TestPutContextCanceled(t *testing.T) {
	c := newContext(t, "tcp")
	client, _ := pair(t, c)
	dst, _, rk := exposed(t, c, client, 1<<20)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := client.PutBytes(ctx, make([]byte, 1<<20), uint64(dst.Addr()), rk)
	// UCX cannot cancel a put: it either finished first or the wait was cut short
	if err != nil {
		require.ErrorIs(t, err, context.Canceled)
	}
	fctx, fcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer fcancel()
	require.NoError(t, client.Flush(fctx))
	require.False(t, errors.Is(client.Err(), context.Canceled))
}

// Closing memory while puts from it run: the unmap waits for them, later
// puts fail with net.ErrClosed, nothing leaks.
func TestMemoryCloseDuringPuts(t *testing.T) {
	c := newContext(t, "posix,sysv,cma,tcp")
	client, _ := pair(t, c)
	dst, _, rk := exposed(t, c, client, 1<<20)
	src, err := c.Alloc(1 << 20)
	require.NoError(t, err)
	ctx := testCtx(t)
	errc := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		var err error
		for i := 0; err == nil; i++ {
			err = client.Put(ctx, src, 0, src.Len(), uint64(dst.Addr()), rk)
			if i == 2 {
				close(started)
			}
		}
		errc <- err
	}()
	<-started
	require.NoError(t, src.Close())
	select {
	case err := <-errc:
		requireClosedErr(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("puts did not stop after the memory closed")
	}
	require.NoError(t, client.Flush(ctx))
	require.Equal(t, int64(1), rdma.Stats().Memories) // dst only
}

// TestPutCanceledCompletes: a put whose context ended before it completed
// returns only once UCX is done with it: its source is no longer in use (it
// unmaps at once on Close) and its key may be released.
func TestPutCanceledCompletes(t *testing.T) {
	c := newContext(t, "tcp")
	client, _ := pair(t, c)
	const n = 8 << 20
	dst, _, rk := exposed(t, c, client, n)
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for range 3 {
		src, err := c.Alloc(n)
		require.NoError(t, err)
		before := rdma.Stats().Memories
		if err := client.Put(canceled, src, 0, n, uint64(dst.Addr()), rk); err != nil {
			require.ErrorIs(t, err, context.Canceled)
		}
		require.NoError(t, src.Close())
		require.Equal(t, before-1, rdma.Stats().Memories, "the put still used its source after it returned")
		require.NoError(t, client.Flush(testCtx(t)))
	}
}

// TestKeyDomains: a key names the memory domains a put with it may take.
func TestKeyDomains(t *testing.T) {
	for _, tc := range []struct {
		name, tls string
		want      []string
	}{
		{"tcp", "tcp", []string{"tcp"}},
		{"shm", "posix,sysv,cma,tcp", []string{"sysv", "tcp"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newContext(t, tc.tls)
			client, _ := pair(t, c)
			_, packed, _ := exposed(t, c, client, 4096)
			got, err := client.KeyDomains(packed)
			require.NoError(t, err)
			require.ElementsMatch(t, tc.want, got)
			k, err := client.UnpackKey(packed)
			require.NoError(t, err)
			require.ElementsMatch(t, tc.want, k.Domains(), "what UCX unpacked")
			require.NoError(t, k.Close())
			_, err = client.KeyDomains(packed[:10])
			require.ErrorIs(t, err, rdma.ErrBadKey)
		})
	}
}

// TestMapIsExact: a Map of part of memory UCX allocated is a registration of
// its own: its key names none of the allocation's shared-memory segment.
func TestMapIsExact(t *testing.T) {
	c := newContext(t, "posix,sysv,cma,tcp")
	client, _ := pair(t, c)
	whole, err := c.Alloc(1 << 20)
	require.NoError(t, err)
	defer whole.Close()
	part, err := c.Map(whole.Addr()+64<<10, 64<<10, rdma.MemoryHost)
	require.NoError(t, err)
	packed, err := part.PackKey()
	require.NoError(t, err)
	require.NoError(t, part.Close())
	domains, err := client.KeyDomains(packed)
	require.NoError(t, err)
	require.Equal(t, []string{"tcp"}, domains)
}
