package gdrcodec

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// prescanDepth bounds how deep precount follows nested messages, as
// protobuf's decoder bounds its own recursion (protowire's default limit).
const prescanDepth = 10000

// precount refuses, before it is decoded, a body of a message of type md
// that holds more than MaxPayloads DeviceBuffers. Decoding builds every
// element first: an empty DeviceBuffer takes two bytes on the wire and a
// couple of hundred bytes of heap, so a body of empty elements (the
// message-size limit's worth, 64 MiB for net/rpc) would have the decoder
// allocate a hundred times its size before the walk after it (collected)
// counted them. It counts each DeviceBuffer on the wire, in the fields that
// may hold one, nested messages and maps among them; the walk after the
// decode still counts what this leaves out (groups, extensions, the marked
// bytes fields that name a payload), so that MaxPayloads holds either way.
// A body it cannot parse is left for the decoder to refuse.
func precount(b []byte, md protoreflect.MessageDescriptor) error {
	if len(b)/2 <= MaxPayloads || !mayCarry(md) || md.FullName() == deviceBufferName {
		return nil // each DeviceBuffer takes two bytes at least: a tag and a length
	}
	budget := MaxPayloads
	if !precountMessage(b, md, &budget, 0) {
		return codecError(codes.ResourceExhausted, "the message carries more than %d payloads (gdrcodec.MaxPayloads)", MaxPayloads)
	}
	return nil
}

// precountMessage takes the DeviceBuffers of b, an encoded message of type md,
// from budget, and reports false once it would go below zero.
func precountMessage(b []byte, md protoreflect.MessageDescriptor, budget *int, depth int) bool {
	if depth > prescanDepth {
		return true // the decoder refuses it
	}
	fields := md.Fields()
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return true
		}
		b = b[n:]
		var value []byte
		if typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return true
			}
			value, n = v, m
		} else if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
			return true
		}
		b = b[n:]
		fd := fields.ByNumber(num)
		if fd == nil || typ != protowire.BytesType || fd.Kind() != protoreflect.MessageKind {
			continue // a scalar, a packed list, a group or an unknown field
		}
		sub := fd.Message() // a map's entry, for a map
		switch {
		case sub.FullName() == deviceBufferName:
			if *budget--; *budget < 0 {
				return false
			}
		case fd.IsMap() && !carriesValues(fd):
		case fd.IsMap() || mayCarry(sub):
			if !precountMessage(value, sub, budget, depth+1) {
				return false
			}
		}
	}
	return true
}

// carriesValues reports whether the values of fd, a map field, are
// DeviceBuffers or messages that may hold one.
func carriesValues(fd protoreflect.FieldDescriptor) bool {
	v := fd.MapValue()
	return v.Kind() == protoreflect.MessageKind && (v.Message().FullName() == deviceBufferName || mayCarry(v.Message()))
}
