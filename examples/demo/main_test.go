package main

import (
	"bytes"
	"context"
	"os"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/oobleak"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "-serve" {
		main() // this test binary was started again as the demo's server
		os.Exit(0)
	}
	before := runtime.NumGoroutine()
	// Sessions linger briefly after their connection closed: Settled waits, bounded.
	os.Exit(leaktest.Run(m, func() error { return oobleak.Settled(before) }))
}

// TestDemo runs what "make demo" runs: the default transport (UCX where it
// is usable, else TCP).
func TestDemo(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("moves 64 MiB a dozen times: not under -short or -race")
	}
	want := "(path rdma, session over ucx)"
	if err := rdma.Available(); err != nil {
		if testenv.Required("ucx") {
			t.Fatalf("UCX required: %v", err)
		}
		want = "(path stream, session over tcp)"
	}
	t.Setenv(transport.EnvTransport, "auto") // the server inherits it
	gdrcodec.Register()
	var out bytes.Buffer
	require.NoError(t, run(&out))
	s := out.String()
	require.Contains(t, s, "A 64 MiB payload from a gRPC server in another process (median of 5 calls, checksums verified)")
	require.Contains(t, s, want)
	require.Regexp(t, `plain gRPC over TCP, inline:\s+[0-9.]+ ms\s+[0-9]+ MiB/s`, s)
	require.Regexp(t, `gdrpc is [0-9.]+x plain gRPC`, s)
}

// corrupting answers Make with the right payload on its first call and a
// zeroed one on its call number bad.
type corrupting struct {
	tensorpb.TensorServiceClient
	calls, bad int
	good       []byte
}

func (c *corrupting) Make(context.Context, *tensorpb.Sized, ...grpc.CallOption) (*tensorpb.Tensor, error) {
	c.calls++
	data := c.good
	if c.calls == c.bad {
		data = make([]byte, size)
	}
	return &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Kind: gdrv1.Kind_KIND_HOST, Length: uint64(len(data)), Inline: data}}, nil
}

// Every call the demo times has its payload checked ("checksums verified"),
// not only the untimed first.
func TestTimedCallsVerified(t *testing.T) {
	good := make([]byte, size)
	tensor.Fill(good, seed)
	want := tensor.ChecksumBytes(good)
	_, err := timeCalls(&corrupting{good: good}, &tensorpb.Sized{Size: size, Seed: seed}, want)
	require.NoError(t, err)
	for _, bad := range []int{1, 2, calls + 1} {
		_, err := timeCalls(&corrupting{good: good, bad: bad}, &tensorpb.Sized{Size: size, Seed: seed}, want)
		require.ErrorContains(t, err, "want 67108864 bytes", "call %d's payload was zeros", bad)
	}
}
