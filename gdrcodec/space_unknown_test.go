package gdrcodec_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
)

// The mirror of TestRequestSpaceFieldUnknownToServer for responses: a call
// that succeeds may still leave a write into the client's space untaken,
// here because the client's response type has no such field (a server whose
// newer response type gained a payload field). Echo's response is a Tensor
// whose data lands in the client's space; the client decodes it as a
// Summary, where field 3 is a scalar, so the descriptor stays in unknown
// fields and the decode takes nothing. The call, numbered (its request can
// carry a payload), tells the server, which takes the range back.
func TestReceiveSpaceFieldUnknownToClient(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)
	advertise(t, r, mib)
	for i := range 6 { // more than the space holds, were the ranges not given back
		req := tensorOf(mib, uint32(60+i))
		var out tensorpb.Summary
		require.NoError(t, r.cc.Invoke(context.Background(), "/gdrpc.examples.tensor.TensorService/Echo", req, &out))
		gdrcodec.ReleaseAll(req)
		waitNothingTaken(t)
	}
	r.paths.reset()
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 3))
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}

// The same for a call whose request and response types, as the client
// knows them, cannot carry a payload: it goes unnumbered (the plain path of
// UnaryClientInterceptor), and the server writes none of Make's response
// into the client's space, where nothing would give the range back.
func TestReceiveSpacePlainCallUnknownField(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)
	advertise(t, r, mib)
	for i := range 6 { // more than the space holds, were the ranges not given back
		var out tensorpb.Summary
		require.NoError(t, r.cc.Invoke(context.Background(), "/gdrpc.examples.tensor.TensorService/Make", &tensorpb.Sized{Size: mib, Seed: uint32(70 + i)}, &out))
		waitNothingTaken(t)
	}
	r.paths.reset()
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 3))
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}
