package gdrcodec

import (
	"bytes"
	"context"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// descField describes a field of a message type the tests build.
func descField(name string, num int32, label descriptorpb.FieldDescriptorProto_Label, typ descriptorpb.FieldDescriptorProto_Type, typeName string) *descriptorpb.FieldDescriptorProto {
	f := &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num), Label: label.Enum(), Type: typ.Enum()}
	if typeName != "" {
		f.TypeName = proto.String(typeName)
	}
	return f
}

// mapEntry describes MEntry, the entry type of a map<string, value>.
func mapEntry(value string) *descriptorpb.DescriptorProto {
	return &descriptorpb.DescriptorProto{
		Name:    proto.String("MEntry"),
		Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
		Field: []*descriptorpb.FieldDescriptorProto{
			descField("key", 1, optional, descriptorpb.FieldDescriptorProto_TYPE_STRING, ""),
			descField("value", 2, optional, message, value),
		},
	}
}

// holderMap returns the descriptor of a message Top { map<string, Holder> m
// = 1; } where Holder { repeated gdr.v1.DeviceBuffer bufs = 1; }: a map
// whose message values carry payloads, which no generated type of the
// tests has.
func holderMap(t *testing.T) (top, holder protoreflect.MessageDescriptor) {
	fd := testProtoFile(t, "gdrcodec_test_holdermap.proto",
		&descriptorpb.DescriptorProto{Name: proto.String("Holder"), Field: []*descriptorpb.FieldDescriptorProto{
			descField("bufs", 1, repeated, message, ".gdr.v1.DeviceBuffer"),
		}},
		&descriptorpb.DescriptorProto{Name: proto.String("Top"), Field: []*descriptorpb.FieldDescriptorProto{
			descField("m", 1, repeated, message, ".gdrcodectest.Top.MEntry"),
		}, NestedType: []*descriptorpb.DescriptorProto{mapEntry(".gdrcodectest.Holder")}},
	)
	return fd.Messages().ByName("Top"), fd.Messages().ByName("Holder")
}

// testProtoFile makes a file of package gdrcodectest holding msgs, which may
// use gdr.v1's types.
func testProtoFile(t *testing.T, name string, msgs ...*descriptorpb.DescriptorProto) protoreflect.FileDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:        proto.String(name),
		Package:     proto.String("gdrcodectest"),
		Syntax:      proto.String("proto3"),
		Dependency:  []string{"gdr/v1/gdr.proto"},
		MessageType: msgs,
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd
}

// Labels and types of the fields of the tests' message types.
const (
	repeated = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
	optional = descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	message  = descriptorpb.FieldDescriptorProto_TYPE_MESSAGE
)

// entryBody encodes a Top whose one map entry repeats its value, each
// occurrence holding counts[i] empty DeviceBuffers: the decoder merges the
// occurrences into one Holder with all of them.
func entryBody(counts ...int) []byte {
	entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "k")
	for _, n := range counts {
		entry = protowire.AppendTag(entry, 2, protowire.BytesType)
		entry = protowire.AppendBytes(entry, bytes.Repeat([]byte{0x0a, 0x00}, n))
	}
	return protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), entry)
}

// precount counts the DeviceBuffers of every occurrence of a map entry's
// value, which the decoder merges, not those of its last alone.
func TestPrecountMergedMapValues(t *testing.T) {
	top, _ := holderMap(t)
	for _, tc := range []struct {
		counts []int
		ok     bool
	}{
		{[]int{MaxPayloads}, true},
		{[]int{MaxPayloads + 1}, false},
		{[]int{MaxPayloads + 1, 0}, false}, // an empty value last
		{[]int{MaxPayloads/2 + 1, MaxPayloads / 2}, false},
		{[]int{MaxPayloads / 2, MaxPayloads / 2}, true},
	} {
		b := entryBody(tc.counts...)
		m := dynamicpb.NewMessage(top)
		require.NoError(t, proto.Unmarshal(b, m))
		n := 0
		m.Get(top.Fields().ByNumber(1)).Map().Range(func(_ protoreflect.MapKey, v protoreflect.Value) bool {
			n += v.Message().Get(v.Message().Descriptor().Fields().ByNumber(1)).List().Len()
			return true
		})
		total := 0
		for _, c := range tc.counts {
			total += c
		}
		require.Equal(t, total, n, "%v: what the decoder builds", tc.counts)
		err := precount(b, top)
		if tc.ok {
			require.NoError(t, err, "%v", tc.counts)
		} else {
			require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v: %v", tc.counts, err)
		}
	}
}

// The walk after a decode counts inline DeviceBuffers of a dynamic message
// (a proxy's, a reflection client's) towards MaxPayloads, as it counts
// generated ones.
func TestCollectCountsForeignPayloads(t *testing.T) {
	_, holder := holderMap(t)
	for _, n := range []int{MaxPayloads, MaxPayloads + 1} {
		m := dynamicpb.NewMessage(holder)
		l := m.Mutable(holder.Fields().ByNumber(1)).List()
		for range n {
			l.Append(l.NewElement())
		}
		_, err := collectPulls(context.Background(), m, gdrSender, &options{})
		if n <= MaxPayloads {
			require.NoError(t, err)
		} else {
			require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		}
	}
}

// nodeMap returns the descriptor of Node { map<string, Node> m = 1;
// gdr.v1.DeviceBuffer d = 2; }: a type that nests maps of itself.
func nodeMap(t *testing.T) protoreflect.MessageDescriptor {
	fd := testProtoFile(t, "gdrcodec_test_nodemap.proto",
		&descriptorpb.DescriptorProto{Name: proto.String("Node"), Field: []*descriptorpb.FieldDescriptorProto{
			descField("m", 1, repeated, message, ".gdrcodectest.Node.MEntry"),
			descField("d", 2, optional, message, ".gdr.v1.DeviceBuffer"),
		}, NestedType: []*descriptorpb.DescriptorProto{mapEntry(".gdrcodectest.Node")}},
	)
	return fd.Messages().ByName("Node")
}

// A body that nests map entries of a type that holds maps of itself, each
// entry's value on the wire twice (the rest of the body, then an empty
// occurrence), costs the count no copy of the rest at each level: joining
// the occurrences did, a peak of the depth times the body's size (400
// levels of a 1 MiB body took 403 MiB), before any check of who sent it.
// The count still finds the DeviceBuffers of every occurrence.
func TestPrecountNestedMapsCopyNothing(t *testing.T) {
	node := nodeMap(t)
	const depth, size = 200, 1 << 20
	body := protowire.AppendBytes(protowire.AppendTag(nil, 9, protowire.BytesType), make([]byte, size)) // an unknown field
	body = protowire.AppendBytes(protowire.AppendTag(body, 2, protowire.BytesType), nil)                // d: one DeviceBuffer
	for range depth {
		entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "k")
		entry = protowire.AppendBytes(protowire.AppendTag(entry, 2, protowire.BytesType), body)
		entry = protowire.AppendBytes(protowire.AppendTag(entry, 2, protowire.BytesType), nil)
		body = protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), entry)
	}
	require.NoError(t, proto.Unmarshal(body, dynamicpb.NewMessage(node)), "the decoder takes the body")

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	n := 0
	require.True(t, scanDeviceBuffers(body, node, 0, func([]byte) bool { n++; return true }))
	runtime.ReadMemStats(&after)
	require.Equal(t, 1, n, "the innermost DeviceBuffer")
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(size), "bytes the count allocated")
	require.NoError(t, precount(body, node))
}
