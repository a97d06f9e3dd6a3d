package gdrcodec

import (
	"bytes"
	"context"
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

// holderMap returns the descriptor of a message Top { map<string, Holder> m
// = 1; } where Holder { repeated gdr.v1.DeviceBuffer bufs = 1; }: a map
// whose message values carry payloads, which no generated type of the
// tests has.
func holderMap(t *testing.T) (top, holder protoreflect.MessageDescriptor) {
	t.Helper()
	field := func(name string, num int32, label descriptorpb.FieldDescriptorProto_Label, typ descriptorpb.FieldDescriptorProto_Type, typeName string) *descriptorpb.FieldDescriptorProto {
		f := &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num), Label: label.Enum(), Type: typ.Enum()}
		if typeName != "" {
			f.TypeName = proto.String(typeName)
		}
		return f
	}
	const (
		repeated = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
		optional = descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
		message  = descriptorpb.FieldDescriptorProto_TYPE_MESSAGE
	)
	fdp := &descriptorpb.FileDescriptorProto{
		Name:       proto.String("gdrcodec_test_holdermap.proto"),
		Package:    proto.String("gdrcodectest"),
		Syntax:     proto.String("proto3"),
		Dependency: []string{"gdr/v1/gdr.proto"},
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("Holder"), Field: []*descriptorpb.FieldDescriptorProto{
				field("bufs", 1, repeated, message, ".gdr.v1.DeviceBuffer"),
			}},
			{Name: proto.String("Top"), Field: []*descriptorpb.FieldDescriptorProto{
				field("m", 1, repeated, message, ".gdrcodectest.Top.MEntry"),
			}, NestedType: []*descriptorpb.DescriptorProto{{
				Name:    proto.String("MEntry"),
				Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
				Field: []*descriptorpb.FieldDescriptorProto{
					field("key", 1, optional, descriptorpb.FieldDescriptorProto_TYPE_STRING, ""),
					field("value", 2, optional, message, ".gdrcodectest.Holder"),
				},
			}}},
		},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().ByName("Top"), fd.Messages().ByName("Holder")
}

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
