package gdrcodec

import (
	"reflect"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// decodedSize estimates the memory m holds once decoded: the struct of each
// message, the elements of each list and map, and the bytes of each bytes
// and string field. A decoded message takes up to a hundred times its
// encoding (a repeated field of empty messages: two bytes each on the wire,
// a struct and a pointer each in memory; a packed list of one-byte varints,
// eight bytes each), so a bound on what a peer's pending requests hold
// counts this rather than their bodies.
func decodedSize(m protoreflect.Message) int {
	n := structSize(m)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				n += valueSize(fd, l.Get(i))
			}
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				n += mapEntrySize + valueSize(fd.MapKey(), k.Value()) + valueSize(fd.MapValue(), mv)
				return true
			})
		case fd.Message() != nil:
			n += decodedSize(v.Message())
		case fd.Kind() == protoreflect.BytesKind:
			n += len(v.Bytes()) // its header is in the struct
		case fd.Kind() == protoreflect.StringKind:
			n += len(v.String())
		}
		return true
	})
	return n
}

// The memory a value takes beside what it points to: a pointer or a scalar,
// a slice header, a string header; and what a map entry adds.
const (
	scalarSize   = 8
	sliceSize    = 24
	stringSize   = 16
	mapEntrySize = 16
)

// valueSize is what one value of fd holds: a message's struct and its
// contents with the pointer to it, a bytes or string value with its header.
func valueSize(fd protoreflect.FieldDescriptor, v protoreflect.Value) int {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return scalarSize + decodedSize(v.Message())
	case protoreflect.BytesKind:
		return sliceSize + len(v.Bytes())
	case protoreflect.StringKind:
		return stringSize + len(v.String())
	}
	return scalarSize
}

// structSize is the size of m's Go struct, or of a pointer where m is not
// one (a dynamic message).
func structSize(m protoreflect.Message) int {
	t := reflect.TypeOf(m.Interface())
	if t.Kind() == reflect.Pointer && t.Elem().Kind() == reflect.Struct {
		return int(t.Elem().Size())
	}
	return scalarSize
}
