package gdrcodec

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// FuzzPrecount: the count before decoding never lets through a body that
// decodes to more DeviceBuffers than its limit (the decoder is the oracle).
// A small limit stands in for MaxPayloads, so that short bodies reach it.
func FuzzPrecount(f *testing.F) {
	const limit = 3
	seed := func(m proto.Message) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	db := func() *gdrv1.DeviceBuffer { return &gdrv1.DeviceBuffer{Length: 1, Inline: []byte{1}} }
	seed(&tensorpb.Tensor{Name: "t", Shape: []int64{1, 2}, Data: db(), Parts: []*gdrv1.DeviceBuffer{db(), {}, db()}})
	seed(&tensorpb.Tensor{Named: map[string]*gdrv1.DeviceBuffer{"a": db(), "b": {}, "c": nil}, Parts: []*gdrv1.DeviceBuffer{{}}})
	seed(&tensorpb.Tensor{Parts: []*gdrv1.DeviceBuffer{{}, {}, {}, {}, {}}})
	f.Add([]byte{0x32, 0x03, 0x0a, 0x01, 'k', 0x32, 0x03, 0x0a, 0x01, 'j', 0x32, 0x00, 0x32, 0x00, 0x2a, 0x00})
	md := (&tensorpb.Tensor{}).ProtoReflect().Descriptor()
	f.Fuzz(func(t *testing.T, b []byte) {
		var m tensorpb.Tensor
		if proto.Unmarshal(b, &m) != nil {
			return
		}
		n := 0
		walkDeviceBuffers(m.ProtoReflect(), func(*gdrv1.DeviceBuffer) { n++ })
		if n > limit && within(b, md, limit) {
			t.Fatalf("a body that decodes to %d DeviceBuffers passed the count before decoding (limit %d)", n, limit)
		}
	})
}
