package gdrcodec

import (
	"runtime"
	"sync"
	"weak"

	"github.com/gdrpc/gdrpc/devicebuf"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Attachments: a DeviceBuffer message is generated code, so the devicebuf.Buffer
// it stands for lives in a side table keyed by a weak pointer to the message. A
// collected message releases its buffer (a backstop: callers release explicitly
// with Detach or ReleaseAll).
var attached = struct {
	sync.Mutex
	m map[weak.Pointer[gdrv1.DeviceBuffer]]*attachment
}{m: make(map[weak.Pointer[gdrv1.DeviceBuffer]]*attachment)}

type attachment struct {
	buf     *devicebuf.Buffer
	cleanup runtime.Cleanup
}

// Attach makes b the payload of db: when a message holding db is marshaled, b's
// bytes travel with it (out-of-band with the gdr codec, inline otherwise).
// Attach takes its own reference to b; the caller keeps theirs. A buffer
// attached before is released. db's length and kind are set from b.
func Attach(db *gdrv1.DeviceBuffer, b *devicebuf.Buffer) {
	b.Retain()
	setAttachment(db, b)
	db.Length = uint64(b.Len())
	db.Kind = kindOf(b.Kind())
	db.Inline = nil
}

// New returns a DeviceBuffer message with b attached.
func New(b *devicebuf.Buffer) *gdrv1.DeviceBuffer {
	db := &gdrv1.DeviceBuffer{}
	Attach(db, b)
	return db
}

func setAttachment(db *gdrv1.DeviceBuffer, b *devicebuf.Buffer) {
	wp := weak.Make(db)
	a := &attachment{buf: b}
	attached.Lock()
	old := attached.m[wp]
	attached.m[wp] = a
	a.cleanup = runtime.AddCleanup(db, dropAttachment, wp)
	attached.Unlock()
	if old != nil {
		old.cleanup.Stop()
		old.buf.Release()
	}
}

func dropAttachment(wp weak.Pointer[gdrv1.DeviceBuffer]) {
	attached.Lock()
	a := attached.m[wp]
	delete(attached.m, wp)
	attached.Unlock()
	if a != nil {
		a.buf.Release()
	}
}

// Buffer returns the buffer attached to db: the one Attach gave it, or for a
// received message, the payload that arrived. The buffer stays owned by db: use
// it while db is attached, Retain it to keep it longer.
func Buffer(db *gdrv1.DeviceBuffer) (*devicebuf.Buffer, bool) {
	if db == nil {
		return nil, false
	}
	attached.Lock()
	defer attached.Unlock()
	a := attached.m[weak.Make(db)]
	if a == nil {
		return nil, false
	}
	return a.buf, true
}

// Detach removes db's buffer and hands the caller db's reference to it.
func Detach(db *gdrv1.DeviceBuffer) *devicebuf.Buffer {
	if db == nil {
		return nil
	}
	wp := weak.Make(db)
	attached.Lock()
	a := attached.m[wp]
	delete(attached.m, wp)
	attached.Unlock()
	if a == nil {
		return nil
	}
	a.cleanup.Stop()
	return a.buf
}

// ReleaseAll detaches and releases every buffer attached anywhere in m: call it
// when done with a received message (or with a sent one whose buffers you
// no longer need) to return the memory to its pool now rather than at the
// next garbage collection.
func ReleaseAll(m proto.Message) {
	if m == nil {
		return
	}
	walkDeviceBuffers(m.ProtoReflect(), func(db *gdrv1.DeviceBuffer) {
		if b := Detach(db); b != nil {
			b.Release()
		}
	})
}

// Attached returns the number of live attachments (tests check for leaks).
func Attached() int {
	attached.Lock()
	defer attached.Unlock()
	return len(attached.m)
}

// walkDeviceBuffers calls fn for every DeviceBuffer message set in m.
func walkDeviceBuffers(m protoreflect.Message, fn func(*gdrv1.DeviceBuffer)) {
	if !mayCarry(m.Descriptor()) {
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if valueMessage(fd) == nil {
			return true
		}
		each(fd, v, func(v protoreflect.Value) {
			if db, ok := v.Message().Interface().(*gdrv1.DeviceBuffer); ok {
				fn(db)
				return
			}
			walkDeviceBuffers(v.Message(), fn)
		})
		return true
	})
}

// each calls fn for the value of a singular field, each element of a list and
// each value of a map.
func each(fd protoreflect.FieldDescriptor, v protoreflect.Value, fn func(protoreflect.Value)) {
	switch {
	case fd.IsList():
		l := v.List()
		for i := 0; i < l.Len(); i++ {
			fn(l.Get(i))
		}
	case fd.IsMap():
		v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
			fn(mv)
			return true
		})
	default:
		fn(v)
	}
}

// valueMessage returns the message type of fd's values (a map's value type for
// maps), or nil for scalar fields.
func valueMessage(fd protoreflect.FieldDescriptor) protoreflect.MessageDescriptor {
	if fd.IsMap() {
		return fd.MapValue().Message()
	}
	return fd.Message()
}

func kindOf(k devicebuf.Kind) gdrv1.Kind {
	if k == devicebuf.CUDA {
		return gdrv1.Kind_KIND_CUDA
	}
	return gdrv1.Kind_KIND_HOST
}
