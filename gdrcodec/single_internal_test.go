package gdrcodec

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
)

// TestSingleRequestScope: a server's request is refused a second decode
// only while gRPC's receive of it runs (its check for a second message): a
// client codec's decode into it (a handler passing its request as a reply),
// and any decode once the receive returned (endSingleRequest: a handler that
// recycles requests), are the application's.
func TestSingleRequestScope(t *testing.T) {
	req := &tensorpb.Tensor{}
	singleRequests.Store(req, struct{}{})
	defer singleRequests.Delete(req)
	body, err := proto.Marshal(&tensorpb.Tensor{Name: "x"})
	require.NoError(t, err)
	decode := func(c *codec) error { return c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(body)}, req) }

	require.NoError(t, decode(&codec{name: Name, oob: true, client: true}), "a client's decode")
	require.Equal(t, "x", req.GetName())
	require.ErrorContains(t, decode(&codec{name: Name, oob: true}), "a second request message")

	ctx := context.WithValue(context.Background(), callKey{}, &callMessages{request: req})
	endSingleRequest(ctx)
	require.False(t, isSingleRequest(req))
	require.NoError(t, decode(&codec{name: Name, oob: true}), "a decode after the receive returned")
}
