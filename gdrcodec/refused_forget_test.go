package gdrcodec

// What a refused message keeps of the payloads it named: nothing (the
// README's Security), whoever sent it and wherever the refusal came from.

import (
	"context"
	"crypto/rand"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	encproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// namedDescriptor is a descriptor of a payload of 1 MiB under a random owner and
// token: what an honest gdr peer's message names.
func namedDescriptor() *gdrv1.DeviceBuffer {
	owner, token := make([]byte, 16), make([]byte, 16)
	_, _ = rand.Read(owner)
	_, _ = rand.Read(token)
	return &gdrv1.DeviceBuffer{Owner: owner, Token: token, Length: 1 << 20, Kind: gdrv1.Kind_KIND_HOST}
}

// markedBytes is the value of a marked bytes field that names db.
func markedBytes(t *testing.T, db *gdrv1.DeviceBuffer) []byte {
	t.Helper()
	desc, err := proto.Marshal(db)
	require.NoError(t, err)
	return append(append(append([]byte{}, bytesMagic...), markDescriptor), desc...)
}

// namesPayload reports whether b, a marked bytes field's value, still names
// a payload by descriptor.
func namesPayload(b []byte) bool {
	mark, _, ok := bytesMarked(b)
	return ok && mark == markDescriptor
}

// A message refused because no gdrpc option tracks its call (errUntracked: a
// server without ServerOptions, a client without DialOptions), or because a
// plain peer named payloads by reference, keeps no DeviceBuffer's owner or
// token, as a gdr sender's refused message keeps none.
func TestRefusedUntrackedOrPlainForgetsTokens(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    *codec
		want codes.Code
	}{
		{"untracked gdr", &codec{name: Name, oob: true}, codes.FailedPrecondition},
		{"plain proto codec", &codec{name: encproto.Name}, codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &tensorpb.Tensor{Data: namedDescriptor(), Parts: []*gdrv1.DeviceBuffer{namedDescriptor(), namedDescriptor()}}
			body, err := proto.Marshal(m)
			require.NoError(t, err)
			var got tensorpb.Tensor
			err = tc.c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(body)}, &got)
			require.Equal(t, tc.want, status.Code(err), "%v", err)
			defer ReleaseAll(&got)
			for i, db := range append([]*gdrv1.DeviceBuffer{got.Data}, got.Parts...) {
				require.Nil(t, db.GetToken(), "payload %d of the refused message keeps its token", i)
				require.Nil(t, db.GetOwner(), "payload %d of the refused message keeps its owner", i)
			}
		})
	}
}

// blobsListType returns a dynamic Tensor with a repeated marked bytes
// field, blobs (number 100): a repeated bytes field with the device_buffer
// option, as a generated message may declare.
func blobsListType(t *testing.T) (protoreflect.MessageDescriptor, protoreflect.FieldDescriptor) {
	t.Helper()
	var blob *descriptorpb.FieldDescriptorProto
	for _, f := range protodesc.ToDescriptorProto((&tensorpb.Tensor{}).ProtoReflect().Descriptor()).Field {
		if f.GetName() == "blob" {
			blob = f
		}
	}
	require.NotNil(t, blob, "Tensor's marked bytes field")
	blobs := proto.Clone(blob).(*descriptorpb.FieldDescriptorProto)
	blobs.Name, blobs.JsonName, blobs.Number = proto.String("blobs"), nil, proto.Int32(1)
	blobs.Label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum()
	fdp := &descriptorpb.FileDescriptorProto{
		Name:        proto.String("gdrpc_blobs_list_test.proto"),
		Package:     proto.String("gdrpc.blobslisttest"),
		Syntax:      proto.String("proto3"),
		Dependency:  []string{gdrv1.File_gdr_v1_gdr_proto.Path()},
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("Blobs"), Field: []*descriptorpb.FieldDescriptorProto{blobs}}},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	require.NoError(t, err)
	md := fd.Messages().ByName("Blobs")
	f := md.Fields().ByName("blobs")
	require.True(t, marked(f), "blobs is marked")
	require.True(t, f.IsList())
	return md, f
}

// A refused message forgets the descriptors after the bad payload
// (TestRefusedMessageForgetsLaterTokens) within a repeated marked bytes
// field too: the element that failed (an unknown marker, a well-formed
// descriptor over MaxPayloads) and every later one.
func TestRefusedBytesListForgetsLaterTokens(t *testing.T) {
	md, blobs := blobsListType(t)
	decodeTracked := func(t *testing.T, elems [][]byte) (protoreflect.List, error) {
		m := dynamicpb.NewMessage(md)
		l := m.Mutable(blobs).List()
		for _, e := range elems {
			l.Append(protoreflect.ValueOfBytes(e))
		}
		body, err := proto.Marshal(m)
		require.NoError(t, err)
		got := dynamicpb.NewMessage(md)
		rc := expectReceive(context.Background(), got, false) // a call gdrpc tracks: a gdr peer
		defer rc.closeCall()
		err = rc.done(got, (&codec{name: Name, oob: true}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(body)}, got))
		return got.Get(blobs).List(), err
	}
	t.Run("malformed element first", func(t *testing.T) {
		bad := append(append([]byte{}, bytesMagic...), 7) // an unknown marker
		l, err := decodeTracked(t, [][]byte{bad, markedBytes(t, namedDescriptor()), markedBytes(t, namedDescriptor())})
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		for i := 1; i < l.Len(); i++ {
			require.False(t, namesPayload(l.Get(i).Bytes()), "element %d after the bad one keeps its descriptor (owner, token)", i)
		}
	})
	t.Run("over MaxPayloads", func(t *testing.T) {
		elems := make([][]byte, MaxPayloads+2)
		for i := range elems {
			elems[i] = markedBytes(t, namedDescriptor())
		}
		l, err := decodeTracked(t, elems)
		require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		var kept []int
		for i := range l.Len() {
			if namesPayload(l.Get(i).Bytes()) {
				kept = append(kept, i)
			}
		}
		require.Empty(t, kept, "elements of the refused message that keep their descriptors")
	})
}

// A unary request whose call turns out not to be a gdrpc session's
// (pullRequest's sessionRefusal: the gdr subtype over a connection that did
// not negotiate it) keeps no descriptor's owner or token: interceptors
// chained before gdrpc's still see it.
func TestRefusedRequestDropForgetsTokens(t *testing.T) {
	m := &tensorpb.Tensor{Data: namedDescriptor(), Parts: []*gdrv1.DeviceBuffer{namedDescriptor()}}
	p, err := collectPulls(context.Background(), m.ProtoReflect(), gdrSender, newOptions(nil))
	require.NoError(t, err)
	require.Len(t, p.jobs, 2)
	st := pullRequest(context.Background(), &p) // no gdrpc session in the call's context
	require.Equal(t, codes.FailedPrecondition, st.Code(), "%v", st)
	for i, db := range append([]*gdrv1.DeviceBuffer{m.Data}, m.Parts...) {
		require.Nil(t, db.GetToken(), "payload %d of the refused request keeps its token", i)
	}
}

// A message decoded into dynamic types (a proxy's, a reflection client's)
// whose DeviceBuffer names an out-of-band payload is refused: nothing can
// be attached to a dynamic DeviceBuffer, and the application would get a
// payload's length without its bytes. The refused message keeps no owner
// or token; an inline payload in a dynamic message arrives as it came.
func TestRefusedDynamicDeviceBuffer(t *testing.T) {
	md := (&tensorpb.Tensor{}).ProtoReflect().Descriptor()
	decode := func(t *testing.T, sent *tensorpb.Tensor) (*dynamicpb.Message, error) {
		body, err := proto.Marshal(sent)
		require.NoError(t, err)
		got := dynamicpb.NewMessage(md)
		rc := expectReceive(context.Background(), got, false) // a call gdrpc tracks: a gdr peer
		defer rc.closeCall()
		return got, rc.done(got, (&codec{name: Name, oob: true}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(body)}, got))
	}
	t.Run("named", func(t *testing.T) {
		got, err := decode(t, &tensorpb.Tensor{Data: namedDescriptor()})
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
		require.Contains(t, err.Error(), "dynamicpb")
		db := got.Get(md.Fields().ByName("data")).Message()
		for _, name := range []protoreflect.Name{"owner", "token"} {
			require.False(t, db.Has(db.Descriptor().Fields().ByName(name)), "the refused message keeps the payload's %s", name)
		}
	})
	t.Run("inline", func(t *testing.T) {
		payload := []byte("inline bytes of a dynamic message")
		got, err := decode(t, &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Inline: payload, Length: uint64(len(payload)), Kind: gdrv1.Kind_KIND_HOST}})
		require.NoError(t, err)
		db := got.Get(md.Fields().ByName("data")).Message()
		require.Equal(t, payload, db.Get(db.Descriptor().Fields().ByName("inline")).Bytes())
	})
}
