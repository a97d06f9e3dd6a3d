package gdrcodec

import (
	"fmt"

	"google.golang.org/grpc/mem"
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

// Marshal encodes v: into a buffer of its own below gRPC's pooling threshold,
// else into one of bodyPool's, which gRPC gives back once it sent the body.
func (bodyCodec) Marshal(v any) (mem.BufferSlice, error) {
	vv := messageV2Of(v)
	if vv == nil {
		return nil, fmt.Errorf("proto: failed to marshal, message is %T, want proto.Message", v)
	}
	// UseCachedSize reuses the size just computed: v must not change
	// meanwhile, as for gRPC's codec.
	size := proto.Size(vv)
	opts := proto.MarshalOptions{UseCachedSize: true}
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf, err := opts.Marshal(vv)
		if err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	buf := bodyPool.Get(size)
	if _, err := opts.MarshalAppend((*buf)[:0], vv); err != nil {
		bodyPool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, bodyPool)}, nil
}

// Unmarshal decodes data into v, gathering a body that arrived in several
// buffers (HTTP/2 frames) into one of bodyPool's first.
func (bodyCodec) Unmarshal(data mem.BufferSlice, v any) error {
	vv := messageV2Of(v)
	if vv == nil {
		return fmt.Errorf("failed to unmarshal, message is %T, want proto.Message", v)
	}
	buf := data.MaterializeToBuffer(bodyPool)
	defer buf.Free()
	return proto.Unmarshal(buf.ReadOnlyData(), vv)
}
