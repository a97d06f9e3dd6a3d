package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/rdma"
)

func TestMain(m *testing.M) {
	os.Exit(leaktest.Run(m, devicebuftest.LeakCheck))
}

func pathsByName(ps []Path) map[string]Path {
	m := map[string]Path{}
	for _, p := range ps {
		m[p.Name] = p
	}
	return m
}

func TestReportFakeGPU(t *testing.T) {
	g := devicebuftest.Install(t, 2)
	g.SetAttrs(1, devicebuf.DeviceAttrs{GPUDirectRDMASupported: true, FlushWritesOptions: devicebuf.FlushWritesOptionHost})
	r := collect()
	require.Empty(t, r.NVMLError)
	require.Len(t, r.GPUs, 2)
	require.True(t, r.CUDA.Available)
	require.Len(t, r.CUDA.Devices, 2)
	require.Equal(t, g.UUID(1), r.CUDA.Devices[1].UUID)
	require.Equal(t, devicebuf.WritesOrderingNone, r.CUDA.Devices[1].Attrs.WritesOrdering)
	require.Equal(t, devicebuf.WritesOrderingOwner, r.CUDA.Devices[0].Attrs.WritesOrdering)

	ps := pathsByName(r.Paths)
	require.Len(t, ps, 4)
	require.True(t, ps["cuda-ipc"].Available)
	require.True(t, ps["stream"].Available)
	ucxErr := rdma.Available()
	require.Equal(t, ucxErr == nil, r.UCX.Available)
	require.Equal(t, ucxErr == nil, ps["rdma"].Available)
	require.Equal(t, ucxErr == nil, ps["staged"].Available)
	if ucxErr == nil {
		require.NotEmpty(t, r.UCX.Version)
		require.Contains(t, r.UCX.MemoryTypes, "host")
	}

	var text bytes.Buffer
	require.NoError(t, writeText(&text, r))
	require.Contains(t, text.String(), g.UUID(0))
	require.Contains(t, text.String(), "writes ordering none (flush needed)")
	require.Contains(t, text.String(), "cuda-ipc  available")

	var js bytes.Buffer
	require.NoError(t, writeJSON(&js, r))
	var back Report
	require.NoError(t, json.Unmarshal(js.Bytes(), &back))
	require.Equal(t, r.Paths, back.Paths)
	require.Equal(t, r.CUDA.Devices, back.CUDA.Devices)
}

func TestReportNoGPU(t *testing.T) {
	devicebuftest.InstallAbsent(t, "no libcuda.so.1")
	r := collect()
	require.False(t, r.CUDA.Available)
	require.Contains(t, r.CUDA.Error, "no libcuda.so.1")
	require.Contains(t, r.NVMLError, "not supported")
	ps := pathsByName(r.Paths)
	require.False(t, ps["cuda-ipc"].Available)
	require.Contains(t, ps["cuda-ipc"].Reason, "no CUDA")
	require.False(t, ps["staged"].Available)
	require.Contains(t, ps["staged"].Reason, "no CUDA")
	require.True(t, ps["stream"].Available)
}

func TestPaths(t *testing.T) {
	t.Setenv(rdma.DirectEnv, "") // direct copies on, as by default
	noUCX := fmt.Errorf("libucp.so.0 missing: %w", rdma.ErrNotSupported)
	noCUDA := errors.New("no driver")
	for _, c := range []struct {
		name                string
		cudaErr, ucxErr     error
		ucxCUDA             error
		ipc, rdmaOK, staged bool
		rdmaReason          string
	}{
		{"nothing", noCUDA, noUCX, noUCX, false, false, false, "no UCX"},
		{"ucx host only", noCUDA, nil, noCUDA, false, true, false, "host memory only"},
		{"cuda only", nil, noUCX, noUCX, true, false, false, "no UCX"},
		{"both, ucx without cuda", nil, nil, errors.New("UCX 1.13.1 cannot register CUDA memory"), true, true, true, "host memory only: UCX 1.13.1"},
		{"both, gpudirect", nil, nil, nil, true, true, true, "GPUDirect RDMA"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ps := pathsByName(paths(c.cudaErr, 1, c.ucxErr, c.ucxCUDA, rdma.Info{Version: "1.13.1", Transports: withSHM}))
			require.Equal(t, c.ipc, ps["cuda-ipc"].Available)
			require.Equal(t, c.rdmaOK, ps["rdma"].Available)
			require.Contains(t, ps["rdma"].Reason, c.rdmaReason)
			if c.rdmaOK {
				if off := rdma.DirectCopiesOff(); off != "" {
					// A build or a host without UCX: this process copies nothing.
					require.Contains(t, ps["rdma"].Reason, "direct copies off: "+off)
				} else {
					require.Contains(t, ps["rdma"].Reason, "straight into the receiver's UCX shared-memory segment")
				}
			}
			require.Equal(t, c.staged, ps["staged"].Available)
			require.True(t, ps["stream"].Available)
		})
	}
}

func TestPathsBetweenHostsOverTCP(t *testing.T) {
	for v, want := range map[string]string{
		"1.13.1": "transfers take the stream, from 4 MiB on the session's wide lane (TCP) (UCX 1.13.1's puts over tcp are slower",
		"1.16.0": "transfers take the stream, from 4 MiB on the session's wide lane (TCP) (UCX 1.16.0's",
		"1.18.1": "host memory under 4 MiB goes by rdma, from 4 MiB by the stream on the session's wide lane (TCP), and GPU memory staged (UCX 1.18.1's",
	} {
		for _, ucxCUDA := range []error{nil, errors.New("UCX cannot register CUDA memory")} {
			ps := pathsByName(paths(nil, 1, nil, ucxCUDA, rdma.Info{Version: v}))
			require.Contains(t, ps["rdma"].Reason, want, "UCX %s, CUDA in UCX: %v", v, ucxCUDA == nil)
		}
	}
}

// With direct copies turned off, gdrinfo says host memory goes by UCX's puts.
func TestPathsDirectOff(t *testing.T) {
	t.Setenv(rdma.DirectEnv, "false")
	ps := pathsByName(paths(errors.New("no driver"), 1, nil, errors.New("no CUDA in UCX"), rdma.Info{Version: "1.13.1"}))
	require.True(t, ps["rdma"].Available)
	require.Contains(t, ps["rdma"].Reason, "direct copies off")
}

// withSHM is what rdma.Info lists on a host whose UCX has its shared-memory
// transports.
var withSHM = []string{"self/memory0", "sysv/memory", "posix/memory", "tcp/lo"}

// Without a shared-memory transport (UCX_TLS=tcp) there is no segment to
// copy into, and with UCX handling SIGSEGV no direct copy is made: gdrinfo
// says host memory goes by UCX's puts.
func TestPathsDirectImpossible(t *testing.T) {
	t.Setenv(rdma.DirectEnv, "")
	ps := pathsByName(paths(errors.New("no driver"), 1, nil, errors.New("no CUDA in UCX"),
		rdma.Info{Version: "1.13.1", Transports: []string{"self/memory0", "tcp/lo", "tcp/eth0"}}))
	require.NotContains(t, ps["rdma"].Reason, "straight into")
	require.Contains(t, ps["rdma"].Reason, "puts over its rma lane")
	if rdma.DirectCopiesOff() == "" {
		require.Contains(t, ps["rdma"].Reason, "no UCX shared-memory transport")
	}
}
