package gdrcodec_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// wireCodec sends []byte bodies as they are, under the gdr codec's name, and
// receives bodies as bytes: a client that writes its own wire.
type wireCodec struct{}

func (wireCodec) Name() string { return gdrcodec.Name }

func (wireCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(v.([]byte))}, nil
}

func (wireCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

// TestSecondRequestFilesNothing: a client that sends a second message on
// calls that take one (unary Echo and Make), while calls of the same request
// types wait for their requests, gets the call refused, and the codec files
// nothing process-wide for the second message's decode (no stats event
// follows it: a filed message, up to the message size limit, stayed until a
// sweep a minute or two later). Echo's second message is a malformed call
// number (a failed decode's status); Make's a request that cannot carry a
// payload with a call number (its pulls, for the stats handler).
func TestSecondRequestFilesNothing(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	raw := grpc.ForceCodecV2(wireCodec{})
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	echo, make := tensorpb.TensorService_Echo_FullMethodName, tensorpb.TensorService_Make_FullMethodName
	for _, m := range []string{echo, make} {
		_, err := r.cc.NewStream(ctx, desc, m, raw) // headers, no request
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		return gdrcodec.DecodingForTest("gdrpc.examples.tensor.Tensor") && gdrcodec.DecodingForTest("gdrpc.examples.tensor.Sized")
	}, 10*time.Second, time.Millisecond)
	number := protowire.AppendVarint(protowire.AppendTag(nil, 19061, protowire.VarintType), 77)
	tensor, err := proto.Marshal(&tensorpb.Tensor{Name: strings.Repeat("x", 64<<10)})
	require.NoError(t, err)
	sized, err := proto.Marshal(&tensorpb.Sized{Size: 1})
	require.NoError(t, err)
	sized = append(append([]byte(nil), number...), sized...)
	malformed := append(protowire.AppendTag(nil, 19061, protowire.VarintType), 0x80)
	before := gdrcodec.FiledDecodesForTest()
	for range 5 {
		for _, c := range []struct {
			method        string
			first, second []byte
		}{{echo, tensor, malformed}, {make, sized, sized}} {
			cctx, ccancel := context.WithTimeout(ctx, 20*time.Second)
			st, err := r.cc.NewStream(cctx, desc, c.method, raw)
			require.NoError(t, err)
			require.NoError(t, st.SendMsg(c.first))
			require.NoError(t, st.SendMsg(c.second))
			require.NoError(t, st.CloseSend())
			var out []byte
			for err == nil {
				err = st.RecvMsg(&out)
			}
			ccancel()
			require.NotEqual(t, codes.OK, status.Code(err), "%s: the call is refused", c.method)
			require.NotEqual(t, codes.DeadlineExceeded, status.Code(err), "%s: %v", c.method, err)
		}
	}
	// The server decoded each second message before it sent its status.
	require.Equal(t, before, gdrcodec.FiledDecodesForTest(), "decodes filed for nobody")
}
