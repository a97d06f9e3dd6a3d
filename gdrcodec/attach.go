package gdrcodec

import (
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
	"weak"

	"github.com/gdrpc/gdrpc/devicebuf"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Attachments: a DeviceBuffer message is generated code, so the devicebuf.Buffer
// it stands for lives in a side table keyed by the message's address, each
// entry holding a weak pointer to its message: an address the collector gave
// to a new message after the old one died names no attachment of the new one
// (the old one's weak pointer is nil by then), and a lookup takes no weak
// pointer of its own (one of a message that had none would cost a runtime
// record per message walked). Attached buffers are released explicitly, never
// by the garbage collector: memory a GPU or a NIC can see runs out long before
// a collection comes. gdrpc releases what a server call received when the
// call ends and a sent response once it was sent (ServerOptions; the net/rpc
// server codec likewise), and what a failed client call received; the
// application releases the rest with ReleaseAll or takes a buffer with Detach.
// A message collected with a buffer still attached is a leak: it is logged
// (WithLogger) and the buffer is not freed.
//
// A payload that arrived inline stays in the message's inline bytes, which
// the garbage collector frees with the message: nothing is attached for it
// (a side-table entry, a weak pointer and a cleanup would cost a small call
// more than its bytes). Buffer hands out a view of those bytes
// (devicebuf.HostView), which needs no release.
var attached = struct {
	sync.Mutex
	m map[uintptr]*attachment
}{m: make(map[uintptr]*attachment)}

type attachment struct {
	db      weak.Pointer[gdrv1.DeviceBuffer] // the message buf is attached to
	key     uintptr                          // its address: the entry's key
	buf     *devicebuf.Buffer
	cleanup runtime.Cleanup // reports the message collected with buf attached
}

// addr is db's key in attached.
func addr(db *gdrv1.DeviceBuffer) uintptr { return uintptr(unsafe.Pointer(db)) }

// attachmentOf returns db's attachment, or nil; attached's lock is held.
func attachmentOf(db *gdrv1.DeviceBuffer) *attachment {
	if a := attached.m[addr(db)]; a != nil && a.db.Value() == db {
		return a
	}
	return nil
}

// Attach makes b the payload of db: when a message holding db is marshaled, b's
// bytes travel with it (out-of-band with the gdr codec, inline otherwise).
// Attach takes its own reference to b, which db holds until ReleaseAll or
// Detach; the caller keeps theirs. A buffer attached before is released. db's
// length and kind are set from b. b's contents must not change while its
// receiver may still pull them: after Send returned, again where gRPC
// replays the message, and, for a server's response, after the server's
// call ended (the client pulls once the response reached it). gdrpc holds a
// reference of its own until then: a buffer of a pool goes back to the pool
// only once that reference is released too, so a server that writes each
// response into a buffer it allocates for it, and keeps no reference of its
// own to write into later, never changes a payload still to be pulled.
func Attach(db *gdrv1.DeviceBuffer, b *devicebuf.Buffer) {
	b.Retain()
	setAttachment(db, b)
	db.Length = uint64(b.Len())
	db.Kind = kindOf(b.Kind())
	db.Inline = nil
}

// New returns a DeviceBuffer message with b attached (Attach): the message
// takes its own reference to b, given back by ReleaseAll of a message that
// holds it (a gdrpc server does that for its responses once gRPC sent them).
// The caller still releases its own, with b.Release(), once it has no more
// use for b: typically right after New.
func New(b *devicebuf.Buffer) *gdrv1.DeviceBuffer {
	db := &gdrv1.DeviceBuffer{}
	Attach(db, b)
	return db
}

func setAttachment(db *gdrv1.DeviceBuffer, b *devicebuf.Buffer) {
	a := &attachment{db: weak.Make(db), key: addr(db), buf: b}
	attached.Lock()
	old := attachmentOf(db)
	// An entry of a message that died at this address stays out of the
	// table: its cleanup, due to run, reports it.
	attached.m[addr(db)] = a
	a.cleanup = runtime.AddCleanup(db, reportLeak, a)
	attached.Unlock()
	if old != nil {
		old.cleanup.Stop()
		old.buf.Release()
	}
}

// reportLeak runs once a message is collected with a buffer still attached. It
// forgets the attachment and logs it; the buffer stays allocated.
func reportLeak(a *attachment) {
	attached.Lock()
	if attached.m[a.key] == a {
		delete(attached.m, a.key)
	}
	attached.Unlock()
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
// it while db is attached, Retain it to keep it longer. A payload in db's
// inline bytes (one that arrived inline, or that the sender put there) comes
// as a view of those bytes (devicebuf.HostView), made at each call, which
// needs no release.
func Buffer(db *gdrv1.DeviceBuffer) (*devicebuf.Buffer, bool) {
	if b, ok := lookup(db, false); ok {
		return b, true
	}
	if db == nil || !inlinePayload(db) {
		return nil, false
	}
	return devicebuf.HostView(db.Inline), true
}

// inlinePayload reports whether db holds its payload in its inline bytes,
// as the decode checked them: as long as its length says.
func inlinePayload(db *gdrv1.DeviceBuffer) bool {
	return len(db.Inline) > 0 && uint64(len(db.Inline)) == db.Length
}

// attachedBuffer is Buffer for attached buffers alone: the codec's walks
// make no view of inline bytes.
func attachedBuffer(db *gdrv1.DeviceBuffer) (*devicebuf.Buffer, bool) { return lookup(db, false) }

// retained is attachedBuffer with a reference of the caller's taken on the
// buffer, which it releases: a marshal reads the buffer through it, so that
// a release of the message meanwhile (the same message sent on another
// call, whose end releases it) does not free the memory under the read.
func retained(db *gdrv1.DeviceBuffer) (*devicebuf.Buffer, bool) { return lookup(db, true) }

// lookup returns the buffer attached to db, with a reference of the
// caller's taken under the attachments' lock if retain.
func lookup(db *gdrv1.DeviceBuffer, retain bool) (*devicebuf.Buffer, bool) {
	if db == nil {
		return nil, false
	}
	attached.Lock()
	defer attached.Unlock()
	a := attachmentOf(db)
	if a == nil {
		return nil, false
	}
	if retain {
		a.buf.Retain()
	}
	return a.buf, true
}

// Detach removes db's buffer and hands the caller db's reference to it. A
// payload in db's inline bytes is handed over as a view of them
// (devicebuf.HostView), and db keeps no inline bytes after.
func Detach(db *gdrv1.DeviceBuffer) *devicebuf.Buffer {
	if b := detach(db); b != nil || db == nil || !inlinePayload(db) {
		return b
	}
	b := devicebuf.HostView(db.Inline)
	db.Inline = nil
	return b
}

// detach is Detach for attached buffers alone: inline bytes stay.
func detach(db *gdrv1.DeviceBuffer) *devicebuf.Buffer {
	if db == nil {
		return nil
	}
	attached.Lock()
	a := attachmentOf(db)
	if a != nil {
		delete(attached.m, a.key)
	}
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
// else frees it. Inline bytes stay in the message, which still holds them
// (the garbage collector frees them with it).
func ReleaseAll(m proto.Message) {
	if m == nil {
		return
	}
	walkDeviceBuffers(m.ProtoReflect(), func(db *gdrv1.DeviceBuffer) {
		if b := detach(db); b != nil {
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
