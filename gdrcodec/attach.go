package gdrcodec

import (
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"weak"

	"github.com/gdrpc/gdrpc/devicebuf"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Attachments: a DeviceBuffer message is generated code, so the devicebuf.Buffer
// it stands for lives in a side table keyed by a weak pointer to the message.
// Attached buffers are released explicitly, never by the garbage collector:
// memory a GPU or a NIC can see runs out long before a collection comes. gdrpc
// releases what a server call received when the call ends and a sent response
// once it was sent (ServerOptions; the net/rpc server codec likewise), and what a
// failed client call received; the application releases the rest with
// ReleaseAll or takes a buffer with Detach. A message collected with a buffer
// still attached is a leak: it is logged (WithLogger) and the buffer is not
// freed.
var attached = struct {
	sync.Mutex
	m map[weak.Pointer[gdrv1.DeviceBuffer]]*attachment
}{m: make(map[weak.Pointer[gdrv1.DeviceBuffer]]*attachment)}

type attachment struct {
	buf     *devicebuf.Buffer
	cleanup runtime.Cleanup // reports the message collected with buf attached
}

// Attach makes b the payload of db: when a message holding db is marshaled, b's
// bytes travel with it (out-of-band with the gdr codec, inline otherwise).
// Attach takes its own reference to b, which db holds until ReleaseAll or
// Detach; the caller keeps theirs. A buffer attached before is released. db's
// length and kind are set from b. b's contents must not change until the
// call that sends it ended: its receiver may pull the payload after Send
// returned, and again where gRPC replays the message.
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
	a.cleanup = runtime.AddCleanup(db, reportLeak, wp)
	attached.Unlock()
	if old != nil {
		old.cleanup.Stop()
		old.buf.Release()
	}
}

// reportLeak runs once a message is collected with a buffer still attached. It
// forgets the attachment and logs it; the buffer stays allocated.
func reportLeak(wp weak.Pointer[gdrv1.DeviceBuffer]) {
	attached.Lock()
	a := attached.m[wp]
	delete(attached.m, wp)
	attached.Unlock()
	if a == nil {
		return
	}
	leaked.Add(1)
	log := opts().logger
	if log == nil {
		log = slog.Default()
	}
	// Not on this goroutine: it runs every cleanup of the process, and a
	// handler that blocks must not hold them up.
	go log.Warn("gdrcodec: a DeviceBuffer message was garbage-collected with its payload attached; the payload's memory is not freed: release messages with ReleaseAll, or take their buffers with Detach",
		"bytes", a.buf.Len(), "kind", a.buf.Kind().String())
}

// leaked counts the attachments reportLeak reported.
var leaked atomic.Int64

// Buffer returns the buffer attached to db: the one Attach gave it, or for a
// received message, the payload that arrived. The buffer stays owned by db: use
// it while db is attached, Retain it to keep it longer.
func Buffer(db *gdrv1.DeviceBuffer) (*devicebuf.Buffer, bool) { return lookup(db, false) }

// retained is Buffer with a reference of the caller's taken on the buffer,
// which it releases: a marshal reads the buffer through it, so that a
// release of the message meanwhile (the same message sent on another call,
// whose end releases it) does not free the memory under the read.
func retained(db *gdrv1.DeviceBuffer) (*devicebuf.Buffer, bool) { return lookup(db, true) }

// lookup returns the buffer attached to db, with a reference of the
// caller's taken under the attachments' lock if retain.
func lookup(db *gdrv1.DeviceBuffer, retain bool) (*devicebuf.Buffer, bool) {
	if db == nil {
		return nil, false
	}
	attached.Lock()
	defer attached.Unlock()
	a := attached.m[weak.Make(db)]
	if a == nil {
		return nil, false
	}
	if retain {
		a.buf.Retain()
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
// when done with a received message a call returned to you (or with a sent one
// whose buffers you no longer need) to return the memory to its pool. Nothing
// else frees it.
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

// Leaked returns the number of messages collected with a buffer still attached
// since the process started (tests check for leaks).
func Leaked() int64 { return leaked.Load() }

// walkDeviceBuffers calls fn for every DeviceBuffer message set in m, m
// itself if it is one (a method's request or response may be).
func walkDeviceBuffers(m protoreflect.Message, fn func(*gdrv1.DeviceBuffer)) {
	walkPayloads(m, fn, nil)
}

// walkPayloads calls db for every DeviceBuffer message set in m (m itself if
// it is one) and, unless nil, bytes for the value of every marked bytes
// field set in m.
func walkPayloads(m protoreflect.Message, db func(*gdrv1.DeviceBuffer), bytes func([]byte)) {
	if d, ok := m.Interface().(*gdrv1.DeviceBuffer); ok {
		db(d)
		return
	}
	if !mayCarry(m.Descriptor()) {
		return
	}
	for _, fd := range carryingFields(m) {
		bytesField := marked(fd)
		if !m.Has(fd) || bytesField && bytes == nil || !bytesField && valueMessage(fd) == nil {
			continue
		}
		switch v := m.Get(fd); {
		case fd.IsList():
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				walkValue(l.Get(i), bytesField, db, bytes)
			}
		case fd.IsMap():
			// A callback of its own: one that Range's escape took along
			// would put the common case's state on the heap too.
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				walkValue(mv, bytesField, db, bytes)
				return true
			})
		default:
			walkValue(v, bytesField, db, bytes)
		}
	}
}

// walkValue is walkPayloads for v, one value of a field: a marked bytes
// field's if bytesField, else a message.
func walkValue(v protoreflect.Value, bytesField bool, db func(*gdrv1.DeviceBuffer), bytes func([]byte)) {
	if bytesField {
		bytes(v.Bytes())
	} else {
		walkPayloads(v.Message(), db, bytes)
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
