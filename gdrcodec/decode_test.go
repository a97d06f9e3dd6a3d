package gdrcodec_test

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"runtime"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// inlineInto registers the codec with received inline payloads placed in
// the fake GPU's memory, so that what a decode allocates shows.
func inlineIntoGPU(t *testing.T) *devicebuftest.GPU {
	g := devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	t.Cleanup(func() { gdrcodec.Register() })
	return g
}

// decode marshals m as a peer would send it and decodes it with the gdr
// codec into got.
func decode(t *testing.T, m proto.Message, got proto.Message) error {
	t.Helper()
	body, err := proto.Marshal(m)
	require.NoError(t, err)
	return gdrcodec.UnmarshalForTest(body, got)
}

// A malformed descriptor: an owner, and a token one byte short.
func malformed() *gdrv1.DeviceBuffer {
	return &gdrv1.DeviceBuffer{Length: 4, Owner: make([]byte, 16), Token: make([]byte, 15)}
}

// A message whose decode fails after some of its inline payloads were
// placed gives them back: nothing stays attached or allocated.
func TestFailedDecodeReleasesPayloads(t *testing.T) {
	g := inlineIntoGPU(t)
	attached, allocs := gdrcodec.Attached(), g.Allocations()
	m := &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: 3, Inline: []byte("abc")}}
	for range 8 {
		m.Parts = append(m.Parts, &gdrv1.DeviceBuffer{Kind: gdrv1.Kind_KIND_CUDA, Length: 1024, Inline: make([]byte, 1024)})
	}
	m.Parts = append(m.Parts, malformed())
	var got tensorpb.Tensor
	err := decode(t, m, &got)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Equal(t, attached, gdrcodec.Attached(), "attachments left by a failed decode")
	require.Equal(t, allocs, g.Allocations(), "GPU allocations left by a failed decode")
}

// A decode into a value that holds an earlier decode's payloads (a stream's
// messages received into one value) releases them first: the decode resets
// the value, and nothing else could.
func TestDecodeIntoUsedValue(t *testing.T) {
	g := inlineIntoGPU(t)
	allocs := g.Allocations()
	m := &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Kind: gdrv1.Kind_KIND_CUDA, Length: 3, Inline: []byte("abc")}}
	var got tensorpb.Tensor
	require.NoError(t, decode(t, m, &got))
	require.NoError(t, decode(t, m, &got))
	require.Equal(t, allocs+1, g.Allocations(), "the first decode's payload is freed")
	gdrcodec.ReleaseAll(&got)
	require.Equal(t, allocs, g.Allocations())
}

// A message carries at most MaxPayloads payloads; one with more fails with
// ResourceExhausted, and what was placed before the count ran out is given
// back.
func TestMaxPayloads(t *testing.T) {
	attached := gdrcodec.Attached()
	m := &tensorpb.Tensor{}
	for range gdrcodec.MaxPayloads {
		m.Parts = append(m.Parts, &gdrv1.DeviceBuffer{Length: 1, Inline: []byte{1}})
	}
	var got tensorpb.Tensor
	require.NoError(t, decode(t, m, &got))
	require.Equal(t, attached, gdrcodec.Attached(), "an inline payload stays in its message: nothing to attach")
	for i, db := range got.Parts {
		b, ok := gdrcodec.Buffer(db)
		require.True(t, ok, "part %d", i)
		hb, err := b.HostBytes()
		require.NoError(t, err)
		require.Equal(t, []byte{1}, hb, "part %d", i)
	}
	gdrcodec.ReleaseAll(&got)
	require.Equal(t, attached, gdrcodec.Attached())

	// Empty payloads of a GPU count too: each would be an attachment.
	m.Parts = append(m.Parts, &gdrv1.DeviceBuffer{Kind: gdrv1.Kind_KIND_CUDA})
	err := decode(t, m, &got)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Equal(t, attached, gdrcodec.Attached())
}

// An empty inline payload of a GPU arrives as an empty buffer without an
// allocation (a GPU allocator refuses 0 bytes); an inline payload of a kind
// gdrpc does not know is refused.
func TestEmptyAndUnknownInlinePayloads(t *testing.T) {
	g := inlineIntoGPU(t)
	allocs := g.Allocations()
	var got tensorpb.Tensor
	m := &tensorpb.Tensor{Parts: []*gdrv1.DeviceBuffer{
		{Kind: gdrv1.Kind_KIND_CUDA},
		{Kind: gdrv1.Kind_KIND_CUDA, Length: 1, Inline: []byte{7}},
	}}
	require.NoError(t, decode(t, m, &got))
	empty, ok := gdrcodec.Buffer(got.Parts[0])
	require.True(t, ok)
	require.Zero(t, empty.Len())
	one, ok := gdrcodec.Buffer(got.Parts[1])
	require.True(t, ok)
	require.Equal(t, devicebuf.CUDA, one.Kind())
	require.Equal(t, allocs+1, g.Allocations(), "one allocation, for the byte")
	gdrcodec.ReleaseAll(&got)

	m.Parts[1].Kind = gdrv1.Kind(7)
	err := decode(t, m, &got)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Equal(t, allocs, g.Allocations())
}

// A DeviceBuffer with a length and neither inline bytes nor an out-of-band
// payload (what gRPC's own proto codec makes of a buffer attached with New)
// is refused with a status that says how a client sends a payload.
func TestLengthWithoutPayloadExplained(t *testing.T) {
	var got tensorpb.Tensor
	err := decode(t, &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: 4 << 20}}, &got)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.ErrorContains(t, err, "a DeviceBuffer of 4194304 bytes arrived with no inline bytes")
	require.ErrorContains(t, err, "gdrcodec.Register")
	err = decode(t, &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: 4, Inline: []byte{1}}}, &got)
	require.ErrorContains(t, err, "inline payload of 1 bytes, descriptor says 4")
}

// A message whose pulls fail keeps no token or owner in its descriptors: a
// handler that logs or forwards what it received (a server stream's gets the
// message with the error) does not leak the capabilities it named.
func TestFailedPullsForgetTokens(t *testing.T) {
	forged := func() *gdrv1.DeviceBuffer {
		owner, token := make([]byte, 16), make([]byte, 16)
		_, _ = rand.Read(owner) // an owner with no session here: the pull fails
		_, _ = rand.Read(token)
		return &gdrv1.DeviceBuffer{Owner: owner, Token: token, Length: 1 << 20, Kind: gdrv1.Kind_KIND_HOST}
	}
	m := &tensorpb.Tensor{Data: forged()}
	for range 20 { // more than one message's pulls run at once: some are discarded unstarted
		m.Parts = append(m.Parts, forged())
	}
	var got tensorpb.Tensor
	err := decode(t, m, &got)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	for i, db := range append([]*gdrv1.DeviceBuffer{got.Data}, got.Parts...) {
		require.Nil(t, db.GetToken(), "payload %d's token", i)
		require.Nil(t, db.GetOwner(), "payload %d's owner", i)
	}
}

// A message refused part-way through its walk (a malformed descriptor)
// forgets the tokens and owners of the payloads after the one it stopped at
// too, though it never pulls them.
func TestRefusedMessageForgetsLaterTokens(t *testing.T) {
	named := func() *gdrv1.DeviceBuffer {
		owner, token := make([]byte, 16), make([]byte, 16)
		_, _ = rand.Read(owner)
		_, _ = rand.Read(token)
		return &gdrv1.DeviceBuffer{Owner: owner, Token: token, Length: 1 << 20, Kind: gdrv1.Kind_KIND_HOST}
	}
	malformed := named()
	malformed.Token = malformed.Token[:5]
	m := &tensorpb.Tensor{Parts: []*gdrv1.DeviceBuffer{named(), malformed, named(), named()}}
	var got tensorpb.Tensor
	err := decode(t, m, &got)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Len(t, got.Parts, 4)

	// A marked bytes field after the bad payload (data, then blob, in
	// field order): its descriptor goes too.
	desc, err := proto.Marshal(named())
	require.NoError(t, err)
	withBlob := &tensorpb.Tensor{Data: malformed, Blob: append([]byte("\x00\xffgdrpc\x00\x01"), desc...)}
	var got2 tensorpb.Tensor
	err = decode(t, withBlob, &got2)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Empty(t, got2.Blob, "the bytes field's descriptor")
	for i, db := range got.Parts {
		if i == 1 {
			continue // not a descriptor: nothing in it names a payload
		}
		require.Nil(t, db.GetToken(), "payload %d's token", i)
		require.Nil(t, db.GetOwner(), "payload %d's owner", i)
	}
}

// A message's inline payloads placed in a receive allocator that is not
// host memory share one allocation, each a view of its own, aligned: a
// block, a copy and a registration for each of thousands of one-byte
// payloads would take far more of the allocator (a pool's blocks are 64 KiB
// and up) than the message carries. The allocation goes once every view
// went, a payload detached from the message included.
func TestInlinePayloadsShareAllocation(t *testing.T) {
	g := inlineIntoGPU(t)
	allocs := g.Allocations()
	m := &tensorpb.Tensor{}
	for i := range gdrcodec.MaxPayloads {
		m.Parts = append(m.Parts, &gdrv1.DeviceBuffer{Kind: gdrv1.Kind_KIND_CUDA, Length: 1 + uint64(i%3), Inline: bytes.Repeat([]byte{byte(i)}, 1+i%3)})
	}
	var got tensorpb.Tensor
	require.NoError(t, decode(t, m, &got))
	require.Equal(t, allocs+1, g.Allocations(), "one allocation for the message's inline payloads")
	var base uintptr
	for i, db := range got.Parts {
		b, ok := gdrcodec.Buffer(db)
		require.True(t, ok, "part %d", i)
		require.Equal(t, devicebuf.CUDA, b.Kind())
		require.Equal(t, 1+i%3, b.Len())
		if i == 0 {
			base = b.Ptr()
		}
		require.Equal(t, base+uintptr(256*i), b.Ptr(), "part %d starts where a CUDA allocation of its own would", i)
		host := devicebuf.HostFromBytes(make([]byte, b.Len()))
		require.NoError(t, devicebuf.Copy(host, b))
		p, err := host.HostBytes()
		require.NoError(t, err)
		require.Equal(t, bytes.Repeat([]byte{byte(i)}, 1+i%3), p, "part %d", i)
		host.Release()
	}
	kept := gdrcodec.Detach(got.Parts[7])
	gdrcodec.ReleaseAll(&got)
	require.Equal(t, allocs+1, g.Allocations(), "a payload kept keeps the allocation")
	require.NoError(t, kept.Release())
	require.Equal(t, allocs, g.Allocations())
}

// A body with more than MaxPayloads DeviceBuffers on the wire is refused
// before it is decoded, with the status the walk after the decode gives,
// whatever field holds them: a repeated field, a map, or both; the decode
// of a body of empty ones would allocate a hundred times its size first.
func TestPayloadsCountedBeforeDecode(t *testing.T) {
	const n = 1 << 20
	body := bytes.Repeat([]byte{0x2a, 0x00}, n/2) // Tensor.parts (5), an empty element each
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err := gdrcodec.UnmarshalForTest(body, &tensorpb.Tensor{})
	runtime.ReadMemStats(&after)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(4*n), "bytes allocated decoding a %d-byte body", n)

	// Map entries with their keys alone: the decoder makes each an empty
	// DeviceBuffer.
	body = body[:0]
	for i := 0; len(body) < n; i++ {
		key := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), fmt.Sprintf("%07d", i))
		body = protowire.AppendBytes(protowire.AppendTag(body, 6, protowire.BytesType), key) // Tensor.named
	}
	runtime.GC()
	runtime.ReadMemStats(&before)
	err = gdrcodec.UnmarshalForTest(body, &tensorpb.Tensor{})
	runtime.ReadMemStats(&after)
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(4*n), "bytes allocated decoding a %d-byte body of map keys", n)

	m := &tensorpb.Tensor{Named: map[string]*gdrv1.DeviceBuffer{}}
	for i := range gdrcodec.MaxPayloads - 1 {
		m.Parts = append(m.Parts, &gdrv1.DeviceBuffer{})
		if i < 2 {
			m.Named[strconv.Itoa(i)] = &gdrv1.DeviceBuffer{}
		}
	}
	err = decode(t, m, &tensorpb.Tensor{})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	delete(m.Named, "1")
	var got tensorpb.Tensor
	require.NoError(t, decode(t, m, &got))
	require.Len(t, got.Parts, gdrcodec.MaxPayloads-1)
	gdrcodec.ReleaseAll(&got)
}
