package gdrcodec

import (
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// bodyCodec encodes message bodies as gRPC's own proto codec does (the same
// bytes, the same buffers below gRPC's pooling threshold), drawing the
// buffers it pools from bodyPool instead of gRPC's default pool.
//
// gRPC's default pool has tiers of 256 B, 4, 16 and 32 KiB, then 1 MiB, and
// clears a buffer's whole capacity each time it hands one out: with it, a body
// a little over 32 KiB (an inline payload under the eager threshold) clears
// 1 MiB when it is marshaled and again when it is received. bodyPool's tiers
// are every power of two up to 1 MiB, so a clear costs at most twice the body.
type bodyCodec struct{}

// bodyPool is bodyCodec's buffer pool; bodies over 1 MiB get buffers of their
// own size, as from gRPC's default pool.
var bodyPool = newBodyPool()

func newBodyPool() mem.BufferPool {
	const smallest, largest = 8, 20 // 256 B to 1 MiB
	var exponents []uint8
	for e := uint8(smallest); e <= largest; e++ {
		exponents = append(exponents, e)
	}
	p, err := mem.NewBinaryTieredBufferPool(exponents...)
	if err != nil {
		panic(fmt.Sprintf("gdrcodec: body buffer pool: %v", err))
	}
	return p
}

// callField is the field that carries a unary request's call number (what
// oob.CallHeader carries for a stream) in the gdr codec's body: first, before
// the message's own fields, where a receiver of the gdr codec takes it off
// before it decodes the message. A header costs both ends of every call
// more than the body's few bytes (gRPC copies and encodes the outgoing
// metadata, and the server builds it into the call's). Protobuf reserves
// the numbers 19000 to 19999 to its implementations, so no message declares
// this one.
const callField protowire.Number = 19061

// Marshal encodes v: into a buffer of its own below gRPC's pooling threshold,
// else into one of bodyPool's, which gRPC gives back once it sent the body.
func (b bodyCodec) Marshal(v any) (mem.BufferSlice, error) { return b.marshal(v, 0) }

// marshal is Marshal with call, unless 0, first in the body (callField).
func (b bodyCodec) marshal(v any, call uint64) (mem.BufferSlice, error) {
	return b.marshalPatched(v, call, nil)
}

// marshalPatched is marshal with patches appended to v's encoding.
func (bodyCodec) marshalPatched(v any, call uint64, patches []patch) (mem.BufferSlice, error) {
	vv := messageV2Of(v)
	if vv == nil {
		return nil, fmt.Errorf("proto: failed to marshal, message is %T, want proto.Message", v)
	}
	var head []byte
	if call != 0 {
		head = protowire.AppendVarint(protowire.AppendTag(make([]byte, 0, 16), callField, protowire.VarintType), call)
	}
	// UseCachedSize reuses the size just computed: v must not change
	// meanwhile, as for gRPC's codec.
	size := len(head) + proto.Size(vv)
	var sizes [maxPatches][maxPatchDepth]int
	for i := range patches {
		if patches[i].out != nil {
			size += patches[i].size(&sizes[i])
		}
	}
	opts := proto.MarshalOptions{UseCachedSize: true}
	encode := func(b []byte) ([]byte, error) {
		b, err := opts.MarshalAppend(append(b, head...), vv)
		for i := range patches {
			if err == nil && patches[i].out != nil {
				b, err = patches[i].appendTo(b, &sizes[i])
			}
		}
		return b, err
	}
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf, err := encode(make([]byte, 0, size))
		if err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	buf := bodyPool.Get(size)
	if _, err := encode((*buf)[:0]); err != nil {
		bodyPool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, bodyPool)}, nil
}

// Unmarshal decodes data into v, gathering a body that arrived in several
// buffers (HTTP/2 frames) into one of bodyPool's first.
func (b bodyCodec) Unmarshal(data mem.BufferSlice, v any) error {
	_, err := b.unmarshal(data, v, false)
	return err
}

// unmarshal is Unmarshal that, if numbered, first takes off a call number
// the body begins with (callField) and returns it, or 0.
func (bodyCodec) unmarshal(data mem.BufferSlice, v any, numbered bool) (call uint64, err error) {
	vv := messageV2Of(v)
	if vv == nil {
		return 0, fmt.Errorf("failed to unmarshal, message is %T, want proto.Message", v)
	}
	buf := data.MaterializeToBuffer(bodyPool)
	defer buf.Free()
	body := buf.ReadOnlyData()
	if numbered {
		if num, typ, n := protowire.ConsumeTag(body); n > 0 && num == callField && typ == protowire.VarintType {
			c, m := protowire.ConsumeVarint(body[n:])
			if m < 0 {
				return 0, codecError(codes.InvalidArgument, "the body's call number is malformed: %v", protowire.ParseError(m))
			}
			call, body = c, body[n+m:]
		}
	}
	if err := precount(body, vv.ProtoReflect().Descriptor()); err != nil {
		return call, err
	}
	return call, proto.Unmarshal(body, vv)
}
