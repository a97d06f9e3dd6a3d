package gdrcodec

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
)

// knownCount counts the entries of the descriptor-keyed caches.
func knownCount() (types, fields int) {
	knownTypes.Range(func(any, any) bool { types++; return true })
	knownFields.Range(func(any, any) bool { fields++; return true })
	return types, fields
}

// The descriptor-keyed caches hold registered types alone: a generated
// message's walk files its type and fields, while descriptors made anew
// (dynamic messages of a schema the process loads at run time) leave them
// as they were, however many there are, and are still walked right.
func TestKnownTypesHoldRegisteredOnly(t *testing.T) {
	md := (&tensorpb.Tensor{}).ProtoReflect().Descriptor()
	require.True(t, mayCarry(md))
	require.NotEmpty(t, carryingFields((&tensorpb.Tensor{}).ProtoReflect()))
	_, ok := knownTypes.Load(md)
	require.True(t, ok, "a generated type is not filed by descriptor")
	blob := md.Fields().ByName("blob")
	require.True(t, marked(blob))
	_, ok = knownFields.Load(blob)
	require.True(t, ok, "a generated type's field is not filed by descriptor")

	types, fields := knownCount()
	fdp := protodesc.ToFileDescriptorProto(tensorpb.File_tensor_proto)
	for i := range 5 {
		f, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
		require.NoError(t, err)
		dmd := f.Messages().ByName("Tensor")
		require.NotEqual(t, md, dmd, "a descriptor made anew")
		m := dynamicpb.NewMessage(dmd)
		dblob := dmd.Fields().ByName("blob")
		m.Set(dblob, protoreflect.ValueOfBytes([]byte{byte(i)}))
		require.True(t, mayCarry(dmd))
		require.True(t, marked(dblob), "a dynamic descriptor's marked field")
		require.Contains(t, carryingFields(m), dblob)
		out, err := (&codec{name: Name, oob: true}).Marshal(m)
		require.NoError(t, err)
		back := dynamicpb.NewMessage(dmd)
		require.NoError(t, proto.Unmarshal(out.Materialize(), back))
		require.Equal(t, []byte{byte(i)}, back.Get(dblob).Bytes())
	}
	gotTypes, gotFields := knownCount()
	require.Equal(t, types, gotTypes, "dynamic descriptors filed by descriptor")
	require.Equal(t, fields, gotFields, "dynamic descriptors' fields filed by descriptor")
}
