package gdrcodec

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/oob"
)

// noted is what the codec's bookkeeping noted of messages being received
// and sent when a stream below the codec's wrappers was called.
type noted struct{ receiving, sending int }

func notedNow() noted {
	r, s := TrackedForTest()
	return noted{r, s}
}

// probeStream is the stream gRPC would hand the codec's wrappers: each call
// records what was noted as it ran.
type probeStream struct {
	grpc.ClientStream
	grpc.ServerStream
	sent, received []noted
}

func (p *probeStream) SendMsg(any) error        { p.sent = append(p.sent, notedNow()); return nil }
func (p *probeStream) RecvMsg(any) error        { p.received = append(p.received, notedNow()); return nil }
func (p *probeStream) Context() context.Context { return context.Background() }

// The stream wrappers note the messages whose type can carry a payload as
// they are sent and received, and no other: a plain message's send or
// receive leaves nothing to look up or forget.
func TestStreamPlainMessagesUnnoted(t *testing.T) {
	plain, carrying := &healthpb.HealthCheckResponse{}, &tensorpb.Tensor{}

	client := &probeStream{}
	hs := &heldStream{ClientStream: client, ctx: context.Background(), h: &hold{rc: &recvCall{ctx: context.Background()}},
		cancel: func() {}, call: oob.NewCall(), serverStreams: true}
	for _, m := range []any{plain, carrying} {
		require.NoError(t, hs.SendMsg(m))
		require.NoError(t, hs.RecvMsg(m))
	}
	require.Equal(t, []noted{{0, 0}, {0, 1}}, client.sent, "a client stream's sends")
	require.Equal(t, []noted{{0, 0}, {1, 0}}, client.received, "a client stream's receives")

	server := &probeStream{}
	rs := &requestStream{ServerStream: server, gdr: true}
	for _, m := range []any{plain, carrying} {
		require.NoError(t, rs.RecvMsg(m))
	}
	require.Equal(t, []noted{{0, 0}, {1, 0}}, server.received, "a server stream's receives")
	require.Equal(t, noted{}, notedNow(), "notes left")
}
