package gdrcodec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/trace"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	encproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/gdrpc/gdrpc/devicebuf"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Name is the content-subtype of the out-of-band codec: gdrpc clients send
// "application/grpc+gdr".
const Name = "gdr"

// DefaultEagerThreshold: payloads shorter than this travel inline.
const DefaultEagerThreshold = 64 << 10

// StreamEagerThreshold: over a TCP session (peers that do not trust each
// other, or ModeTCP), where host payloads travel as bytes on the session's
// bulk lane, host payloads shorter than this travel inline too, as long as
// all of one message's inline payloads, those under DefaultEagerThreshold
// included, add up to at most StreamInlineBudget: a message carries no more
// inline than it would have otherwise, or than the budget. There a pull
// costs a round trip more than the call (its request, then the bytes), so
// inline is the faster way for small payloads; from about 128 KiB the bulk
// lane carries the bytes faster on a many-core host (README). GPU payloads keep
// DefaultEagerThreshold (CUDA IPC may move them over a TCP session too), and
// an explicit WithEagerThreshold applies to every session instead.
const (
	StreamEagerThreshold = 128 << 10
	StreamInlineBudget   = 1 << 20
)

// Option configures the codecs.
type Option func(*options)

type options struct {
	eager   int
	eagerOf bool // eager was given (WithEagerThreshold): it applies over every session
	alloc   devicebuf.Allocator
	maxRecv int64 // WithMaxReceivePayload (limits.go)
	pending int   // WithNetRPCPending (netrpc.go)
	// writeTimeout is WithNetRPCWriteTimeout's, pendingBytes
	// WithNetRPCPendingBytes's (netrpc.go).
	writeTimeout time.Duration
	pendingBytes int64
	maxBody      int // WithNetRPCMaxBody (netrpc.go)
	logger       *slog.Logger
}

// WithEagerThreshold sets the payload size from which the gdr codec moves a
// payload out-of-band, over every session; shorter ones travel inline. If
// zero, DefaultEagerThreshold, and for host payloads over TCP sessions
// StreamEagerThreshold within StreamInlineBudget; negative sends everything
// out-of-band (tests).
func WithEagerThreshold(n int) Option {
	return func(o *options) { o.eager, o.eagerOf = n, n != 0 }
}

// WithReceiveAllocator sets where received DeviceBuffer payloads land: host
// memory, a GPU (devicebuf.NewPayloadPool over devicebuf.NewCUDAAllocator,
// whose blocks later payloads reuse), or a pool of the user's. The payloads
// that came inline in one message share one allocation of an allocator that
// is not host memory, each a view starting 256-byte aligned. If nil,
// the registered host pool of the default UCX context (plain host memory where
// there is no UCX).
func WithReceiveAllocator(a devicebuf.Allocator) Option { return func(o *options) { o.alloc = a } }

// WithLogger sets where the codecs report what needs a person's attention: a
// message garbage-collected with a buffer still attached (a leak: the
// buffer is never freed). A leak belongs to no connection, so only Register's logger
// counts; if nil, slog.Default() at the time of the report.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

var (
	current    atomic.Pointer[options]
	registered atomic.Bool
	registerMu sync.Mutex

	// bodies encodes the message bodies, as gRPC's own proto codec does.
	bodies bodyCodec

	// gdrCodec is the out-of-band codec: clients name it per ClientConn
	// (grpc.ForceCodecV2); servers find it by content-subtype once Register ran.
	gdrCodec = &codec{name: Name, oob: true}
	// gdrClientCodec is gdrCodec for ClientConns (DialOptions without
	// options).
	gdrClientCodec = &codec{name: Name, oob: true, client: true}
)

// Register registers the gdr codec with gRPC and replaces the proto codec with one
// that behaves exactly like gRPC's for ordinary messages and sends attached device
// buffers inline, so plain gRPC peers still receive correct data. gRPC's codec
// registry must not change while RPCs run, so call Register once, at start-up,
// before the process creates any gRPC server or client; it is never called from an
// init function, nor by DialOptions, ServerOptions or the net/rpc codecs. A server
// needs it: without it, gdr calls fail with FailedPrecondition. A server also
// needs ServerOptions (or listener.ServerOptions): without their interceptors
// and stats handler the codec cannot tell which connection a message came
// over, so it refuses every payload a message names by reference (the call
// fails with an error that names ServerOptions) rather than pull it on the
// word of a peer that may have proved nothing. The same holds for a client
// that names the gdr codec without DialOptions. A ClientConn made with
// DialOptions does not need Register (its codec is set per ClientConn), though
// the options Register sets apply to it. Later calls only replace the options, which is safe
// at any time.
func Register(opts ...Option) {
	current.Store(newOptions(opts))
	registerMu.Lock()
	defer registerMu.Unlock()
	if !registered.Load() {
		encoding.RegisterCodecV2(gdrCodec)
		encoding.RegisterCodecV2(&codec{name: encproto.Name})
		registered.Store(true)
	}
}

func newOptions(opts []Option) *options {
	o := &options{eager: DefaultEagerThreshold}
	for _, fn := range opts {
		fn(o)
	}
	if o.eager == 0 {
		o.eager = DefaultEagerThreshold
	}
	return o
}

// defaultOptions are the options before Register sets any.
var defaultOptions = newOptions(nil)

func opts() *options {
	if o := current.Load(); o != nil {
		return o
	}
	return defaultOptions
}

// codec is the gdr codec (oob) or the proto replacement (inline only).
type codec struct {
	name string
	oob  bool
	// client: a ClientConn's (DialOptions), which decodes responses alone:
	// a call number in one names nothing of this process's (a server's
	// request, whose number serverStats takes, is decoded by the
	// registry's codec).
	client bool
	o      *options // nil: Register's
	// sess is the session a net/rpc conn's codec runs over; nil for gRPC's,
	// whose messages find theirs through the call.
	sess *transport.Session
}

// via returns the session the message w walks goes over, where known: a
// net/rpc conn's, a server's response's, or a client's request's.
func (c *codec) via(w *rewriter) *transport.Session {
	switch {
	case c.sess != nil:
		return c.sess
	case w.to != nil:
		return w.to.s
	}
	return w.reqTo
}

// streamsPayloads reports whether s moves payloads as bytes on its bulk lane
// (StreamEagerThreshold).
func streamsPayloads(s *transport.Session) bool {
	return s != nil && s.Transport() == "tcp"
}

// options returns the codec's options: its own (DialOptions with options),
// else Register's.
func (c *codec) options() *options {
	if c.o != nil {
		return c.o
	}
	return opts()
}

func (c *codec) Name() string { return c.name }

func (c *codec) Marshal(v any) (mem.BufferSlice, error) { return c.marshal(v, holdOf(v)) }

// marshal is Marshal with the hold (nil: none) that keeps v's payloads in
// the outbox: a gRPC call's, found by the message, or a net/rpc request's,
// given by its codec.
func (c *codec) marshal(v any, h *hold) (mem.BufferSlice, error) {
	defer trace.StartRegion(context.Background(), "gdrpc.marshal").End()
	vv := messageV2Of(v)
	if vv == nil {
		return nil, fmt.Errorf("gdrcodec: cannot marshal %T, want proto.Message", v)
	}
	var call uint64 // the number of a unary request's call, which its body carries
	if c.oob {
		call = h.callNumber()
	}
	m := vv.ProtoReflect()
	if !mayCarry(m.Descriptor()) {
		return bodies.marshal(v, call)
	}
	o := c.options()
	w := &rewriter{oob: c.oob, eager: o.eager, hold: h}
	defer w.release()
	shared := false
	if c.oob {
		w.to = takeDestination(v)
		if shared = w.to == sharedMessage; shared {
			w.to = nil // maybe another call's: no receive space, no binding
		}
		w.reqCtx, w.reqTo = w.hold.attempt()
		if !o.eagerOf && streamsPayloads(c.via(w)) {
			w.streamEager, w.root = StreamEagerThreshold, m
		}
	}
	var out protoreflect.Message
	var err error
	var path [maxPatchDepth]protowire.Number
	// Only the gdr codec's receivers are gdrpc's decoders, which merge a
	// field that occurs twice: some of other languages' keep the last
	// occurrence instead, and would lose what the first held.
	patched := c.oob && w.findPatches(m, &path, 0)
	if patched {
		err = w.patch()
	} else {
		w.npatches = 0
		out, err = w.message(m)
	}
	if err == nil && shared && w.first != nil {
		// Its buffers go once the other call sent it.
		err = errSharedMessage
	}
	if err != nil {
		w.abort()
		return nil, err
	}
	if out == nil && w.npatches == 0 {
		return bodies.marshal(v, call)
	}
	if err := w.to.admit(w.offers); err != nil {
		w.abort()
		return nil, codecError(codes.ResourceExhausted, "%v", err)
	}
	var data mem.BufferSlice
	if patched {
		data, err = bodies.marshalPatched(v, call, w.patches[:w.npatches])
	} else {
		data, err = bodies.marshal(out.Interface(), call)
	}
	if err != nil {
		w.abort()
		return nil, err
	}
	if w.hold == nil {
		noteSent(v, w.offers)
	}
	w.hold.land(w.reqTo, w.reqLanded)
	w.to.landed(v, w.landed)
	return data, nil
}

func (c *codec) Unmarshal(data mem.BufferSlice, v any) error {
	defer trace.StartRegion(context.Background(), "gdrpc.unmarshal").End()
	if !c.client && isSingleRequest(v) {
		// Before anything is released, decoded or filed for it: gRPC
		// decodes a second message into the first's value only to refuse
		// the call, and nothing takes back what is filed for that decode.
		return codecError(codes.InvalidArgument, "a second request message on a call that takes one")
	}
	vv := messageV2Of(v)
	carries := vv != nil && mayCarry(vv.ProtoReflect().Descriptor())
	if carries {
		// The decode resets v: what an earlier one attached to it (a
		// stream's message received into the same value) would be lost,
		// never released.
		ReleaseAll(vv)
	}
	// Only the gdr codec's bodies carry a call number: the proto
	// replacement decodes what plain peers send, as gRPC's own codec does.
	call, err := bodies.unmarshal(data, v, c.oob)
	if err != nil {
		if !carries {
			// Nothing was attached or pulled, and no stats event would
			// take a status filed for a message of this type: the decode
			// fails as a plain codec's does.
			return err
		}
		// A status (too many payloads, a malformed call number) reaches
		// the caller as the others do; a decoding error stays gRPC's.
		return receiveFailed(v, err)
	}
	if !carries {
		if call == 0 || c.client {
			return nil
		}
		if _, tracked := recvCalls.Load(v); !tracked && serverRequest(vv.ProtoReflect()) {
			// A request that cannot carry a payload, for a response that
			// can: the call's number is all serverStats takes.
			pendingPulls.put(v, &pulls{m: vv.ProtoReflect(), call: call})
		}
		return nil
	}
	m := vv.ProtoReflect()
	// A server's unary request has no call yet (serverRequest): its
	// context is the background's, and a failed walk gives back no receive
	// space on its word (the client does when its call ends).
	ctx, from := decodeContext(v)
	request := c.oob && !c.client && from == untrackedSender && serverRequest(m)
	switch {
	case !c.oob:
		from = plainSender
	case request:
		from = gdrSender // pulled once serverStats knows the call's connection
	}
	p, err := collectPulls(ctx, m, from, c.options())
	if err == nil {
		if request {
			// gRPC decodes a unary request before any interceptor runs and
			// tells a codec nothing of the call, not even its connection:
			// the pulls wait for serverStats, told of the request right
			// after this decode with the call's context, which runs them
			// only for a call over a gdrpc session.
			pending := p // on the heap for this branch alone
			pending.call = call
			pendingPulls.put(v, &pending)
			return nil
		}
		if err = parkPulls(ctx, &p); err != nil {
			p.discard(ctx)
		} else {
			err = p.run(ctx)
		}
	}
	if err != nil {
		return receiveFailed(v, err)
	}
	return nil
}

func messageV2Of(v any) proto.Message {
	switch v := v.(type) {
	case protoadapt.MessageV1:
		return protoadapt.MessageV2Of(v)
	case protoadapt.MessageV2:
		return v
	}
	return nil
}

// ---- which messages can carry payloads --------------------------------------

var carries sync.Map // protoreflect.FullName -> bool

var deviceBufferName = (&gdrv1.DeviceBuffer{}).ProtoReflect().Descriptor().FullName()

// mayCarry reports whether messages of type md can hold a DeviceBuffer or a
// marked bytes field anywhere inside.
func mayCarry(md protoreflect.MessageDescriptor) bool {
	if v, ok := knownTypes.Load(md); ok {
		return v.(*knownType).carries
	}
	if v, ok := carries.Load(md.FullName()); ok {
		return v.(bool)
	}
	r := search(md, map[protoreflect.FullName]bool{})
	carries.Store(md.FullName(), r)
	if inGlobalRegistry(md) {
		knownTypes.Store(md, &knownType{carries: r, c: newCarrier(md)})
	}
	return r
}

// knownTypes holds, by descriptor, what carries and carriers hold by name,
// for the message types of the global registry alone (generated messages'):
// a descriptor key hashes as a pointer, where a name hashes its bytes, and
// a walk asks several times per message. Dynamic descriptors, which a
// process may make anew at will, would grow it without bound; they keep
// the name caches. protoreflect.MessageDescriptor -> *knownType.
var knownTypes sync.Map

type knownType struct {
	carries bool
	c       *carrier
}

// knownFields is knownTypes for marked: protoreflect.FieldDescriptor ->
// bool, for the fields of registered types.
var knownFields sync.Map

// inGlobalRegistry reports whether d is the global registry's descriptor of
// its name.
func inGlobalRegistry(d protoreflect.Descriptor) bool {
	r, err := protoregistry.GlobalFiles.FindDescriptorByName(d.FullName())
	return err == nil && r == d
}

// A carrier is what the codec knows of a message type: the fields that may
// hold a payload (marked bytes fields, and fields of message types that may
// carry one). Walks of a message visit those alone, not every populated
// field: most fields of a request (names, shapes, options) cannot.
type carrier struct {
	md     protoreflect.MessageDescriptor
	fields []protoreflect.FieldDescriptor
	// ext: the type has extension ranges, and an extension may carry a
	// payload too: its walks take every populated field.
	ext bool
}

var carriers sync.Map // protoreflect.FullName -> *carrier

// carryingFields returns the fields of m to walk for payloads: those of its
// type that may hold one, or, where the type has extensions, every
// populated field. A walk skips those m does not have.
func carryingFields(m protoreflect.Message) []protoreflect.FieldDescriptor {
	md := m.Descriptor()
	var c *carrier
	if v, ok := knownTypes.Load(md); ok {
		c = v.(*knownType).c
	} else if v, ok := carriers.Load(md.FullName()); ok && v.(*carrier).md == md {
		c = v.(*carrier)
	} else {
		c = newCarrier(md)
		if !ok {
			// Kept per name, for the first descriptor of the name: a
			// carrier's fields belong to its own descriptor, so another
			// one of that name (a dynamic message's) gets one made anew.
			carriers.LoadOrStore(md.FullName(), c)
		}
		if inGlobalRegistry(md) {
			knownTypes.Store(md, &knownType{carries: mayCarry(md), c: c})
		}
	}
	if !c.ext {
		return c.fields
	}
	var all []protoreflect.FieldDescriptor
	m.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		all = append(all, fd)
		return true
	})
	return all
}

func newCarrier(md protoreflect.MessageDescriptor) *carrier {
	c := &carrier{md: md, ext: md.ExtensionRanges().Len() > 0}
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if sub := valueMessage(fd); marked(fd) || sub != nil && mayCarry(sub) {
			c.fields = append(c.fields, fd)
		}
	}
	return c
}

func search(md protoreflect.MessageDescriptor, seen map[protoreflect.FullName]bool) bool {
	if md.FullName() == deviceBufferName {
		return true
	}
	if seen[md.FullName()] {
		return false
	}
	seen[md.FullName()] = true
	fields := md.Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if marked(fd) {
			return true
		}
		if sub := valueMessage(fd); sub != nil && search(sub, seen) {
			return true
		}
	}
	return false
}

// marked reports whether fd is a bytes field with the device_buffer option.
// Every walk of a message asks it of the message's bytes fields: the answer
// is kept per field (reading the option is an extension lookup, about four
// times the cost of the cache's).
func marked(fd protoreflect.FieldDescriptor) bool {
	if fd.Kind() != protoreflect.BytesKind || fd.IsMap() {
		return false
	}
	if v, ok := knownFields.Load(fd); ok {
		return v.(bool)
	}
	if v, ok := markedFields.Load(fd.FullName()); ok && v.(markedField).fd == fd {
		return v.(markedField).marked
	}
	r := false
	if o := fd.Options(); o != nil {
		r, _ = proto.GetExtension(o, gdrv1.E_DeviceBuffer).(bool)
	}
	// Kept for the first descriptor of the name, as carriers are: another
	// of that name (a dynamic message's) reads its own options each time.
	markedFields.LoadOrStore(fd.FullName(), markedField{fd, r})
	if md, ok := fd.Parent().(protoreflect.MessageDescriptor); ok && inGlobalRegistry(md) {
		knownFields.Store(fd, r)
	}
	return r
}

// markedFields caches marked per field name: protoreflect.FullName ->
// markedField.
var markedFields sync.Map

type markedField struct {
	fd     protoreflect.FieldDescriptor
	marked bool
}

// ---- marked bytes fields on the wire -----------------------------------------

// A marked bytes field sent by the gdr codec starts with bytesMagic when it
// does not hold the payload itself: then the next byte says what follows:
// markDescriptor, a DeviceBuffer descriptor; markEscaped, a payload that
// happened to start with the magic.
var bytesMagic = []byte("\x00\xffgdrpc\x00")

const (
	markEscaped    = 0
	markDescriptor = 1
)

// ---- marshal: replacing payloads by descriptors ------------------------------

type rewriter struct {
	// first and kept are the buffers the message's walk read, each with a
	// reference of the rewriter's until the body is marshaled (release).
	// The first has a field of its own: most messages carry one payload,
	// and a slice's array would be allocated for every marshal (a
	// rewriter's fields all leave its marshal's frame as one).
	first  *devicebuf.Buffer
	kept   []*devicebuf.Buffer
	oob    bool
	eager  int
	hold   *hold
	offers []oob.Token
	to     *destination     // where the message goes, when the server's interceptors know it
	landed []oob.Descriptor // payloads written into the receiver's advertised space
	// Over a TCP session, payloads from eager up to streamEager travel
	// inline while streamBudget, what is left of StreamInlineBudget, holds
	// them (outOfBand); root is the message walked, whose payloads under
	// eager the budget counts once one of them is a candidate (budgeted).
	streamEager  int
	streamBudget int
	budgeted     bool
	root         protoreflect.Message
	// A request's call and the session gRPC picked for it, and the
	// payloads written into the space its server advertised over it.
	reqCtx    context.Context
	reqTo     *transport.Session
	reqLanded []oob.Descriptor
	// patches are the message's payloads replaced by appending to its
	// body (findPatches), the first npatches of them.
	patches  [maxPatches]patch
	npatches int
}

// A patch is a DeviceBuffer of the message being marshaled, reached from it
// through singular message fields alone (path, the fields' numbers), that
// holds no more than Attach sets (its length and kind): what it sends (out)
// follows the message's own encoding as another occurrence of those fields,
// which every protobuf decoder merges into the first (the encoding's rule
// for a message field that occurs twice), so that the receiver reads out
// alone, as from a rewritten copy of the message. Unlike a copy, it needs no
// new messages nor setting fields through reflection. The gdr codec alone
// patches: its peers decode with gdrpc.
type patch struct {
	path  [maxPatchDepth]protowire.Number
	depth int
	db    *gdrv1.DeviceBuffer
	out   *gdrv1.DeviceBuffer // nil: sent as it is
}

// zeroLength and zeroKind report whether db sets a field that out leaves at
// zero, which the patch then sets to zero explicitly (for such fields the
// last occurrence wins, a zero one too).
func (p *patch) zeroLength() bool { return p.db.Length != 0 && p.out.Length == 0 }
func (p *patch) zeroKind() bool   { return p.db.Kind != 0 && p.out.Kind == 0 }

// The numbers of the DeviceBuffer fields that Attach sets.
var (
	lengthField = deviceBufferField("length")
	kindField   = deviceBufferField("kind")
)

func deviceBufferField(name protoreflect.Name) protowire.Number {
	fd := (&gdrv1.DeviceBuffer{}).ProtoReflect().Descriptor().Fields().ByName(name)
	if fd == nil {
		panic("gdrcodec: DeviceBuffer has no field " + string(name))
	}
	return fd.Number()
}

// attachedOnly reports whether db holds its length and kind at most: any
// other field, known or not, would make its encoding longer.
func attachedOnly(db *gdrv1.DeviceBuffer) bool {
	n := 0
	if db.Length != 0 {
		n += protowire.SizeTag(lengthField) + protowire.SizeVarint(db.Length)
	}
	if db.Kind != 0 {
		n += protowire.SizeTag(kindField) + protowire.SizeVarint(uint64(db.Kind))
	}
	return proto.Size(db) == n
}

// The most payloads a message may have, and the deepest they may be, to be
// patched; other messages are rewritten in a copy.
const maxPatches, maxPatchDepth = 4, 4

// findPatches notes in w.patches the payloads of m, the message marshaled
// (depth 0) or one inside it reached through path[:depth], and reports whether
// they can all be patched: each one a DeviceBuffer as Attach leaves it
// (attachedOnly) under singular message fields, and no marked bytes field
// set. It reads the message alone.
func (w *rewriter) findPatches(m protoreflect.Message, path *[maxPatchDepth]protowire.Number, depth int) bool {
	if depth == 0 {
		if _, ok := m.Interface().(*gdrv1.DeviceBuffer); ok {
			return false // the message itself is the payload
		}
	}
	if !mayCarry(m.Descriptor()) {
		return true
	}
	for _, fd := range carryingFields(m) {
		if !m.Has(fd) {
			continue
		}
		if marked(fd) {
			return false
		}
		if sub := valueMessage(fd); sub == nil || !mayCarry(sub) {
			continue
		}
		if fd.IsList() || fd.IsMap() || fd.Kind() != protoreflect.MessageKind || fd.IsExtension() || depth == maxPatchDepth {
			// An extension may belong to a message of the legacy message-set
			// encoding, which a field appended in the plain one would break.
			return false
		}
		path[depth] = fd.Number()
		v := m.Get(fd).Message()
		db, ok := v.Interface().(*gdrv1.DeviceBuffer)
		if !ok {
			if !w.findPatches(v, path, depth+1) {
				return false
			}
			continue
		}
		if w.npatches == maxPatches || !attachedOnly(db) {
			return false
		}
		w.patches[w.npatches] = patch{path: *path, depth: depth + 1, db: db}
		w.npatches++
	}
	return true
}

// patch finds what each patch sends, as message does for a copy.
func (w *rewriter) patch() error {
	for i := range w.npatches {
		out, err := w.deviceBuffer(w.patches[i].db)
		if err != nil {
			return err
		}
		w.patches[i].out = out
	}
	return nil
}

// size returns the bytes p adds to a body, and sets sizes[d] to what
// follows the tag and length of path[d].
func (p *patch) size(sizes *[maxPatchDepth]int) int {
	n := proto.Size(p.out)
	if p.zeroLength() {
		n += protowire.SizeTag(lengthField) + 1
	}
	if p.zeroKind() {
		n += protowire.SizeTag(kindField) + 1
	}
	for d := p.depth - 1; d >= 0; d-- {
		sizes[d] = n
		n = protowire.SizeTag(p.path[d]) + protowire.SizeBytes(n)
	}
	return n
}

// appendTo appends p's encoding to b; sizes are p.size's.
func (p *patch) appendTo(b []byte, sizes *[maxPatchDepth]int) ([]byte, error) {
	for d := range p.depth {
		b = protowire.AppendVarint(protowire.AppendTag(b, p.path[d], protowire.BytesType), uint64(sizes[d]))
	}
	b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(b, p.out)
	if p.zeroLength() {
		b = protowire.AppendVarint(protowire.AppendTag(b, lengthField, protowire.VarintType), 0)
	}
	if p.zeroKind() {
		b = protowire.AppendVarint(protowire.AppendTag(b, kindField, protowire.VarintType), 0)
	}
	return b, err
}

func (w *rewriter) abort() {
	for _, t := range w.offers {
		oob.Withdraw(t)
	}
	for _, d := range w.landed {
		oob.Reclaim(w.to.s, d)
	}
	for _, d := range w.reqLanded {
		oob.Reclaim(w.reqTo, d)
	}
}

// release gives back the references on the buffers the walk read.
func (w *rewriter) release() {
	if w.first != nil {
		w.first.Release()
	}
	for _, b := range w.kept {
		b.Release()
	}
	w.first, w.kept = nil, nil
}

// outOfBand decides whether a payload of n bytes in memory of kind k travels
// out-of-band; one it keeps inline under the stream threshold takes its
// share of the budget. GPU payloads keep the eager threshold: CUDA IPC may
// move them between processes of one host, over a TCP session too.
func (w *rewriter) outOfBand(n int, k devicebuf.Kind) bool {
	switch {
	case !w.oob || n < w.eager:
		return false
	case k != devicebuf.Host || n >= w.streamEager:
		return true
	}
	if !w.budgeted {
		w.streamBudget, w.budgeted = StreamInlineBudget-inlineUnder(w.root, w.eager), true
	}
	if n > w.streamBudget {
		return true
	}
	w.streamBudget -= n
	return false
}

// offer puts src in the outbox, or, where landable and the message's
// destination is known, writes it into the receiver's advertised space: a
// server's response instead of the outbox, a client's request as well
// (gRPC may replay it elsewhere).
func (w *rewriter) offer(src oob.Source, landable bool) oob.Descriptor {
	opt := oob.OfferOptions{Held: w.hold.held()}
	var d oob.Descriptor
	switch {
	case landable && w.to != nil && w.hold == nil && w.to.mayLand():
		opt.Call = w.to.clientCall()
		if d = oob.OfferTo(w.to.s, src, opt); d.Space != 0 {
			w.landed = append(w.landed, d)
			return d
		}
	case landable && w.reqTo != nil:
		if d = oob.OfferRequest(w.reqCtx, w.reqTo, src, opt); d.Space != 0 {
			w.reqLanded = append(w.reqLanded, d)
		}
	default:
		d = oob.Offer(src, opt)
	}
	w.offers = append(w.offers, d.Token)
	if w.hold != nil {
		// A payload written into the server's request space stays offered
		// until the server's application gives its range back: the call's
		// stream does not wait for that.
		w.hold.add(d.Token, d.Space == 0)
	}
	return d
}

// message returns a shallow copy of m with its payloads replaced, or nil when
// nothing in m needed replacing. m itself is never modified.
func (w *rewriter) message(m protoreflect.Message) (protoreflect.Message, error) {
	if db, ok := m.Interface().(*gdrv1.DeviceBuffer); ok {
		out, err := w.deviceBuffer(db)
		if out == nil || err != nil {
			return nil, err
		}
		return out.ProtoReflect(), nil
	}
	if !mayCarry(m.Descriptor()) {
		return nil, nil
	}
	var out protoreflect.Message
	for _, fd := range carryingFields(m) {
		if !m.Has(fd) {
			continue
		}
		nv, changed, err := w.field(m, fd, m.Get(fd))
		if err != nil {
			return nil, err
		}
		if changed {
			if out == nil {
				out = shallowCopy(m)
			}
			out.Set(fd, nv)
		}
	}
	return out, nil
}

// inlineUnder returns the bytes of m's payloads that travel inline over any
// session: attached buffers and marked bytes fields shorter than eager, and
// DeviceBuffers' inline bytes of any length (a payload that arrived inline,
// sent on as it is), wherever they are in m.
func inlineUnder(m protoreflect.Message, eager int) int {
	total := 0
	add := func(n int) {
		if n < eager {
			total += n
		}
	}
	walkPayloads(m, func(db *gdrv1.DeviceBuffer) {
		if b, ok := attachedBuffer(db); ok {
			add(b.Len())
		} else {
			total += len(db.GetInline())
		}
	}, func(b []byte) { add(len(b)) })
	return total
}

func shallowCopy(m protoreflect.Message) protoreflect.Message {
	out := m.New()
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		out.Set(fd, v)
		return true
	})
	if u := m.GetUnknown(); len(u) > 0 {
		out.SetUnknown(u)
	}
	return out
}

// value returns what to send for v, one value of field fd (an element of a
// list, a map's value), and whether it differs from v.
func (w *rewriter) value(fd protoreflect.FieldDescriptor, v protoreflect.Value) (protoreflect.Value, bool, error) {
	if marked(fd) {
		b, changed := w.bytesField(v.Bytes())
		return protoreflect.ValueOfBytes(b), changed, nil
	}
	out, err := w.message(v.Message())
	if out == nil || err != nil {
		return v, false, err
	}
	return protoreflect.ValueOfMessage(out), true, nil
}

func (w *rewriter) field(parent protoreflect.Message, fd protoreflect.FieldDescriptor, v protoreflect.Value) (protoreflect.Value, bool, error) {
	if sub := valueMessage(fd); !marked(fd) && (sub == nil || !mayCarry(sub)) {
		return v, false, nil
	}
	switch {
	case fd.IsList():
		l := v.List()
		var nl protoreflect.List
		for i := 0; i < l.Len(); i++ {
			e, changed, err := w.value(fd, l.Get(i))
			if err != nil {
				return v, false, err
			}
			if changed && nl == nil {
				nl = parent.New().NewField(fd).List()
				for j := 0; j < i; j++ {
					nl.Append(l.Get(j))
				}
			}
			if nl != nil {
				nl.Append(e)
			}
		}
		if nl == nil {
			return v, false, nil
		}
		return protoreflect.ValueOfList(nl), true, nil
	case fd.IsMap():
		mp := v.Map()
		type kv struct {
			k protoreflect.MapKey
			v protoreflect.Value
		}
		// The entries are gathered first and walked after: a Range
		// callback that took w along would put every marshal's rewriter on
		// the heap (the callback escapes).
		entries := make([]kv, 0, mp.Len())
		mp.Range(func(k protoreflect.MapKey, e protoreflect.Value) bool {
			entries = append(entries, kv{k, e})
			return true
		})
		var changedKVs []kv
		for _, e := range entries {
			ne, changed, err := w.value(fd, e.v)
			if err != nil {
				return v, false, err
			}
			if changed {
				changedKVs = append(changedKVs, kv{e.k, ne})
			}
		}
		if len(changedKVs) == 0 {
			return v, false, nil
		}
		nm := parent.New().NewField(fd).Map()
		mp.Range(func(k protoreflect.MapKey, e protoreflect.Value) bool {
			nm.Set(k, e)
			return true
		})
		for _, c := range changedKVs {
			nm.Set(c.k, c.v)
		}
		return protoreflect.ValueOfMap(nm), true, nil
	default:
		return w.value(fd, v)
	}
}

// bytesField returns what a marked bytes field carries on the wire.
func (w *rewriter) bytesField(b []byte) ([]byte, bool) {
	if w.outOfBand(len(b), devicebuf.Host) {
		d := w.offer(oob.Source{Bytes: b}, false) // the bytes encoding names no receive space
		desc, err := proto.Marshal(descriptorMessage(d))
		if err != nil {
			panic("gdrcodec: marshal descriptor: " + err.Error()) // a fixed, valid message
		}
		out := make([]byte, 0, len(bytesMagic)+1+len(desc))
		out = append(append(append(out, bytesMagic...), markDescriptor), desc...)
		return out, true
	}
	if w.oob && bytes.HasPrefix(b, bytesMagic) {
		out := make([]byte, 0, len(bytesMagic)+1+len(b))
		return append(append(append(out, bytesMagic...), markEscaped), b...), true
	}
	return b, false
}

// deviceBuffer returns the DeviceBuffer to send for db, or nil to send db as is.
func (w *rewriter) deviceBuffer(db *gdrv1.DeviceBuffer) (*gdrv1.DeviceBuffer, error) {
	b, ok := retained(db)
	if !ok {
		if db.GetLength() > 0 && len(db.GetInline()) == 0 && len(db.GetToken()) == 0 {
			// Its receiver would refuse it; the mistake is the sender's.
			return nil, codecError(codes.FailedPrecondition, "a DeviceBuffer of %d bytes with no payload attached: its buffer was released or detached (a server releases a response's buffers once it is sent: send each message once, or Attach a buffer again)", db.GetLength())
		}
		// Sent as it is: inline bytes (a payload that arrived inline, sent
		// on, or put there by the sender), or none.
		return nil, nil
	}
	if w.first == nil {
		w.first = b
	} else {
		w.kept = append(w.kept, b)
	}
	if w.outOfBand(b.Len(), b.Kind()) {
		return descriptorMessage(w.offer(oob.Source{Buffer: b}, true)), nil
	}
	out := &gdrv1.DeviceBuffer{Length: uint64(b.Len()), Kind: kindOf(b.Kind()), Device: int32(b.Device()), DeviceUuid: b.DeviceUUID()}
	if hb, err := b.HostBytes(); err == nil {
		out.Inline = hb // marshal copies it out before returning
		return out, nil
	}
	out.Inline = make([]byte, b.Len())
	dst := devicebuf.HostFromBytes(out.Inline)
	defer dst.Release()
	if err := devicebuf.Copy(dst, b); err != nil {
		return nil, fmt.Errorf("gdrcodec: copy %v payload to host: %w", b.Kind(), err)
	}
	return out, nil
}

func descriptorMessage(d oob.Descriptor) *gdrv1.DeviceBuffer {
	k := gdrv1.Kind_KIND_HOST
	if d.Kind == devicebuf.CUDA {
		k = gdrv1.Kind_KIND_CUDA
	}
	return &gdrv1.DeviceBuffer{
		Length: d.Length, Kind: k,
		Owner: d.Owner[:], Token: d.Token[:],
		Device: int32(d.Device), DeviceUuid: d.DeviceUUID, HostId: d.HostID[:],
		Space: d.Space, SpaceOffset: d.SpaceOffset, SpacePath: uint32(d.SpacePath), SpaceEvent: d.SpaceEvent, SpaceGen: d.SpaceGen,
	}
}

// ParseDescriptor reads the out-of-band descriptor of db. It reports false when
// db carries no descriptor (its payload, if any, is inline).
func ParseDescriptor(db *gdrv1.DeviceBuffer) (oob.Descriptor, bool, error) {
	if len(db.GetOwner()) == 0 && len(db.GetToken()) == 0 {
		return oob.Descriptor{}, false, nil
	}
	var d oob.Descriptor
	if len(db.Owner) != len(d.Owner) || len(db.Token) != len(d.Token) {
		return d, true, fmt.Errorf("descriptor: owner of %d bytes, token of %d, want %d and %d", len(db.Owner), len(db.Token), len(d.Owner), len(d.Token))
	}
	if len(db.HostId) != 0 && len(db.HostId) != len(d.HostID) {
		return d, true, fmt.Errorf("descriptor: host id of %d bytes", len(db.HostId))
	}
	if len(db.Inline) != 0 {
		return d, true, errors.New("descriptor: both a token and inline bytes")
	}
	copy(d.Owner[:], db.Owner)
	copy(d.Token[:], db.Token)
	copy(d.HostID[:], db.HostId)
	d.Length = db.Length
	switch db.Kind {
	case gdrv1.Kind_KIND_HOST:
		d.Kind = devicebuf.Host
	case gdrv1.Kind_KIND_CUDA:
		d.Kind = devicebuf.CUDA
	default:
		return d, true, fmt.Errorf("descriptor: unknown kind %d", db.Kind)
	}
	d.Device, d.DeviceUUID = int(db.Device), db.DeviceUuid
	if db.SpacePath > 0xff {
		return d, true, fmt.Errorf("descriptor: receive space path %d", db.SpacePath)
	}
	d.Space, d.SpaceOffset, d.SpacePath, d.SpaceEvent, d.SpaceGen = db.Space, db.SpaceOffset, oob.Path(db.SpacePath), db.SpaceEvent, db.SpaceGen
	return d, true, d.Validate()
}

// ---- unmarshal: pulling payloads ---------------------------------------------

// job is one payload to resolve in a received message.
type job struct {
	n   uint64 // the payload's length: what run allocates
	run func(ctx context.Context) error
	// place, if not nil, is an inline payload for the receive allocator,
	// which is not host memory: the message's inline payloads share one
	// allocation (collected.placeInline), with no run.
	place *gdrv1.DeviceBuffer
	// discarded, if not nil, runs instead of run when the message is refused
	// or another of its pulls failed first (a payload already in this
	// process's receive space gives its range back).
	discarded func(ctx context.Context)
	// forgotten, if not nil, clears what names the payload in the message,
	// for a message whose call is refused before anything is pulled or
	// given back (pulls.drop).
	forgotten func()
}

// pulls are the out-of-band payloads of a received message still to pull;
// its inline payloads are attached already.
type pulls struct {
	m    protoreflect.Message
	jobs []job
	// call is the client's number for the call of a server's unary
	// request, which the request's body carried (callField), or 0.
	call uint64
	// attaches: m has payloads attached, or will once the jobs ran (a
	// message whose payloads all stayed inline in host memory has none).
	attaches bool
}

// sender is what the walk of a received message takes its sender for.
type sender uint8

const (
	// plainSender: a message of the proto codec, or of a peer that proved
	// no identity. Its payloads are inline; one it names by reference is
	// refused, and a marked bytes field is taken as it came.
	plainSender sender = iota
	// gdrSender: a message of the gdr codec whose call gdrpc tracks. The
	// payloads it names are pulled.
	gdrSender
	// untrackedSender: a message of the gdr codec decoded outside any
	// call gdrpc's options track (a server without ServerOptions, a client
	// without DialOptions). Nothing says which connection it came over, so
	// a payload it names by reference is refused, not pulled on the word
	// of whoever sent it.
	untrackedSender
)

// errUntracked refuses a payload named by reference in a message that no
// gdrpc call option tracks.
var errUntracked = codecError(codes.FailedPrecondition, "a message names an out-of-band payload, but its call has no gdrpc call options to say which connection it came over: a server needs gdrcodec.ServerOptions (or listener.ServerOptions), with no interceptor before theirs that receives a stream's messages; a client needs gdrcodec.DialOptions")

// collectPulls attaches the inline payloads of m, a received message, and
// returns its out-of-band ones to pull, within the receive limit and
// MaxPayloads; from says what the walk takes its sender for. On a failure
// m keeps none of its payloads; ctx is the call's, whose session says
// whether the ranges of receive space the message names may be given back
// (oob.Discard).
func collectPulls(ctx context.Context, m protoreflect.Message, from sender, o *options) (pulls, error) {
	c := collected{ctx: ctx, from: from, o: o}
	c.collect(m)
	err := c.err
	if err == nil {
		err = withinLimit(c.jobs, o.maxReceivePayload())
	}
	if err == nil && len(c.inline) > 0 {
		err = c.placeInline() // once the message is known to be taken
	}
	p := pulls{m: m, jobs: c.jobs, attaches: c.attached || len(c.jobs) > 0}
	if err != nil {
		p.discard(ctx)
		return pulls{}, err
	}
	return p, nil
}

// run pulls the payloads; after a failure the message keeps none of them.
func (p *pulls) run(ctx context.Context) error {
	err := runJobs(ctx, p.jobs)
	if err != nil {
		// What the message holds is not handed on: inline payloads were
		// attached as they were found, and pulls that went well attached
		// theirs.
		ReleaseAll(p.m.Interface())
	}
	return err
}

// discard gives the pulls up: the message keeps none of its payloads, and
// a payload already in this process's receive space gives its range back
// where ctx, the call's, came over the space's session (oob.Discard).
func (p *pulls) discard(ctx context.Context) {
	for _, j := range p.jobs {
		if j.discarded != nil {
			j.discarded(ctx)
		}
	}
	ReleaseAll(p.m.Interface())
}

// drop is discard for a message whose sender may not name payloads (its
// call is refused): what it names of the receive space stays as it is, and
// the message keeps no trace of what it named.
func (p *pulls) drop() {
	for _, j := range p.jobs {
		if j.forgotten != nil {
			j.forgotten()
		}
	}
	ReleaseAll(p.m.Interface())
}

// maxParallelPulls bounds the goroutines that run one message's pulls; the
// session's Limits.Pulls bounds the pulls under way.
const maxParallelPulls = 16

// runJobs runs jobs, several at once, and returns the first one's error of
// those that failed; after a failure, the jobs not yet started are
// discarded instead.
func runJobs(ctx context.Context, jobs []job) error {
	switch len(jobs) {
	case 0:
		return nil
	case 1:
		return jobs[0].run(ctx)
	}
	errs := make([]error, len(jobs))
	var next atomic.Int64
	var failed atomic.Bool
	var wg sync.WaitGroup
	for range min(len(jobs), maxParallelPulls) {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(jobs); i = int(next.Add(1) - 1) {
				switch {
				case !failed.Load():
					if errs[i] = jobs[i].run(ctx); errs[i] != nil {
						failed.Store(true)
					}
				case jobs[i].discarded != nil:
					jobs[i].discarded(ctx)
				}
			}
		})
	}
	wg.Wait()
	return firstStatus(errs)
}

func firstStatus(errs []error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// collected is what a received message's walk found: the payloads to pull,
// and how many payloads it holds (inline ones, attached as they were found,
// among them), which MaxPayloads bounds. After the first error the walk goes
// on only to give back the receive space the rest of the message names: the
// owner wrote those payloads already, and nothing else would free their
// ranges before the session ends.
type collected struct {
	ctx      context.Context // the call's (oob.Discard)
	from     sender
	o        *options
	jobs     []job
	payloads int
	attached bool                  // an inline payload was attached (copied where the receive allocator places it)
	inline   []*gdrv1.DeviceBuffer // inline payloads to place in the receive allocator (placeInline)
	err      error                 // the first error; the message is refused
}

// fieldSets is held by a bytes job setting its field: the pulls of a
// message run at once (runJobs), and a field set is a map write in a dynamic
// message or an extension, which Go does not survive concurrently. One for
// all messages: a set takes a moment, once per payload.
var fieldSets sync.Mutex

// inlineAlign is where each of a message's inline payloads starts in their
// shared allocation: as a CUDA allocation of its own would.
const inlineAlign = 256

// placeInline copies the message's inline payloads into one allocation of
// the receive allocator, which is not host memory, and attaches a view of
// it to each, each starting a multiple of inlineAlign bytes from the
// allocation's start (CUDA's allocations and a payload pool's blocks are
// aligned themselves): a block, a copy and a registration for each of
// thousands of one-byte payloads would take far more of the allocator than
// the message carries. A payload kept after its siblings were released
// keeps their allocation with it (at most the message's own size, aligned).
func (c *collected) placeInline() error {
	staging := c.inline[0].Inline // one payload: copied as it is
	if len(c.inline) > 1 {
		total := 0
		for _, db := range c.inline {
			total += alignInline(len(db.Inline))
		}
		staging = make([]byte, total)
		off := 0
		for _, db := range c.inline {
			copy(staging[off:], db.Inline)
			off += alignInline(len(db.Inline))
		}
	}
	total := len(staging)
	dst, err := receiveAllocator(c.o).Alloc(total)
	if err != nil {
		return codecError(codes.ResourceExhausted, "place %d inline payloads (%d bytes): %v", len(c.inline), total, err)
	}
	defer dst.Release() // the views keep it
	src := devicebuf.HostView(staging)
	err = devicebuf.Copy(dst, src)
	src.Release()
	if err != nil {
		return codecError(codes.Internal, "place %d inline payloads: %v", len(c.inline), err)
	}
	off := 0
	for _, db := range c.inline {
		v, err := dst.Slice(off, len(db.Inline))
		if err != nil {
			return codecError(codes.Internal, "place inline payloads: %v", err) // within dst by construction
		}
		off += alignInline(len(db.Inline))
		setAttachment(db, v)
		db.Inline = nil
	}
	c.attached = true
	return nil
}

// alignInline rounds n up to inlineAlign.
func alignInline(n int) int { return (n + inlineAlign - 1) &^ (inlineAlign - 1) }

// count counts one more payload of the message.
func (c *collected) count() error {
	if c.payloads++; c.payloads > MaxPayloads {
		return codecError(codes.ResourceExhausted, "the message carries more than %d payloads (gdrcodec.MaxPayloads)", MaxPayloads)
	}
	return nil
}

// fail records err (if not nil), the first one stopping the message.
func (c *collected) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

func (c *collected) collect(m protoreflect.Message) {
	if db, ok := m.Interface().(*gdrv1.DeviceBuffer); ok {
		var j job
		if c.err == nil {
			c.fail(c.count())
		}
		if c.err == nil {
			var attached bool
			var err error
			j, attached, err = deviceBufferJob(db, c.from, c.o)
			c.attached = c.attached || attached
			c.fail(err)
		}
		switch {
		case c.err != nil:
			discardLanded(c.ctx, db, c.from)
		case j.place != nil:
			c.inline = append(c.inline, j.place)
		case j.run != nil:
			c.jobs = append(c.jobs, j)
		}
		return
	}
	if m.Descriptor().FullName() == deviceBufferName {
		c.collectForeign(m)
		return
	}
	if !mayCarry(m.Descriptor()) {
		return
	}
	for _, fd := range carryingFields(m) {
		if !m.Has(fd) {
			continue
		}
		switch v := m.Get(fd); {
		case marked(fd):
			switch {
			case c.from == plainSender:
			case c.err == nil:
				if err := c.bytesJobs(m, fd, v); err != nil { // they name no receive space
					c.fail(err)
					forgetBytes(m, fd, v) // the failed element's and those after it
				}
			default:
				forgetBytes(m, fd, v)
			}
		case valueMessage(fd) == nil:
		case fd.IsList():
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				c.collect(l.Get(i).Message())
			}
		case fd.IsMap():
			c.collectMap(v.Map())
		default:
			c.collect(v.Message())
		}
	}
}

// collectForeign takes m, a DeviceBuffer of another Go type than
// gdrv1.DeviceBuffer (a dynamicpb message: a proxy's, a reflection
// client's): nothing can be attached to it, so one that names an
// out-of-band payload refuses the message, rather than hand the
// application a payload's length without its bytes; its range of receive
// space goes back and it keeps no trace of what it named. An inline one
// stays as it came.
func (c *collected) collectForeign(m protoreflect.Message) {
	if c.err == nil {
		c.fail(c.count()) // inline or not, it counts towards MaxPayloads
	}
	var db gdrv1.DeviceBuffer
	b, err := proto.Marshal(m.Interface())
	if err == nil {
		err = proto.Unmarshal(b, &db)
	}
	if err == nil && len(db.GetOwner()) == 0 && len(db.GetToken()) == 0 && db.GetSpace() == 0 {
		return
	}
	c.fail(codecError(codes.FailedPrecondition, "a DeviceBuffer of type %T names an out-of-band payload, which only the generated gdr.v1.DeviceBuffer can take: decode into generated types, or have the peer send the payload inline", m.Interface()))
	if err == nil {
		discardLanded(c.ctx, &db, c.from)
	}
	fields := m.Descriptor().Fields()
	for _, name := range []protoreflect.Name{"owner", "token", "space", "space_offset", "space_path", "space_event", "space_gen"} {
		if fd := fields.ByName(name); fd != nil {
			m.Clear(fd)
		}
	}
}

// collectMap collects the values of mp, a map of messages. Its walk works
// on a copy of c on the heap: Range's callback escapes, and were it to
// capture c itself, every message's walk would allocate its collected.
func (c *collected) collectMap(mp protoreflect.Map) {
	sub := new(collected)
	*sub = *c
	mp.Range(func(_ protoreflect.MapKey, v protoreflect.Value) bool {
		sub.collect(v.Message())
		return true
	})
	*c = *sub
}

// discardLanded gives back the range of receive space that db, a payload of
// a refused message, names (oob.Discard), if it names one the sender may,
// and forgets what named the payload, whoever sent it.
func discardLanded(ctx context.Context, db *gdrv1.DeviceBuffer, from sender) {
	// No space was advertised to a plain peer, and an untracked call has no
	// session: only a gdr sender's ranges go back.
	if from == gdrSender {
		if d, ok, err := ParseDescriptor(db); err == nil && ok {
			oob.Discard(ctx, d)
		}
	}
	forget(db)
}

// forget clears what named db's payload once it is pulled, failed or
// discarded: the application may log or forward the message (a server
// stream's handler gets it even when its decode failed), and a token or
// receive space id that leaks would let a third party name the payload, or
// ranges of that space, as its own.
func forget(db *gdrv1.DeviceBuffer) {
	db.Owner, db.Token = nil, nil
	db.Space, db.SpaceOffset, db.SpacePath, db.SpaceEvent, db.SpaceGen = 0, 0, 0, 0, 0
}

func receiveAllocator(o *options) devicebuf.Allocator {
	if a := o.alloc; a != nil {
		return a
	}
	return oob.DefaultHostPool()
}

// deviceBufferJob attaches the inline payload of db where the receive
// allocator places it (attached), or returns the job that pulls the payload
// it names; only a gdrSender's message may name one.
func deviceBufferJob(db *gdrv1.DeviceBuffer, from sender, o *options) (j job, attached bool, err error) {
	named := len(db.GetOwner()) != 0 || len(db.GetToken()) != 0
	if named && from == untrackedSender {
		return job{}, false, errUntracked
	}
	if named && from != gdrSender {
		// A plain peer proved no identity: nothing is pulled on its word,
		// from this process's outbox or any peer's, nor allocated for it.
		return job{}, false, codecError(codes.InvalidArgument, "a DeviceBuffer names an out-of-band payload (owner, token), which only the %q codec over a gdrpc connection carries; send the payload inline", Name)
	}
	d, outOfBand, err := ParseDescriptor(db)
	if err != nil {
		return job{}, false, codecError(codes.InvalidArgument, "%v", err)
	}
	alloc := receiveAllocator(o)
	if !outOfBand {
		if uint64(len(db.Inline)) != db.Length {
			if len(db.Inline) == 0 {
				// The likeliest cause: a Go client attached a buffer
				// (New, Attach) and marshaled it with gRPC's own proto
				// codec, which knows nothing of attachments.
				return job{}, false, codecError(codes.InvalidArgument, "a DeviceBuffer of %d bytes arrived with no inline bytes and names no out-of-band payload: a plain gRPC client puts the payload in inline; a Go client that attaches buffers (gdrcodec.New) calls gdrcodec.Register or dials with gdrpc's dialer", db.Length)
			}
			return job{}, false, codecError(codes.InvalidArgument, "inline payload of %d bytes, descriptor says %d", len(db.Inline), db.Length)
		}
		if db.Kind != gdrv1.Kind_KIND_HOST && db.Kind != gdrv1.Kind_KIND_CUDA {
			return job{}, false, codecError(codes.InvalidArgument, "inline payload of unknown kind %d", db.Kind)
		}
		if db.Length == 0 && db.Kind == gdrv1.Kind_KIND_HOST {
			return job{}, false, nil // an empty DeviceBuffer: nothing attached
		}
		var b *devicebuf.Buffer
		switch {
		case db.Length == 0:
			b = devicebuf.HostFromBytes(nil) // an empty payload: nothing to allocate, as for an empty pull
		case alloc.Kind() == devicebuf.Host:
			// The message's own copy stays where it is: Buffer makes a
			// view of it when asked.
			return job{}, false, nil
		default:
			return job{place: db}, false, nil
		}
		setAttachment(db, b)
		db.Inline = nil
		return job{}, true, nil
	}
	return job{
		n: d.Length,
		run: func(ctx context.Context) error {
			// The destination is allocated only once a session to the owner
			// has room for it.
			dst, _, err := oob.FetchFrom(ctx, d, alloc)
			forget(db)
			if err != nil {
				return transferStatus(err)
			}
			setAttachment(db, dst)
			return nil
		},
		discarded: func(ctx context.Context) {
			oob.Discard(ctx, d)
			forget(db)
		},
		forgotten: func() { forget(db) },
	}, false, nil
}

func (c *collected) bytesJobs(m protoreflect.Message, fd protoreflect.FieldDescriptor, v protoreflect.Value) error {
	if fd.IsList() {
		l := v.List()
		for i := 0; i < l.Len(); i++ {
			if err := c.bytesJob(l.Get(i).Bytes(), func(b []byte) { l.Set(i, protoreflect.ValueOfBytes(b)) }); err != nil {
				return err
			}
		}
		return nil
	}
	return c.bytesJob(v.Bytes(), func(b []byte) { m.Set(fd, protoreflect.ValueOfBytes(b)) })
}

// forgetBytes clears the descriptors in v, the value of fd, a marked bytes
// field of a refused message, as forget does a DeviceBuffer's.
func forgetBytes(m protoreflect.Message, fd protoreflect.FieldDescriptor, v protoreflect.Value) {
	named := func(b []byte) bool {
		mark, _, ok := bytesMarked(b)
		return ok && mark == markDescriptor
	}
	if fd.IsList() {
		l := v.List()
		for i := 0; i < l.Len(); i++ {
			if named(l.Get(i).Bytes()) {
				l.Set(i, protoreflect.ValueOfBytes(nil))
			}
		}
		return
	}
	if named(v.Bytes()) {
		m.Set(fd, protoreflect.ValueOfBytes(nil))
	}
}

// bytesMarked returns the marker of b, a marked bytes field's value, and
// what follows it; ok is false for a value the sender did not mark.
func bytesMarked(b []byte) (mark byte, rest []byte, ok bool) {
	if !bytes.HasPrefix(b, bytesMagic) || len(b) == len(bytesMagic) {
		return 0, nil, false
	}
	return b[len(bytesMagic)], b[len(bytesMagic)+1:], true
}

func (c *collected) bytesJob(b []byte, setField func([]byte)) error {
	set := func(p []byte) { // from the job, which runs beside the message's others
		fieldSets.Lock()
		defer fieldSets.Unlock()
		setField(p)
	}
	mark, rest, ok := bytesMarked(b)
	if !ok {
		return nil
	}
	switch mark {
	case markEscaped:
		set(rest)
		return nil
	case markDescriptor:
		if c.from == untrackedSender {
			return errUntracked
		}
	default:
		return codecError(codes.InvalidArgument, "marked bytes field with unknown marker %d", mark)
	}
	var db gdrv1.DeviceBuffer
	if err := proto.Unmarshal(rest, &db); err != nil {
		return codecError(codes.InvalidArgument, "malformed descriptor: %v", err)
	}
	d, outOfBand, err := ParseDescriptor(&db)
	if err == nil && !outOfBand {
		err = errors.New("descriptor without a token")
	}
	if err == nil && d.Space != 0 {
		err = errors.New("a bytes field's descriptor names receive space") // owners never write one there
	}
	if err != nil {
		return codecError(codes.InvalidArgument, "%v", err)
	}
	if err := c.count(); err != nil {
		return err
	}
	c.jobs = append(c.jobs, job{n: d.Length, run: func(ctx context.Context) error {
		// The bytes are allocated only once a session to the owner has room
		// for them.
		p := []byte{}
		dst, _, err := oob.FetchNew(ctx, d, func(n int) (*devicebuf.Buffer, error) {
			p = make([]byte, n)
			return devicebuf.HostFromBytes(p), nil
		})
		if err != nil {
			set(nil) // the descriptor goes, as a DeviceBuffer's does
			return transferStatus(err)
		}
		dst.Release()
		set(p)
		return nil
	}, discarded: func(context.Context) { set(nil) }, forgotten: func() { set(nil) }})
	return nil
}

// transferStatus turns a transfer error into a status with the code that
// describes it (receiveFailed takes it past gRPC, which reports codec errors
// as Internal).
func transferStatus(err error) error {
	code := codes.Internal
	var te *oob.TransferError
	if errors.As(err, &te) {
		switch te.Kind {
		case oob.TransferUnavailable:
			code = codes.Unavailable
		case oob.TransferNotFound:
			code = codes.NotFound
		case oob.TransferTimeout:
			code = codes.DeadlineExceeded
		case oob.TransferInvalid:
			code = codes.InvalidArgument
		case oob.TransferCanceled:
			code = codes.Canceled
		case oob.TransferExhausted:
			code = codes.ResourceExhausted
		}
	}
	return codecError(code, "%v", err)
}

// codecError is a status of what went wrong receiving a message's payloads.
func codecError(code codes.Code, format string, args ...any) error {
	return status.Errorf(code, "gdrpc: "+format, args...)
}
