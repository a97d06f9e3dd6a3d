package rdma_test

import (
	"bytes"
	"testing"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// TestCUDAMemory checks the no-crash rule for GPU memory on every UCX: without
// CUDA contexts (UseCUDA) a CUDA pointer is refused before any UCX call, a UCX
// without CUDA support refuses UseCUDA, and a CUDA-enabled UCX moves GPU
// memory byte-exact in every direction when called from an OS thread on which
// no CUDA context is current.
func TestCUDAMemory(t *testing.T) {
	testenv.Need(t, "cuda", devicebuf.CUDAAvailable())
	requireUCX(t)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	hooks, err := devicebuf.CUDAThreadContexts()
	require.NoError(t, err)
	for _, tc := range []struct{ name, tls string }{
		{"default", ""},          // one host: UCX's cuda_ipc where it has one
		{"tcp", "tcp,cuda_copy"}, // as between two hosts without an RDMA NIC
	} {
		t.Run("transports="+tc.name, func(t *testing.T) {
			var opts []rdma.Option
			if tc.tls != "" {
				opts = append(opts, rdma.WithTransports(tc.tls))
			}
			c, err := rdma.NewContext(opts...)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, c.Close()) })

			const max = 64 << 20
			dst, err := gpu.Alloc(max)
			require.NoError(t, err)
			defer dst.Release()
			src, err := gpu.Alloc(max)
			require.NoError(t, err)
			defer src.Release()

			_, err = c.MapCUDA(src.Ptr(), max, 0)
			require.ErrorIs(t, err, rdma.ErrNotSupported, "CUDA memory without UseCUDA")
			require.False(t, c.CanMap(rdma.MemoryCUDA))
			if !c.Info().HasMemoryType(rdma.MemoryCUDA) {
				require.ErrorIs(t, c.UseCUDA(hooks, 0), rdma.ErrNotSupported)
				_, err = c.Map(src.Ptr(), max, rdma.MemoryCUDA)
				require.ErrorIs(t, err, rdma.ErrNotSupported)
				t.Logf("UCX %s has no CUDA support: GPU memory refused before any UCX call", c.Info().Version)
				return
			}
			require.NoError(t, c.UseCUDA(hooks, 0))
			require.True(t, c.CanMap(rdma.MemoryCUDA))

			// UCX's first protocol selection copies small CUDA puts with the CPU:
			// a context asked for it refuses CUDA memory.
			v1, err := rdma.NewContext(append(opts, rdma.WithConfig("PROTO_ENABLE", "n"))...)
			require.NoError(t, err)
			require.ErrorIs(t, v1.UseCUDA(hooks, 0), rdma.ErrNotSupported)
			_, err = v1.MapCUDA(src.Ptr(), max, 0)
			require.ErrorIs(t, err, rdma.ErrNotSupported)
			require.NoError(t, v1.Close())

			// devicebuf restores the calling thread's context after each call, so
			// no thread of this process has a CUDA context current: the hooks
			// must provide it for every UCX call below.
			moveCUDA(t, c, src, dst)
		})
	}
}

func moveCUDA(t *testing.T, c *rdma.Context, src, dst *devicebuf.Buffer) {
	client, _ := pair(t, c)
	ctx := testCtx(t)
	n := dst.Len()
	dmem, err := c.MapCUDA(dst.Ptr(), n, 0)
	require.NoError(t, err)
	defer dmem.Close()
	smem, err := c.MapCUDA(src.Ptr(), n, 0)
	require.NoError(t, err)
	defer smem.Close()
	require.Equal(t, rdma.MemoryCUDA, dmem.Type())
	require.Nil(t, dmem.Bytes(), "CUDA memory has no host view")
	dkey := unpack(t, client, dmem)

	hostDst, hostDstAddr := mmapped(t, n)
	hmem, err := c.Map(hostDstAddr, n, rdma.MemoryHost)
	require.NoError(t, err)
	defer hmem.Close()
	hkey := unpack(t, client, hmem)
	hostSrc, hostSrcAddr := mmapped(t, n)
	hsrc, err := c.Map(hostSrcAddr, n, rdma.MemoryHost)
	require.NoError(t, err)
	defer hsrc.Close()

	stage, err := devicebuf.NewHostAllocator().Alloc(n)
	require.NoError(t, err)
	defer stage.Release()
	staged, err := stage.HostBytes()
	require.NoError(t, err)
	// toGPU and fromGPU copy through devicebuf: the CPU never touches GPU memory.
	toGPU := func(b *devicebuf.Buffer, p []byte) {
		copy(staged, p)
		require.NoError(t, devicebuf.Copy(b, stage))
	}
	fromGPU := func(b *devicebuf.Buffer) []byte {
		clear(staged)
		require.NoError(t, devicebuf.Copy(stage, b))
		return staged
	}

	for i, size := range []int{1, 64<<10 - 1, 64 << 10, 64<<10 + 1, 1 << 20, n} {
		t.Run(sizeName(size), func(t *testing.T) {
			want := pattern(size, uint64(i+1))
			zero := make([]byte, n)

			// GPU to GPU.
			toGPU(src, want)
			toGPU(dst, zero)
			require.NoError(t, client.Put(ctx, smem, 0, size, uint64(dmem.Addr()), dkey))
			require.NoError(t, client.Flush(ctx))
			got := fromGPU(dst)
			require.True(t, bytes.Equal(want, got[:size]), "GPU to GPU")
			if size < n {
				require.Zero(t, got[size], "GPU to GPU: no byte past the put")
			}

			// Host to GPU.
			copy(hostSrc, want)
			toGPU(dst, zero)
			require.NoError(t, client.Put(ctx, hsrc, 0, size, uint64(dmem.Addr()), dkey))
			require.NoError(t, client.Flush(ctx))
			require.True(t, bytes.Equal(want, fromGPU(dst)[:size]), "host to GPU")

			// GPU to host, by put and by get.
			clear(hostDst)
			require.NoError(t, client.Put(ctx, smem, 0, size, uint64(hmem.Addr()), hkey))
			require.NoError(t, client.Flush(ctx))
			require.True(t, bytes.Equal(want, hostDst[:size]), "GPU to host")
			toGPU(dst, zero)
			copy(hostDst, want)
			require.NoError(t, client.Get(ctx, dmem, 0, size, uint64(hmem.Addr()), hkey))
			require.True(t, bytes.Equal(want, fromGPU(dst)[:size]), "get into GPU")
		})
	}
}

func unpack(t testing.TB, ep *rdma.Endpoint, m *rdma.Memory) *rdma.RemoteKey {
	t.Helper()
	packed, err := m.PackKey()
	require.NoError(t, err)
	k, err := ep.UnpackKey(packed)
	require.NoError(t, err)
	t.Cleanup(func() { k.Close() })
	return k
}
