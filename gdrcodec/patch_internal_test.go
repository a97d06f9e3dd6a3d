package gdrcodec

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/devicebuf"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/gdrcodec/internal/nestedpb"
)

// A message whose payloads are empty DeviceBuffers under singular fields is
// sent as its own encoding followed by the payloads' (patches); any other is
// rewritten in a copy. Either way every protobuf decoder reads the same
// message: the payloads' bytes where they were, the message's other fields
// as they were.
func TestPatchedBodies(t *testing.T) {
	payload := func(seed byte) []byte {
		b := make([]byte, 1000+int(seed))
		for i := range b {
			b[i] = seed + byte(i*7)
		}
		return b
	}
	var bufs []*devicebuf.Buffer
	attach := func(seed byte) *gdrv1.DeviceBuffer {
		b := devicebuf.HostFromBytes(payload(seed))
		bufs = append(bufs, b)
		return New(b)
	}
	chain := func(depth int, db *gdrv1.DeviceBuffer) *nestedpb.Chain {
		c := &nestedpb.Chain{Data: db}
		for range depth - 1 {
			c = &nestedpb.Chain{Next: c}
		}
		return c
	}
	cases := []struct {
		name    string
		msg     func() *nestedpb.Outer
		seeds   map[string]byte // where each payload is, by the path the check below reads
		patched bool
	}{
		{"top", func() *nestedpb.Outer { return &nestedpb.Outer{Name: "n", Top: attach(1)} }, map[string]byte{"top": 1}, true},
		{"four deep and in a oneof", func() *nestedpb.Outer {
			return &nestedpb.Outer{
				Name:   "n",
				Middle: &nestedpb.Middle{Data: attach(2), Inner: &nestedpb.Inner{Data: attach(3)}, After: 7},
				Choice: &nestedpb.Outer_Picked{Picked: attach(4)},
				Top:    attach(5),
			}
		}, map[string]byte{"middle": 2, "inner": 3, "picked": 4, "top": 5}, true},
		{"at the deepest patched", func() *nestedpb.Outer { return &nestedpb.Outer{Chain: chain(maxPatchDepth-1, attach(6))} }, map[string]byte{"chain": 6}, true},
		{"an empty payload left as it is", func() *nestedpb.Outer {
			return &nestedpb.Outer{Top: &gdrv1.DeviceBuffer{}, Middle: &nestedpb.Middle{Data: attach(7)}}
		}, map[string]byte{"middle": 7}, true},
		{"five payloads", func() *nestedpb.Outer {
			return &nestedpb.Outer{
				Middle: &nestedpb.Middle{Data: attach(8), Inner: &nestedpb.Inner{Data: attach(9)}},
				Choice: &nestedpb.Outer_Picked{Picked: attach(10)},
				Top:    attach(11),
				Chain:  chain(1, attach(12)),
			}
		}, map[string]byte{"middle": 8, "inner": 9, "picked": 10, "top": 11, "chain": 12}, false},
		{"too deep", func() *nestedpb.Outer { return &nestedpb.Outer{Chain: chain(maxPatchDepth, attach(13))} }, map[string]byte{"chain": 13}, false},
		{"in a list", func() *nestedpb.Outer {
			return &nestedpb.Outer{Top: attach(14), List: []*gdrv1.DeviceBuffer{attach(15)}}
		}, map[string]byte{"top": 14, "list": 15}, false},
		{"a kind that Attach did not set", func() *nestedpb.Outer {
			db := attach(17)
			db.Kind = gdrv1.Kind_KIND_CUDA
			return &nestedpb.Outer{Top: db}
		}, map[string]byte{"top": 17}, true},
		{"a length that Attach did not set", func() *nestedpb.Outer {
			db := attach(18)
			db.Length = 5
			return &nestedpb.Outer{Middle: &nestedpb.Middle{Data: db}}
		}, map[string]byte{"middle": 18}, true},
		{"a payload whose message says more", func() *nestedpb.Outer {
			db := &gdrv1.DeviceBuffer{Length: 3, Kind: gdrv1.Kind_KIND_CUDA, Device: 2}
			b := devicebuf.HostFromBytes(payload(16))
			bufs = append(bufs, b)
			Attach(db, b)
			return &nestedpb.Outer{Top: db}
		}, map[string]byte{"top": 16}, false},
	}
	c := &codec{name: Name, oob: true}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := tc.msg()
			plain, err := proto.Marshal(m)
			require.NoError(t, err)
			body, err := c.Marshal(m)
			require.NoError(t, err)
			data := body.Materialize()
			body.Free()
			require.Equal(t, tc.patched, bytes.HasPrefix(data, plain), "patched")

			// The proto replacement codec, whose peers may decode with other
			// languages' libraries, never patches; its body reads as the
			// same message.
			protoBody, err := (&codec{name: "proto"}).Marshal(m)
			require.NoError(t, err)
			protoData := protoBody.Materialize()
			protoBody.Free()
			require.False(t, bytes.HasPrefix(protoData, plain), "the proto codec patched")
			fromGDR, fromProto := &nestedpb.Outer{}, &nestedpb.Outer{}
			require.NoError(t, proto.Unmarshal(data, fromGDR))
			require.NoError(t, proto.Unmarshal(protoData, fromProto))
			require.True(t, proto.Equal(fromGDR, fromProto), "the two bodies read differently")

			// A plain decoder and the codec's read the same message.
			for _, decode := range []func(*nestedpb.Outer) error{
				func(got *nestedpb.Outer) error { return proto.Unmarshal(data, got) },
				func(got *nestedpb.Outer) error { return c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, got) },
			} {
				got := &nestedpb.Outer{}
				require.NoError(t, decode(got))
				require.Equal(t, m.GetName(), got.GetName())
				require.Equal(t, m.GetMiddle().GetAfter(), got.GetMiddle().GetAfter())
				at := map[string]*gdrv1.DeviceBuffer{
					"top":    got.GetTop(),
					"middle": got.GetMiddle().GetData(),
					"inner":  got.GetMiddle().GetInner().GetData(),
					"picked": got.GetPicked(),
				}
				if l := got.GetList(); len(l) == 1 {
					at["list"] = l[0]
				}
				for ch := got.GetChain(); ch != nil; ch = ch.GetNext() {
					if ch.GetData() != nil {
						at["chain"] = ch.GetData()
					}
				}
				for where, seed := range tc.seeds {
					db := at[where]
					require.NotNil(t, db, where)
					want := payload(seed)
					require.Equal(t, uint64(len(want)), db.GetLength(), where)
					require.Equal(t, gdrv1.Kind_KIND_HOST, db.GetKind(), where)
					require.Equal(t, int32(-1), db.GetDevice(), where) // a host buffer's
					require.Equal(t, want, db.GetInline(), where)
				}
				if tc.name == "an empty payload left as it is" {
					require.NotNil(t, got.GetTop())
					require.Zero(t, proto.Size(got.GetTop()))
				}
				ReleaseAll(got)
			}
			// The message sent is as it was: its payloads attached, nothing
			// written into it.
			again, err := proto.Marshal(m)
			require.NoError(t, err)
			require.Equal(t, plain, again)
			ReleaseAll(m)
		})
	}
	for _, b := range bufs {
		require.NoError(t, b.Release()) // the test's reference; ReleaseAll gave back the messages'
		require.True(t, b.Released(), "a buffer still referenced")
	}
	require.Zero(t, Attached())
}

// A payload released before its message is sent fails the marshal, patched
// or not, and an empty DeviceBuffer is sent as it is.
func TestPatchedBodyReleasedPayload(t *testing.T) {
	b := devicebuf.HostFromBytes(make([]byte, 64))
	m := &nestedpb.Outer{Middle: &nestedpb.Middle{Data: New(b)}}
	require.NoError(t, b.Release())
	ReleaseAll(m) // its length stays, its payload goes
	_, err := (&codec{name: Name, oob: true}).Marshal(m)
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)

	m.Middle.Data.Length = 0
	body, err := (&codec{name: Name, oob: true}).Marshal(m)
	require.NoError(t, err)
	got := &nestedpb.Outer{}
	require.NoError(t, proto.Unmarshal(body.Materialize(), got))
	require.NotNil(t, got.GetMiddle().GetData())
	require.Zero(t, proto.Size(got.GetMiddle().GetData()))
	require.True(t, b.Released())
}

// An empty buffer attached under a DeviceBuffer whose length was changed
// since is sent empty, its length set to zero after the message's own.
func TestPatchedBodyZeroLength(t *testing.T) {
	b := devicebuf.HostFromBytes(nil)
	db := New(b)
	require.NoError(t, b.Release())
	db.Length = 5
	m := &nestedpb.Outer{Top: db}
	plain, err := proto.Marshal(m)
	require.NoError(t, err)
	body, err := (&codec{name: Name, oob: true}).Marshal(m)
	require.NoError(t, err)
	data := body.Materialize()
	require.True(t, bytes.HasPrefix(data, plain), "patched")
	got := &nestedpb.Outer{}
	require.NoError(t, proto.Unmarshal(data, got))
	require.NotNil(t, got.GetTop())
	require.Zero(t, got.GetTop().GetLength())
	require.Empty(t, got.GetTop().GetInline())
	ReleaseAll(m)
	require.True(t, b.Released())
}
