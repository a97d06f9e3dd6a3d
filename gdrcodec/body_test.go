package gdrcodec

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	encproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// grpcProto is gRPC's own proto codec, taken before any test's Register
// replaces it in the registry.
var grpcProto = encoding.GetCodecV2(encproto.Name)

// pieces splits b as gRPC's transport hands a received body over: in
// buffers of at most 16 KiB (an HTTP/2 frame).
func pieces(b []byte) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		n := min(len(b), 16<<10)
		s = append(s, mem.SliceBuffer(bytes.Clone(b[:n])))
		b = b[n:]
	}
	return s
}

// TestBodyCodecAsGRPCs: the body codec encodes every size, across the pool's
// tiers and past its largest, to gRPC's codec's bytes, and decodes a body
// received in pieces to the message sent.
func TestBodyCodecAsGRPCs(t *testing.T) {
	require.IsNotType(t, &codec{}, grpcProto, "the registry held this package's codec before the tests ran")
	for _, n := range []int{0, 1, 1000, 1 << 10, 4<<10 + 1, 32 << 10, 32<<10 + 1, 40 << 10, 64<<10 - 1, 1<<20 - 8, 1 << 20, 3<<20 + 5} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			msg := wrapperspb.Bytes(bodyPattern(n))
			want, err := grpcProto.Marshal(msg)
			require.NoError(t, err)
			defer want.Free()
			got, err := bodies.Marshal(msg)
			require.NoError(t, err)
			wire := got.Materialize()
			got.Free()
			require.Equal(t, want.Materialize(), wire)

			out := new(wrapperspb.BytesValue)
			in := pieces(wire)
			require.NoError(t, bodies.Unmarshal(in, out))
			in.Free()
			require.True(t, proto.Equal(msg, out), "decoded message differs from the one sent")
		})
	}
	_, err := bodies.Marshal(struct{}{})
	require.Error(t, err)
	require.Error(t, bodies.Unmarshal(pieces([]byte{1}), struct{}{}))
}

// TestBodyCallNumber: a call number goes first in the body, across the
// pool's tiers; a numbered decode takes it off and returns it, leaving the
// message as sent (no unknown field), and a body without one decodes to 0.
// A plain decode (the proto replacement's, a plain peer's) keeps it as an
// unknown field. A malformed number is refused with InvalidArgument.
func TestBodyCallNumber(t *testing.T) {
	for _, n := range []int{0, 1000, 32<<10 + 1, 1 << 20} {
		for _, call := range []uint64{1, 0x1234, 1<<64 - 1} {
			t.Run(fmt.Sprintf("%d/%x", n, call), func(t *testing.T) {
				msg := wrapperspb.Bytes(bodyPattern(n))
				data, err := bodies.marshal(msg, call)
				require.NoError(t, err)
				wire := data.Materialize()
				data.Free()
				plain, err := proto.Marshal(msg)
				require.NoError(t, err)
				require.True(t, bytes.HasSuffix(wire, plain), "the message's own bytes follow the number")
				require.Greater(t, len(wire), len(plain), "no number")

				out := new(wrapperspb.BytesValue)
				got, err := bodies.unmarshal(pieces(wire), out, true)
				require.NoError(t, err)
				require.Equal(t, call, got)
				require.True(t, proto.Equal(msg, out), "decoded message differs from the one sent")
				require.Empty(t, out.ProtoReflect().GetUnknown(), "the number stayed in the message")

				got, err = bodies.unmarshal(pieces(plain), out, true)
				require.NoError(t, err)
				require.Zero(t, got, "a body without a number")
				require.True(t, proto.Equal(msg, out))

				require.NoError(t, bodies.Unmarshal(pieces(wire), out))
				require.True(t, bytes.Equal(msg.GetValue(), out.GetValue()), "the plain decode lost the message")
				require.NotEmpty(t, out.ProtoReflect().GetUnknown(), "a plain decode dropped the number")
			})
		}
	}
	head := protowire.AppendTag(nil, callField, protowire.VarintType)
	for _, bad := range [][]byte{head, append(head, 0x80), append(head, bytes.Repeat([]byte{0xff}, 10)...)} {
		_, err := bodies.unmarshal(pieces(bad), new(wrapperspb.BytesValue), true)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%x: %v", bad, err)
	}
}

// BenchmarkBody marshals a message whose body is a little over 32 KiB (an
// inline payload under the eager threshold) and decodes it from 16 KiB
// pieces, as a call carries it, with gRPC's codec and with the body codec.
func BenchmarkBody(b *testing.B) {
	msg := wrapperspb.Bytes(bodyPattern(40 << 10))
	for _, tc := range []struct {
		name  string
		codec interface {
			Marshal(any) (mem.BufferSlice, error)
			Unmarshal(mem.BufferSlice, any) error
		}
	}{{"grpc", grpcProto}, {"gdrcodec", bodies}} {
		b.Run("codec="+tc.name+"/size=40KiB", func(b *testing.B) {
			wire, err := proto.Marshal(msg)
			if err != nil {
				b.Fatal(err)
			}
			in := pieces(wire)
			var out wrapperspb.BytesValue
			b.SetBytes(40 << 10)
			b.ReportAllocs()
			for b.Loop() {
				data, err := tc.codec.Marshal(msg)
				if err != nil {
					b.Fatal(err)
				}
				data.Free() // as gRPC does once it sent the body
				if err := tc.codec.Unmarshal(in, &out); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// bodyPattern is n bytes that differ from their neighbours.
func bodyPattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i>>8)
	}
	return b
}
