package gdrcodec_test

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/transport"
)

// streamPart is the size of echoStreamParts' payloads: under
// StreamEagerThreshold, and streamParts-1 of them fit in StreamInlineBudget,
// streamParts not.
const (
	streamPart  = 120 << 10
	streamParts = 9
)

// echoParts echoes a message of host payloads of the sizes given and checks
// the bytes that came back.
func echoParts(t *testing.T, r *rig, sizes ...int) {
	t.Helper()
	parts := make([]*gdrv1.DeviceBuffer, len(sizes))
	var want []byte
	for i, n := range sizes {
		p := pattern(n, uint32(i))
		want = append(want, p...)
		b := devicebuf.HostFromBytes(p)
		parts[i] = gdrcodec.New(b)
		b.Release()
	}
	in := &tensorpb.Tensor{Name: "parts", Parts: parts}
	out, err := r.client.Echo(context.Background(), in)
	require.NoError(t, err)
	require.Len(t, out.Parts, len(parts))
	var got []byte
	for _, db := range out.Parts {
		p, err := tensor.Bytes(db)
		require.NoError(t, err)
		got = append(got, p...)
	}
	requireBytes(t, want, got)
	gdrcodec.ReleaseAll(in)
	gdrcodec.ReleaseAll(out)
}

// echoStreamParts echoes a message of streamParts payloads of streamPart.
func echoStreamParts(t *testing.T, r *rig) {
	t.Helper()
	echoParts(t, r, slices.Repeat([]int{streamPart}, streamParts)...)
}

// Over a TCP session, host payloads under StreamEagerThreshold travel inline
// while those of one message fit in StreamInlineBudget; the rest go
// out-of-band. TestOutOfBand checks a single payload on either side of the
// threshold.
func TestStreamEagerThreshold(t *testing.T) {
	require.Less(t, streamPart, gdrcodec.StreamEagerThreshold)
	require.LessOrEqual(t, (streamParts-1)*streamPart, gdrcodec.StreamInlineBudget)
	require.Greater(t, streamParts*streamPart, gdrcodec.StreamInlineBudget)
	r := newRig(t, transport.ModeTCP, nil)
	echoStreamParts(t, r)
	require.Equal(t, map[string]int{"stream": 2}, r.paths.reset(), "one payload of the request and one of the response out-of-band")
}

// The budget counts the payloads that travel inline anyway: a message whose
// payloads under DefaultEagerThreshold fill it sends its larger ones
// out-of-band, as it did before the stream threshold (a message that fit
// under gRPC's receive limit still does).
func TestStreamInlineBudgetCountsSmallPayloads(t *testing.T) {
	const small = gdrcodec.DefaultEagerThreshold - 1
	n := gdrcodec.StreamInlineBudget/small + 1 // their bytes over the budget
	// The last under StreamEagerThreshold, over the budget left.
	sizes := append(slices.Repeat([]int{small}, n), streamPart)
	r := newRig(t, transport.ModeTCP, nil)
	echoParts(t, r, sizes...)
	require.Equal(t, map[string]int{"stream": 2}, r.paths.reset(), "the large payload out-of-band each way")
}

// An eager threshold the application set applies over TCP sessions too.
func TestStreamEagerThresholdExplicit(t *testing.T) {
	gdrcodec.Register(gdrcodec.WithEagerThreshold(gdrcodec.DefaultEagerThreshold))
	t.Cleanup(func() { gdrcodec.Register() })
	r := newRig(t, transport.ModeTCP, nil)
	echoStreamParts(t, r)
	require.Equal(t, map[string]int{"stream": 2 * streamParts}, r.paths.reset(), "every payload out-of-band")
}

// net/rpc over a TCP session follows the same threshold: its codec knows the
// conn's session.
func TestNetRPCStreamEagerThreshold(t *testing.T) {
	client, server := &advertisedCounter{}, &advertisedCounter{}
	tcp := gdrpc.WithTransport(transport.ModeTCP)
	c := netRPCPair(t, []gdrpc.Option{tcp, gdrpc.WithMetrics(server)}, []gdrpc.Option{tcp, gdrpc.WithMetrics(client)})
	for _, n := range []int{gdrcodec.StreamEagerThreshold - 1, gdrcodec.StreamEagerThreshold} {
		want := pattern(n, 6)
		b := devicebuf.HostFromBytes(want)
		req := &tensorpb.Tensor{Data: gdrcodec.New(b)}
		b.Release()
		var sum tensorpb.Summary
		require.NoError(t, c.Call("Tensors.Digest", req, &sum))
		require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)
		gdrcodec.ReleaseAll(req)

		var got tensorpb.Tensor
		require.NoError(t, c.Call("Tensors.Make", &tensorpb.Sized{Size: uint64(n), Seed: 6}, &got))
		p, err := tensor.Bytes(got.Data)
		require.NoError(t, err)
		requireBytes(t, want, p)
		gdrcodec.ReleaseAll(&got)
	}
	require.Equal(t, int64(1), server.pulled.Load(), "the server pulled the request at the threshold alone")
	require.Equal(t, int64(1), client.pulled.Load(), "the client pulled the reply at the threshold alone")
}
