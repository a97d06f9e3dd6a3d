package gdrcodec_test

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// FuzzDescriptor feeds arbitrary DeviceBuffer bodies to the descriptor parser:
// an error or a valid descriptor, never a crash.
func FuzzDescriptor(f *testing.F) {
	good, _ := proto.Marshal(&gdrv1.DeviceBuffer{Length: 5, Owner: make([]byte, 16), Token: make([]byte, 16), HostId: make([]byte, 16)})
	f.Add(good)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var db gdrv1.DeviceBuffer
		if proto.Unmarshal(b, &db) != nil {
			return
		}
		d, oob, err := gdrcodec.ParseDescriptor(&db)
		if err == nil && oob {
			if d.Validate() != nil {
				t.Fatalf("parsed an invalid descriptor: %+v", d)
			}
		}
	})
}

// FuzzUnmarshal decodes arbitrary message bodies with the gdr codec: a clear
// error or a message, never a crash or a hang (descriptors name owners with no
// session, so pulls fail at once).
func FuzzUnmarshal(f *testing.F) {
	body, _ := proto.Marshal(&tensorpb.Tensor{Blob: append([]byte("\x00\xffgdrpc\x00\x01"), 0x08, 0x05)})
	f.Add(body)
	f.Add([]byte("\x22\x0a\x00\xffgdrpc\x00\x00ab"))
	f.Add(append([]byte("\xa8\xa7\x09\x2a"), body...)) // a call number first (field 19061), as a unary request's body has
	f.Fuzz(func(t *testing.T, b []byte) {
		var m tensorpb.Tensor
		if gdrcodec.UnmarshalForTest(b, &m) == nil {
			gdrcodec.ReleaseAll(&m)
		}
	})
}
