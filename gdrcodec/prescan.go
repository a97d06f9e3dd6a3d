package gdrcodec

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// prescanDepth bounds how deep a scan follows nested messages, as
// protobuf's decoder bounds its own recursion (protowire's default limit).
const prescanDepth = 10000

// precount refuses, before it is decoded, a body of a message of type md
// that holds more than MaxPayloads DeviceBuffers. Decoding builds every
// element first: an empty DeviceBuffer takes two bytes on the wire and a
// couple of hundred bytes of heap, so a body of empty elements (the
// message-size limit's worth) would have the decoder allocate a hundred
// times its size before the walk after it (collected) counted them. It
// counts each DeviceBuffer on the wire, in the fields that may hold one,
// nested messages and maps among them (a map entry with a DeviceBuffer
// value counts whether or not the value is on the wire: the decoder makes
// an empty one for an entry without); the walk after the decode still
// counts what this leaves out (groups, extensions, the marked bytes fields
// that name a payload), so that MaxPayloads holds either way. An encoding
// that repeats a singular field counts each time, though the decoder merges
// the repeats into one. A body it cannot parse is left for the decoder to
// refuse.
func precount(b []byte, md protoreflect.MessageDescriptor) error {
	if !within(b, md, MaxPayloads) {
		return codecError(codes.ResourceExhausted, "the message carries more than %d payloads (gdrcodec.MaxPayloads)", MaxPayloads)
	}
	return nil
}

// within reports whether b, an encoded message of type md, holds at most
// limit DeviceBuffers on the wire (precount).
func within(b []byte, md protoreflect.MessageDescriptor, limit int) bool {
	if len(b)/2 <= limit || !mayCarry(md) || md.FullName() == deviceBufferName {
		return true // each DeviceBuffer takes two bytes at least: a tag and a length
	}
	return scanDeviceBuffers(b, md, 0, func([]byte) bool { limit--; return limit >= 0 })
}

// discardLandedOnWire gives back, as the walk of a refused message does
// (discardLanded), the receive space that the DeviceBuffers of b, a body of
// a message of type md that precount refused or that failed to decode, name:
// decoding one at a time, so that a refusal's purpose holds.
func discardLandedOnWire(ctx context.Context, b []byte, md protoreflect.MessageDescriptor, from sender) {
	if from != gdrSender {
		return
	}
	var db gdrv1.DeviceBuffer
	scanDeviceBuffers(b, md, 0, func(v []byte) bool {
		if proto.Unmarshal(v, &db) == nil { // resets db first
			discardLanded(ctx, &db, from) // which ignores what names no space
		}
		return true
	})
}

// scanDeviceBuffers calls fn with the encoding of each DeviceBuffer of b, an
// encoded message of type md (nil for a map entry without its value), and
// reports false once fn does.
func scanDeviceBuffers(b []byte, md protoreflect.MessageDescriptor, depth int, fn func(v []byte) bool) bool {
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
		switch {
		case fd.Message().FullName() == deviceBufferName:
			if !fn(value) {
				return false
			}
		case fd.IsMap():
			v := fd.MapValue()
			switch {
			case v.Kind() != protoreflect.MessageKind:
			case v.Message().FullName() == deviceBufferName:
				if !eachMapValue(value, fn) {
					return false
				}
			case mayCarry(v.Message()):
				if !eachMapValue(value, func(mv []byte) bool { return scanDeviceBuffers(mv, v.Message(), depth+1, fn) }) {
					return false
				}
			}
		case mayCarry(fd.Message()):
			if !scanDeviceBuffers(value, fd.Message(), depth+1, fn) {
				return false
			}
		}
	}
	return true
}

// eachMapValue calls fn with each encoded occurrence of the value of entry,
// an encoded map entry whose value is a message, or once with nil where it
// has none (the decoder makes an empty value for it), and reports false once
// fn does. The decoder merges the occurrences into one message: each is
// scanned apart, which counts whatever any of them holds (a singular field
// set in several counts in each, as a repeated one does), where joining
// them would copy the rest of the body at each level of a message that
// nests maps of itself.
func eachMapValue(entry []byte, fn func(v []byte) bool) bool {
	found := false
	for len(entry) > 0 {
		num, typ, n := protowire.ConsumeTag(entry)
		if n < 0 {
			break
		}
		entry = entry[n:]
		if n = protowire.ConsumeFieldValue(num, typ, entry); n < 0 {
			break
		}
		if num == 2 && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(entry)
			found = true
			if !fn(v) {
				return false
			}
		}
		entry = entry[n:]
	}
	return found || fn(nil)
}
