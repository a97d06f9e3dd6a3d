package gdrcodec_test

import (
	"context"
	"testing"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/stretchr/testify/require"
)

// Payloads received into GPU memory over CUDA IPC are freed when released: the
// owner's mapping of the receiver's allocation ends with the transfer, so once the
// calls are over (and the client released what it received) no GPU buffer, byte
// or IPC mapping is left, while the sessions live on.
func TestGPUBuffersFreedOnRelease(t *testing.T) {
	devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	r := newRig(t, transport.ModeTCP, &tensor.Server{Alloc: gpu})
	transport.SetTransferConfig(transport.TransferConfig{Metrics: r.paths, Paths: transport.PathCUDAIPC})
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	t.Cleanup(func() { gdrcodec.Register() })

	const calls, n = 40, 1 << 20
	want := tensor.ChecksumBytes(pattern(n, 7))
	base := devicebuf.Live()
	for range calls {
		got, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: n, Seed: 7})
		require.NoError(t, err)
		sum, err := r.client.Digest(context.Background(), got)
		require.NoError(t, err)
		require.Equal(t, want, sum.Crc32C)
		gdrcodec.ReleaseAll(got)
	}
	require.Equal(t, map[string]int{"cuda-ipc": 2 * calls}, r.paths.reset())
	left := devicebuf.Live().Sub(base)
	require.Zero(t, left.CUDABuffers, "GPU buffers left: %+v", left)
	require.Zero(t, left.CUDABytes, "GPU bytes left: %+v", left)
	require.Zero(t, left.IPCMappings, "IPC mappings left: %+v", left)
}
