package gdrcodec_test

import (
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/transport"
)

// TestProtoCodecCallsBindNothing: calls over a gdrpc session that use the
// proto codec (a client made with the dialer alone, or one that forces its
// codec) get their payloads inline and leave no response bound to a
// destination. Only the gdr codec's marshal takes a binding: one made for
// another codec's call kept the call's context, its whole server stream,
// until the binding's lease ended.
func TestProtoCodecCallsBindNothing(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	ctx := context.Background()
	protoCodec := grpc.ForceCodecV2(grpcProto)
	before := gdrcodec.DestinationsForTest()
	payload := pattern(4096, 7)
	for i := range 8 {
		got, err := r.client.Echo(ctx, &tensorpb.Tensor{Name: "p", Data: &gdrv1.DeviceBuffer{Length: uint64(len(payload)), Inline: payload}}, protoCodec)
		require.NoError(t, err, "call %d", i)
		require.Equal(t, payload, got.GetData().GetInline(), "call %d", i)
		require.Equal(t, before, gdrcodec.DestinationsForTest(), "call %d left a binding", i)
	}
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: 4096, Seed: 3}, protoCodec)
	require.NoError(t, err)
	for i := range uint32(4) {
		got, err := st.Recv()
		require.NoError(t, err, "message %d", i)
		want := make([]byte, 4096)
		tensor.Fill(want, 3+i)
		require.Equal(t, want, got.GetData().GetInline(), "message %d", i)
	}
	_, err = st.Recv()
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, before, gdrcodec.DestinationsForTest(), "the stream's messages left bindings")

	// The gdr codec's calls, alongside, take theirs.
	got, err := r.client.Make(ctx, &tensorpb.Sized{Size: 4096, Seed: 5})
	require.NoError(t, err)
	buf, ok := gdrcodec.Buffer(got.GetData())
	require.True(t, ok)
	arrived, err := buf.HostBytes()
	require.NoError(t, err)
	want := make([]byte, 4096)
	tensor.Fill(want, 5)
	require.Equal(t, want, arrived)
	gdrcodec.ReleaseAll(got)
	// At most as many as before: its binding's put may also sweep out an
	// earlier test's expired ones.
	require.LessOrEqual(t, gdrcodec.DestinationsForTest(), before)
}
