package gdrcodec

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/encoding"
	encproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
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
