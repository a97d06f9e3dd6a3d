package gdrcodec

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
)

// TestDynamicMarkedFieldsPulledTogether: a dynamic message (whose fields
// live in one map) with sixteen marked bytes fields, each a payload pulled
// out-of-band: the pulls run at once and each sets its field, which must not
// write the map concurrently (a fatal error, or a race under -race), and
// every field arrives byte-exact.
func TestDynamicMarkedFieldsPulledTogether(t *testing.T) {
	fdp := protodesc.ToFileDescriptorProto(tensorpb.File_tensor_proto)
	fdp.Name = proto.String("gdrpc_test_dynamic_tensor.proto")
	var tm *descriptorpb.DescriptorProto
	for _, m := range fdp.MessageType {
		if m.GetName() == "Tensor" {
			tm = m
		}
	}
	require.NotNil(t, tm)
	var blob *descriptorpb.FieldDescriptorProto
	for _, f := range tm.Field {
		if f.GetName() == "blob" {
			blob = f
		}
	}
	require.NotNil(t, blob, "Tensor's marked bytes field")
	for i := range 15 {
		f := proto.Clone(blob).(*descriptorpb.FieldDescriptorProto)
		f.Name = proto.String(fmt.Sprintf("blob%d", i))
		f.JsonName = nil
		f.Number = proto.Int32(int32(100 + i))
		tm.Field = append(tm.Field, f)
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	require.NoError(t, err)
	md := fd.Messages().ByName("Tensor")
	var fields []protoreflect.FieldDescriptor
	for i := range md.Fields().Len() {
		if f := md.Fields().Get(i); marked(f) {
			fields = append(fields, f)
		}
	}
	require.Len(t, fields, maxParallelPulls)
	c := &codec{name: Name, oob: true, o: newOptions([]Option{WithEagerThreshold(-1)})}
	for range 100 {
		m := dynamicpb.NewMessage(md)
		for i, f := range fields {
			m.Set(f, protoreflect.ValueOfBytes(bytes.Repeat([]byte{byte(i + 1)}, 1024)))
		}
		out, err := c.Marshal(m)
		require.NoError(t, err)
		wire := out.Materialize()
		require.Less(t, len(wire), 16*1024/4, "the payloads went out-of-band")
		got := dynamicpb.NewMessage(md)
		require.NoError(t, UnmarshalForTest(wire, got))
		for i, f := range fields {
			require.Equal(t, bytes.Repeat([]byte{byte(i + 1)}, 1024), got.Get(f).Bytes(), "field %s", f.Name())
		}
	}
}
