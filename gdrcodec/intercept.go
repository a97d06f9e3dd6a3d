package gdrcodec

import (
	"context"
	"io"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// A hold keeps the out-of-band payloads of a call's outgoing messages in the
// outbox until the call ends: gRPC may replay the marshaled bytes of a request
// to another server (retries, hedging), and each replay is pulled again.
type hold struct {
	mu     sync.Mutex
	tokens []oob.Token
	done   bool
	// once: the call cannot replay its messages (replayable), so each payload
	// leaves the outbox after its first completed pull; the call's end
	// withdraws those never pulled.
	once bool
	// rc is the call's: its context names the current attempt's connection
	// by the time gRPC marshals a request (clientStats sees each attempt's
	// headers go), so the request's payloads may land in receive space the
	// server advertised over that session (oob.OfferRequest), noted in
	// landed until the call ends.
	rc     *recvCall
	landed map[*transport.Session][]oob.Descriptor
	// call is the number of a unary call, which the gdr codec's marshal of
	// its request writes in the body (callField); 0 for the others.
	call uint64
	// users counts the other calls sending, right now, a message whose
	// payloads this hold keeps (one message sent on several calls at once:
	// gRPC marshals it for each, and only the message names the hold);
	// ended, that the hold's own call is over. The payloads stay until
	// both say so, and none lands in a session of the hold's call while
	// another call may be the one marshaling.
	users int
	ended bool
	// pruneTokens and pruneWrites are the counts of noted tokens and writes
	// past which those gone already are forgotten (a long stream's).
	pruneTokens, pruneWrites int
	// flow counts the payloads the call's messages left in the outbox that
	// leave after their first pull (not held), for a stream's next message
	// to wait for the server's pulls (heldStream.SendMsg).
	flow oob.Flow
}

// attempt returns the call's context and the session of its current
// attempt, or nil.
func (h *hold) attempt() (context.Context, *transport.Session) {
	if h == nil || h.rc == nil {
		return nil, nil
	}
	h.mu.Lock()
	shared := h.users > 0 || h.ended
	h.mu.Unlock()
	if shared {
		return nil, nil
	}
	ctx := h.rc.context()
	return ctx, transport.SessionFromContext(ctx)
}

// held reports whether the payloads offered under h stay in the outbox
// after a pull (the call may replay them), rather than leave after the first.
func (h *hold) held() bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.once || h.users > 0 // another call's replays are not known
}

// join counts a call other than h's sending a message whose payloads h
// keeps, and reports whether it may: false once h's last user left, whose
// drop releases h's payloads (or did).
func (h *hold) join() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done || h.ended && h.users == 0 {
		return false
	}
	h.users++
	return true
}

// leave ends what join began, and end ends h's own call: the last of them
// takes h's payloads out of the outbox and tells the servers they landed
// with (endWrites).
func (h *hold) leave() { h.drop(func() { h.users-- }) }
func (h *hold) end()   { h.drop(func() { h.ended = true }) }

func (h *hold) drop(f func()) {
	h.mu.Lock()
	f()
	last := h.ended && h.users == 0 && !h.done
	h.mu.Unlock()
	if last {
		h.release()
		h.endWrites()
	}
}

// A sending is a message's entry in holds while calls send it: the hold
// its marshals add payloads to, and how many sends of it are under way.
type sending struct {
	h  *hold
	mu sync.Mutex
	n  int // 0: over, about to leave holds
}

var holds sync.Map // outgoing message (pointer) -> *sending

// send notes that m is about to be sent on the call of own and returns its
// entry. When another call is sending m already, that call's hold keeps
// this call's payloads of m too (gRPC marshals without naming the call):
// the call of own leaves it (leave) when it ends.
func send(m any, own *hold) *sending {
	mine := &sending{h: own, n: 1}
	for {
		v, busy := holds.LoadOrStore(m, mine)
		if !busy {
			return mine
		}
		e := v.(*sending)
		e.mu.Lock()
		joined := e.n > 0 && (e.h == own || e.h.join())
		if joined {
			e.n++
		}
		e.mu.Unlock()
		if joined {
			return e
		}
		// Its sends are over, or its call ended while sending (what it
		// marshals now is withdrawn at once, and this call's must not be).
		if holds.CompareAndSwap(m, e, mine) {
			return mine
		}
	}
}

// sent ends a send of m that send returned e for.
func (e *sending) sent(m any) {
	e.mu.Lock()
	e.n--
	last := e.n == 0
	e.mu.Unlock()
	if last {
		holds.CompareAndDelete(m, e)
	}
}

// land notes ds, written into space advertised over s; after the call's end
// (a message marshaled again for another call) they are named to the server
// at once.
func (h *hold) land(s *transport.Session, ds []oob.Descriptor) {
	if len(ds) == 0 {
		return
	}
	h.mu.Lock()
	done := h.done
	if !done {
		if h.landed == nil {
			h.landed = map[*transport.Session][]oob.Descriptor{}
		}
		l := append(h.landed[s], ds...)
		if len(l) >= max(h.pruneWrites, maxNoted) {
			// A long stream: forget the writes the server gave back.
			l = oob.Outstanding(s, l)
			h.pruneWrites = 2 * len(l)
		}
		h.landed[s] = l
	}
	h.mu.Unlock()
	if done {
		oob.WritesEnded(s, ds)
	}
}

// maxNoted is how many tokens or writes a call notes before it forgets
// those gone already (withdrawn, given back), and then again whenever what
// it kept doubled.
const maxNoted = 1024

// endWrites runs once the call is over: each server whose space the
// request's payloads landed in (a unary call's, once per attempt marshaled;
// a stream's messages) gives back what it never took (a stream's messages
// its handler never read, too). Even a call that succeeded on the session it landed over
// may have left its writes untaken (a server whose request type lacks the
// field, a handler of unknown services that never read the request), and the
// server skips what it took: one control message per such call.
func (h *hold) endWrites() {
	h.mu.Lock()
	landed := h.landed
	h.landed = nil
	h.mu.Unlock()
	for s, ds := range landed {
		oob.WritesEnded(s, ds)
	}
}

// A recvCall is what Unmarshal learns of the call a message is received for
// (gRPC hands a codec none): its context, so pulls end with the call's deadline
// or cancellation, and the status of a failed pull, for the client interceptors
// to return: gRPC reports any error of a codec as Internal.
type recvCall struct {
	ctx context.Context
	// server: a server stream's. gRPC's server answers a failed decode with
	// Internal at once, so the decode succeeds without the payloads and done
	// fails the receive with the status.
	server bool
	mu     sync.Mutex
	st     *status.Status // the failed pull's, or nil
	// A client call is open (oob.Receiving) on the session its response's
	// headers came over until it ends (closeCall): its messages may still
	// name payloads to pull there.
	openOn *transport.Session
	closed bool
	// answered: a client call's response headers came, so response
	// messages may have gone, their payloads waiting in the server's
	// outbox (oob.Call.Ended).
	answered bool
	// answeredOn are the sessions an attempt's response headers came over,
	// in turn: an attempt that is not the call's last (an application's
	// retry inside this interceptor) may have left a response there that
	// nothing decoded.
	answeredOn []*transport.Session
	// trailed is closed when an attempt's trailers came (the server ended
	// the stream): a client stream's send waiting for the server's pulls
	// gives up (heldStream.SendMsg). nil for a unary call.
	trailed chan struct{}
}

// mayBeAnswered reports whether a client call that failed may have left
// response messages behind in the server's outbox: its response headers
// came, or it gave up (ctx, the caller's, ended) while they may have been
// on their way. A call the server failed outright (its status alone, no
// headers) left nothing.
func mayBeAnswered(ctx context.Context, c *recvCall) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.answered || ctx.Err() != nil
}

// openOver marks c's call open on s, the session an attempt's response
// headers came over, and no longer on an earlier one's (hedged attempts may
// each get headers); on none when s is nil. c.mu is held.
func (c *recvCall) openOver(s *transport.Session) {
	if c.closed || s == c.openOn {
		return
	}
	if c.openOn != nil {
		oob.Received(c.openOn)
	}
	c.openOn = s
	if s != nil {
		oob.Receiving(s)
	}
}

// answeredElsewhere returns the sessions an attempt of c's call was
// answered over, other than s.
func (c *recvCall) answeredElsewhere(s *transport.Session) []*transport.Session {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*transport.Session
	for _, a := range c.answeredOn {
		if a != s {
			out = append(out, a)
		}
	}
	return out
}

// closeCall marks c's call ended: nothing more of it is decoded.
func (c *recvCall) closeCall() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.openOver(nil)
	c.closed = true
}

// recvCalls holds the calls of the messages clients and server streams are
// receiving. Without one (a server decoding a unary request), pulls are
// bounded by the transfer timeout and the session's life.
var recvCalls sync.Map // incoming message (pointer) -> *recvCall

// expectReceive notes that v is about to be received for the call of ctx, a
// server's when server.
func expectReceive(ctx context.Context, v any, server bool) *recvCall {
	c := &recvCall{ctx: ctx, server: server}
	recvCalls.Store(v, c)
	return c
}

// done forgets v and returns err, or the status of the failed pull that err
// reports (or, on a server, that err leaves out).
func (c *recvCall) done(v any, err error) error {
	recvCalls.Delete(v)
	c.mu.Lock()
	st := c.st
	c.mu.Unlock()
	if st != nil && (c.server || status.Code(err) == codes.Internal) {
		return st.Err()
	}
	return err
}

// decodeContext returns the context of v's pulls, its call's if known, and
// what the gdr codec's walk of v takes its sender for: untrackedSender where
// no call of gdrpc's options receives v (a server's unary request is one
// until serverRequest says otherwise), plainSender where a server stream's
// connection did not negotiate the gdr codec (the stream interceptor refuses
// those calls; this holds whatever content type picked the codec).
func decodeContext(v any) (context.Context, sender) {
	c, ok := recvCalls.Load(v)
	if !ok {
		return context.Background(), untrackedSender
	}
	rc := c.(*recvCall)
	ctx := rc.context()
	if rc.server && sessionRefusal(ctx) != nil {
		return ctx, plainSender
	}
	if p, _ := peer.FromContext(ctx); !rc.server && p != nil {
		// A server over a connection that is no gdrpc session speaking this
		// codec proved no identity: what its response names by reference
		// is not pulled on its word, as a server does not pull what such a
		// client's request names.
		if s := transport.SessionFromPeer(p); s == nil || !s.Speaks(Name) {
			return ctx, plainSender
		}
	}
	return ctx, gdrSender
}

// serverRequest reports whether m, a message being decoded that no
// recvCall receives, is taken for a server's unary request: a server with
// ServerOptions is decoding a request of its type.
func serverRequest(m protoreflect.Message) bool {
	return decoding.has(m.Descriptor().FullName())
}

// pendingPulls holds the pulls of unary requests the gdr codec decoded on a
// server until the server's stats handler, told of each decoded request
// right after the codec with the call's context, runs them (pullRequest).
var pendingPulls = func() *expiring[*pulls] {
	e := newExpiring[*pulls](time.Minute)
	e.expired = func(p *pulls) { p.discard(context.Background()) } // no call: the client gives its ranges back
	return e
}()

// singleRequests are the requests of the server's calls whose client sends
// one (unary and server-streaming calls) that the codec decoded and the
// stats handler was told of, until their calls end. gRPC decodes into the
// same message once more, to see that the client sent no second one: that
// decode, which no stats event follows, must attach and pull nothing.
var singleRequests sync.Map

// endSingleRequest takes the request of the call of ctx out of
// singleRequests once gRPC's receive of it returned (its decode of a second
// message, if any, is over): the handler may use the message as it likes
// from then on, a decode into it for another call or as a reply included.
// It also unparks what the request parked (parkingRequest). The call's end
// does both where no interceptor of this package runs.
func endSingleRequest(ctx context.Context) {
	c, _ := ctx.Value(callKey{}).(*callMessages)
	if c == nil {
		return
	}
	c.mu.Lock()
	r, parked := c.request, c.parked
	c.request = nil
	c.mu.Unlock()
	if r != nil {
		singleRequests.Delete(r)
	}
	if parked != nil {
		parked.end() // the handler has the request
	}
}

// isSingleRequest reports whether v is in singleRequests.
func isSingleRequest(v any) bool {
	if !isPointer(v) {
		return false
	}
	_, ok := singleRequests.Load(v)
	return ok
}

// isPointer reports whether v is a non-nil pointer: a key singleRequests can
// hold (a value of another kind may not be hashable, and a map of it would
// panic).
func isPointer(v any) bool {
	return v != nil && reflect.TypeOf(v).Kind() == reflect.Pointer
}

// pullRequest runs p, the pulls of the unary request of the call of ctx,
// within the call's life, and returns the status of a failed pull, or nil. A call that did not come over a gdrpc session which negotiated the
// gdr codec pulls nothing: its peer proved no identity.
func pullRequest(ctx context.Context, p *pulls) *status.Status {
	if err := sessionRefusal(ctx); err != nil {
		p.drop()
		return status.Convert(err)
	}
	if len(p.jobs) == 0 {
		return nil // its payloads were inline
	}
	if err := parkPulls(ctx, p); err != nil {
		p.discard(ctx)
		return status.Convert(err)
	}
	if err := p.run(oob.ForServerRequest(ctx)); err != nil {
		return status.Convert(err)
	}
	return nil
}

// context returns the call's context, with the peer of its connection once
// the stats handler saw it.
func (c *recvCall) context() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ctx
}

// recvKey carries a unary call's recvCall to the client's stats handler.
type recvKey struct{}

// clientStats tells a unary call's recvCall which connection its response
// came over (the interceptors run before gRPC picks one), so that the
// response's pulls try that session first: its engine's configuration
// applies, and a receive space advertised over it serves the calls on it.
type clientStats struct{}

func (clientStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (clientStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (clientStats) HandleConn(context.Context, stats.ConnStats) {}

func (clientStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	switch s.(type) {
	case *stats.InTrailer:
		if rc, ok := ctx.Value(recvKey{}).(*recvCall); ok && rc.trailed != nil {
			rc.mu.Lock()
			select {
			case <-rc.trailed:
			default:
				close(rc.trailed)
			}
			rc.mu.Unlock()
		}
		return
	case *stats.OutHeader, *stats.InHeader:
		// The attempt's connection: known as its headers go, so that a call
		// that ends before the response's headers arrive still knows where
		// to send its CALL-ENDED.
	default:
		return
	}
	// The header's RemoteAddr is the server side's alone; on a client the
	// context of the attempt carries the connection's peer.
	rc, ok := ctx.Value(recvKey{}).(*recvCall)
	p, _ := peer.FromContext(ctx)
	if ok && p != nil {
		rc.mu.Lock()
		if had, _ := peer.FromContext(rc.ctx); had != p {
			rc.ctx = peer.NewContext(rc.ctx, p)
		}
		if _, in := s.(*stats.InHeader); in {
			// Response messages follow the response's headers, and a call
			// that received them is not retried: from here on the call may
			// pull over this connection's session, and only over it. (Marked
			// as its request went, a call waiting to be retried would hold a
			// session it never pulls over.)
			rc.answered = true
			if sess := transport.SessionFromPeer(p); sess != nil {
				rc.openOver(sess)
				if !slices.Contains(rc.answeredOn, sess) {
					rc.answeredOn = append(rc.answeredOn, sess)
				}
			}
		}
		rc.mu.Unlock()
	}
}

// receiveFailed takes err, the status that resolving the payloads of v failed
// with, and returns what Unmarshal returns. gRPC reports a codec's error as
// Internal, so the status takes another way to the caller: through the
// recvCall of v, where the client interceptors or a server stream's
// interceptor wait for it; for the request of a unary call, which gRPC decodes
// before any interceptor runs, the decode succeeds without the payloads and
// the server interceptor fails the call with the status before its handler
// runs (serverStats moves it to the call; failedRequest returns it).
func receiveFailed(v any, err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	if c, ok := recvCalls.Load(v); ok {
		rc := c.(*recvCall)
		rc.mu.Lock()
		rc.st = st
		rc.mu.Unlock()
		if rc.server {
			return nil
		}
		return err
	}
	m := messageV2Of(v)
	if m == nil || !serverRequest(m.ProtoReflect()) || !inUnaryServerCall() {
		return err
	}
	failures.put(v, st)
	return nil
}

// inUnaryServerCall reports whether its caller runs within a gRPC server's
// unary call, whose request's decode it is then. serverRequest counts the
// calls decoding a request of a type, process-wide, and a peer can hold one
// such call open by sending its headers alone: meanwhile a response of that
// type that a plain gRPC client of this process decodes (with the proto
// codec Register replaced) would be taken for a request, its failure filed
// for a server that never takes it and the response handed to the client as
// if it were whole. A failed decode is rare, and a walk of its stack cheap
// beside it. The frames are gRPC's: the handler of a unary method, which
// decodes the request (wrapUnaryHandler; processUnaryRPC before gRPC-Go
// 1.85). Tests of a plain client's refused request fail if a gRPC release
// names them otherwise.
func inUnaryServerCall() bool {
	var pcs [64]uintptr
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs[:])])
	for {
		f, more := frames.Next()
		// Inlined, the handler's closure is named after its caller too
		// ("grpc.(*Server).register.(*Server).wrapUnaryHandler.func1.1").
		if fn, ok := strings.CutPrefix(f.Function, "google.golang.org/grpc."); ok &&
			(strings.Contains(fn, "(*Server).wrapUnaryHandler") || strings.Contains(fn, "(*Server).processUnaryRPC")) {
			return true
		}
		if !more {
			return false
		}
	}
}

// decoding counts, by request type, the unary calls of servers with
// ServerOptions that are decoding their request: a message with no recvCall
// decoded while none of its type is, is a client's, whose failure stays as
// gRPC reports it.
var decoding = &requestTypes{n: map[protoreflect.FullName]int{}}

type requestTypes struct {
	mu sync.Mutex
	n  map[protoreflect.FullName]int // "": a method whose request type is unknown
}

func (r *requestTypes) add(t protoreflect.FullName, d int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n[t] += d
	if r.n[t] == 0 {
		delete(r.n, t)
	}
}

func (r *requestTypes) has(t protoreflect.FullName) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[t] > 0 || r.n[""] > 0
}

// A method is what the protobuf registry says of a gRPC method: its request
// type, and whether its messages cannot carry a payload either way (plain),
// so that its calls need none of the codec's bookkeeping.
type method struct {
	request protoreflect.FullName
	plain   bool
}

var methods sync.Map // full method name -> method, for methods the registry knows

// lookupMethod returns what the registry says of method ("/pkg.Service/Method"),
// or false where it does not know the method.
func lookupMethod(name string) (method, bool) {
	if m, ok := methods.Load(name); ok {
		return m.(method), true
	}
	service, mname, ok := strings.Cut(strings.TrimPrefix(name, "/"), "/")
	if !ok {
		return method{}, false
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		return method{}, false
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return method{}, false
	}
	md := sd.Methods().ByName(protoreflect.Name(mname))
	if md == nil {
		return method{}, false
	}
	// Methods nobody registered are not kept: any name can arrive.
	m := method{request: md.Input().FullName(), plain: !mayCarry(md.Input()) && !mayCarry(md.Output())}
	methods.Store(name, m)
	return m, true
}

// requestType returns the type of the request of method as the protobuf
// registry knows it, or "".
func requestType(name string) protoreflect.FullName {
	m, _ := lookupMethod(name)
	return m.request
}

// canCarry reports whether v is a message whose type can carry a payload:
// the calls' bookkeeping skips those that cannot.
func canCarry(v any) bool {
	m := messageV2Of(v)
	return m != nil && mayCarry(m.ProtoReflect().Descriptor())
}

// failures holds the failed pulls of requests decoded on a server until the
// server's stats handler, told of each decoded request right after the codec,
// moves them to their call.
var failures = newExpiring[*status.Status](time.Minute)

// callNumber returns the call number a request marshaled under h carries
// in its body, or 0 (no hold, a stream's).
func (h *hold) callNumber() uint64 {
	if h == nil {
		return 0
	}
	return h.call
}

func holdOf(v any) *hold {
	if e, ok := holds.Load(v); ok {
		return e.(*sending).h
	}
	return nil
}

// add keeps t in the outbox until h's call ends (or its first pull, for a
// call that cannot replay it); pulled says whether its peer pulls it, so
// that the call's stream waits for that (flow).
func (h *hold) add(t oob.Token, pulled bool) {
	h.mu.Lock()
	done := h.done
	if !done {
		h.tokens = append(h.tokens, t)
		if len(h.tokens) >= max(h.pruneTokens, maxNoted) {
			// A long stream's payloads leave the outbox once pulled or once
			// their range is given back: forget those gone.
			h.tokens = slices.DeleteFunc(h.tokens, func(t oob.Token) bool { return !oob.Offered(t) })
			h.pruneTokens = 2 * len(h.tokens)
		}
	}
	h.mu.Unlock()
	if done {
		oob.Withdraw(t)
		return
	}
	if pulled {
		h.flow.Track([]oob.Token{t})
	}
}

// keeps reports whether h keeps any payload.
func (h *hold) keeps() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.tokens) > 0
}

// gone reports whether every payload h keeps left the outbox (withdrawn,
// or its lease ended); a hold whose payloads are not offered yet is not.
func (h *hold) gone() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.tokens) > 0 && !slices.ContainsFunc(h.tokens, oob.Offered)
}

func (h *hold) release() {
	h.mu.Lock()
	ts := h.tokens
	h.tokens, h.done = nil, true
	h.mu.Unlock()
	for _, t := range ts {
		oob.Withdraw(t)
	}
}

// UnaryClientInterceptor holds a request's payloads until the call returns,
// releases what the response brought when the call fails (the caller never
// sees it), and returns the status of an out-of-band transfer that failed
// while the response was being decoded, where gRPC reports Internal. It
// numbers the call in its metadata, and a call that fails, or whose
// response may name a write into this side's receive space that its decode
// did not take (mayHoldUntaken), tells the server, which takes back the
// receive space of a response payload the call never took. A call whose
// request and response types cannot carry a payload needs none of this and
// goes straight to the invoker, unnumbered: a server writes none of an
// unnumbered gRPC call's response into receive space (a server whose newer
// response type gained a payload field leaves it in its outbox, as for a
// plain gRPC client).
func UnaryClientInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if !canCarry(req) && !canCarry(reply) {
			// Nothing to hold, pull or number: the server's response can
			// name no payload this call would decode.
			return invoker(plainCall(ctx), method, req, reply, cc, opts...)
		}
		call := oob.NewCall()
		ctx = oob.WithCall(plainCall(ctx), call)
		rc := expectReceive(ctx, reply, false)
		h := &hold{rc: rc, call: call.ID}
		sending := send(req, h)
		if sending.h != h {
			// Another call is sending req: its marshals put that call's
			// number in the body, so this one names its own in a header,
			// which the server takes first.
			ctx = withCallHeader(ctx, call)
		}
		err := rc.done(reply, invoker(context.WithValue(ctx, recvKey{}, rc), method, req, reply, cc, opts...))
		rc.closeCall()
		if m := messageV2Of(reply); err != nil && m != nil {
			ReleaseAll(m)
		}
		// The response, if one came, came over the session its header did
		// (clientStats): gRPC does not retry a call once headers came. An
		// application's retry chained inside this interceptor may: an
		// attempt answered over another session, and cut before its
		// response was decoded, left that server holding what it wrote
		// for the call until it hears the call ended.
		s := transport.SessionFromContext(rc.context())
		others := rc.answeredElsewhere(s)
		switch {
		case err != nil:
			call.EndedOver(s, mayBeAnswered(ctx, rc), others)
		case mayHoldUntaken(s, reply):
			call.EndedOver(s, true, others)
		case len(others) > 0:
			call.EndedOver(nil, false, others)
		}
		sending.sent(req)
		if sending.h != h {
			sending.h.leave()
		}
		h.end()
		return err
	}
}

// mayHoldUntaken reports whether v, a response received over s, may name a
// payload the server wrote into receive space this side advertised over s
// that the decode did not take: one under a field v's type lacks (a
// server's newer schema), which protobuf keeps as an unknown field. Its
// call then tells the server (oob.Call.Ended), which takes the range back;
// an honest call whose types match sends nothing more.
func mayHoldUntaken(s *transport.Session, v any) bool {
	m := messageV2Of(v)
	return m != nil && oob.AdvertisesOver(s) && hasUnknown(m.ProtoReflect(), 0)
}

// hasUnknown reports whether m, or a message set in it, has unknown fields.
func hasUnknown(m protoreflect.Message, depth int) bool {
	if len(m.GetUnknown()) > 0 {
		return true
	}
	if depth > prescanDepth {
		return false // the decoder refused deeper ones
	}
	found := false
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap():
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					found = hasUnknown(mv.Message(), depth+1)
					return !found
				})
			}
		case fd.Kind() != protoreflect.MessageKind && fd.Kind() != protoreflect.GroupKind:
		case fd.IsList():
			l := v.List()
			for i := 0; i < l.Len() && !found; i++ {
				found = hasUnknown(l.Get(i).Message(), depth+1)
			}
		default:
			found = hasUnknown(v.Message(), depth+1)
		}
		return !found
	})
	return found
}

// StreamClientInterceptor keeps the payloads of the messages a stream sends
// until the stream ends, or, when gRPC cannot replay them (no retry policy
// for the method), until the server pulled them once; and it returns the
// status of an out-of-band transfer that failed while a received message was
// being decoded.
func StreamClientInterceptor() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		ctx, call := numberCall(ctx)
		// The stream's own context is not asked for: that commits gRPC's
		// attempt, and a committed stream is never retried (not even
		// transparently, when its first attempt never reached a server).
		// The stats handler names each attempt's connection instead, and
		// gRPC says when the stream is over, however it ends (OnFinish):
		// then the pulls of its messages end too.
		pulls, cancel := context.WithCancel(ctx)
		rc := &recvCall{ctx: pulls, trailed: make(chan struct{})}
		s := &heldStream{ctx: ctx, h: &hold{rc: rc}, cancel: cancel, call: call, serverStreams: desc.ServerStreams}
		finished := grpc.OnFinish(func(err error) {
			if err == nil {
				s.complete.Store(true) // the server's status came, OK, after its last message
			}
			s.end()
		})
		cs, err := streamer(context.WithValue(ctx, recvKey{}, rc), desc, cc, method, append(slices.Clip(opts), finished)...)
		if err != nil {
			rc.closeCall()
			cancel()
			return nil, err
		}
		s.ClientStream = cs
		s.h.once = !replayable(cc, method) // known once gRPC created the stream
		return s, nil
	}
}

// numberCall gives a client stream a number (oob.CallHeader): the call's
// pulls note what they took of this process's receive space (oob.WithCall),
// and the server notes what it wrote there for the call. A unary call's
// number goes in its request's body instead (callField): a stream may have
// the server send before the client does.
func numberCall(ctx context.Context) (context.Context, *oob.Call) {
	call := oob.NewCall()
	return withCallHeader(oob.WithCall(plainCall(ctx), call), call), call
}

// withCallHeader returns ctx with call's number in its outgoing metadata
// (oob.CallHeader).
func withCallHeader(ctx context.Context, call *oob.Call) context.Context {
	return metadata.AppendToOutgoingContext(ctx, oob.CallHeader, strconv.FormatUint(call.ID, 16))
}

// plainCall returns ctx without a call number another process gave (a proxy
// forwarding its incoming metadata): it names none of this process's calls.
func plainCall(ctx context.Context) context.Context {
	if len(metadata.ValueFromOutgoingContext(ctx, oob.CallHeader)) == 0 {
		return ctx
	}
	md, _ := metadata.FromOutgoingContext(ctx) // a copy
	delete(md, oob.CallHeader)
	return metadata.NewOutgoingContext(ctx, md)
}

type heldStream struct {
	grpc.ClientStream
	ctx           context.Context    // the caller's
	h             *hold              // its rc: the call's context, with its current attempt's peer
	cancel        context.CancelFunc // ends the pulls of the stream's messages
	call          *oob.Call
	serverStreams bool
	complete      atomic.Bool // every message of the server was received
	untaken       atomic.Bool // a received message may name a write into receive space it did not take (mayHoldUntaken)
	ended         sync.Once

	mu sync.Mutex
	// joined: the holds of other calls that keep payloads of messages this
	// stream sent too (send), left when the stream ends.
	joined map[*hold]bool
	over   bool
}

// end runs once the stream is over (gRPC finished it, a receive failed, or
// the single response of a stream that sends many came): nobody pulls its
// requests any more, and a stream that ended before the server's last
// message was received tells the server, some of whose messages may never be
// decoded.
func (s *heldStream) end() {
	s.ended.Do(func() {
		s.h.rc.closeCall()
		s.cancel()
		s.h.end()
		s.mu.Lock()
		joined := s.joined
		s.joined, s.over = nil, true
		s.mu.Unlock()
		for h := range joined {
			h.leave()
		}
		if !s.complete.Load() {
			s.call.Ended(transport.SessionFromContext(s.h.rc.context()), mayBeAnswered(s.ctx, s.h.rc))
		} else if s.untaken.Load() {
			s.call.Ended(transport.SessionFromContext(s.h.rc.context()), true)
		}
	})
}

func (s *heldStream) SendMsg(m any) error {
	if !canCarry(m) {
		return s.ClientStream.SendMsg(m)
	}
	if err := s.waitForPulls(); err != nil {
		return err
	}
	sending := send(m, s.h)
	err := s.ClientStream.SendMsg(m)
	sending.sent(m)
	if h := sending.h; h != s.h {
		s.mu.Lock()
		keep := !s.over && !s.joined[h]
		if keep {
			if s.joined == nil {
				s.joined = map[*hold]bool{}
			}
			s.joined[h] = true
		}
		s.mu.Unlock()
		if !keep { // the stream is over, or counted in h already
			h.leave()
		}
	}
	return err
}

// waitForPulls holds the stream's next message back while its earlier
// messages left more than oob.Limits.UnpulledBytes in the outbox for the
// server to pull, as gRPC's flow control holds a sender back: a server that
// reads the stream and never pulls would otherwise pin every payload sent
// until its lease ends. It gives up as SendMsg does when the stream is over:
// io.EOF once the server ended it (RecvMsg returns the status), the
// context's status once the caller's context ended.
func (s *heldStream) waitForPulls() error {
	ctx := s.h.rc.context() // ends with the stream
	sess := transport.SessionFromContext(ctx)
	if !s.h.flow.Over(sess) {
		return nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.h.rc.trailed:
			cancel()
		case <-ctx.Done():
		}
	}()
	if err := s.h.flow.Wait(ctx, sess); err == nil {
		return nil
	}
	if err := s.ctx.Err(); err != nil {
		return status.FromContextError(err).Err()
	}
	return io.EOF
}

func (s *heldStream) RecvMsg(m any) error {
	received := s.complete.Load() // a single response came: m may be it, the caller's
	var err error
	if canCarry(m) {
		rc := expectReceive(s.h.rc.context(), m, false)
		err = rc.done(m, s.ClientStream.RecvMsg(m))
	} else {
		err = s.ClientStream.RecvMsg(m)
	}
	if err == nil && !s.untaken.Load() && mayHoldUntaken(transport.SessionFromContext(s.h.rc.context()), m) {
		s.untaken.Store(true)
	}
	if err == io.EOF || err == nil && !s.serverStreams {
		s.complete.Store(true) // a single response, received, ends the stream
	}
	if err != nil && err != io.EOF && !received && !s.serverStreams {
		// The caller gets no response: the stream's status came after it,
		// or a second message did (gRPC reads into m again to see the
		// stream end). What the codec attached to m goes, as a failed unary
		// call's response does. A receive after the response came (to see
		// the stream end) leaves m, the caller's response, alone.
		if mm := messageV2Of(m); mm != nil {
			ReleaseAll(mm)
		}
	}
	if err != nil || !s.serverStreams {
		// gRPC need not finish a stream of a single response when the
		// response came: its end is here.
		s.end()
	}
	return err
}

// DialOptions returns what a gdrpc client needs on top of its dialer: the gdr
// codec, set for every call of the ClientConn (grpc.ForceCodecV2: gRPC's codec
// registry is not touched, so it needs no Register), and UnaryClientInterceptor
// and StreamClientInterceptor, chained, with a stats handler that tells a
// unary call which connection its response came over. opts (the receive
// allocator, the eager threshold, the receive limit) apply to this
// ClientConn's calls alone, in place of all of Register's: an option Register
// set and opts leave out takes its default here. Without opts the codec
// follows Register's, as they are at each call. dialer.Dialer.DialOptions
// includes these options.
func DialOptions(opts ...Option) []grpc.DialOption {
	c := gdrClientCodec
	if len(opts) > 0 {
		c = &codec{name: Name, oob: true, client: true, o: newOptions(opts)}
	}
	return []grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(c)),
		grpc.WithChainUnaryInterceptor(UnaryClientInterceptor()),
		grpc.WithChainStreamInterceptor(StreamClientInterceptor()),
		grpc.WithStatsHandler(clientStats{}),
	}
}

// ServerOptions returns what a gdrpc server needs: interceptors that refuse
// gdr calls on connections whose handshake did not negotiate the codec (a plain
// TCP client naming the gdr subtype gets FailedPrecondition) and fail a call
// whose request payload could not be pulled with the transfer's status code
// before its handler runs, and a stats handler that gives a call's buffers back
// and pulls a unary request's payloads once it knows the call's connection
// (gRPC decodes the request first): a gdr call over a connection that is no
// gdrpc session pulls nothing.
// They are added with grpc.ChainUnaryInterceptor, grpc.ChainStreamInterceptor
// and grpc.StatsHandler, so a server's own interceptors, stats handlers and tap
// handle compose with them; interceptors set with grpc.UnaryInterceptor or
// grpc.StreamInterceptor, and chained ones given earlier, run first and see a
// request whose payloads could not be pulled without them. gRPC finds a
// server's codecs by content-subtype in its registry, so gdr calls also need
// Register, called at start-up; without it they are refused with
// FailedPrecondition. ServerOptions itself registers nothing.
//
// A client gets the status of a response payload it could not pull from the
// interceptors of DialOptions; without them, gRPC reports Internal. A process
// that serves gdr calls makes its gdr clients with DialOptions: a decode
// without them, of a message whose type is also a unary request the process is
// decoding at that moment, is taken for that request, and the message is left
// without its out-of-band payloads.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(unaryServerInterceptor),
		grpc.ChainStreamInterceptor(streamServerInterceptor),
		grpc.StatsHandler(&serverStats{}),
	}
}

func unaryServerInterceptor(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if interceptedBefore(ctx) {
		return handler(ctx, req)
	}
	endSingleRequest(ctx)
	gdr, err := refusal(ctx)
	if err != nil {
		return nil, err
	}
	if st := failedRequest(ctx, req); st != nil {
		return nil, st.Err()
	}
	resp, err := handler(ctx, req)
	if err == nil && canCarry(resp) {
		if gdr {
			bindDestination(ctx, resp)
		}
		if c, _ := ctx.Value(callKey{}).(*callMessages); c != nil {
			c.mu.Lock()
			c.unsent = resp // released at the call's end if gRPC never sends it
			c.mu.Unlock()
		}
	}
	return resp, err
}

func streamServerInterceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if interceptedBefore(ss.Context()) {
		return handler(srv, ss)
	}
	gdr, err := refusal(ss.Context())
	if err != nil {
		return err
	}
	return handler(srv, &requestStream{ServerStream: ss, gdr: gdr})
}

// interceptedBefore reports whether another of gdrpc's server interceptors
// took the call of ctx already, and marks it taken.
func interceptedBefore(ctx context.Context) bool {
	c, _ := ctx.Value(callKey{}).(*callMessages)
	return c != nil && c.intercepted.Swap(true)
}

// requestStream pulls the payloads of the messages a server stream receives
// within the call's life, and fails a message whose payloads could not be
// pulled with the transfer's status.
type requestStream struct {
	grpc.ServerStream
	gdr bool // the call's codec is gdr's: its messages take destinations
}

func (s *requestStream) RecvMsg(m any) error {
	defer endSingleRequest(s.Context())
	if !canCarry(m) {
		return s.ServerStream.RecvMsg(m)
	}
	rc := expectReceive(parkingRequest(s.Context()), m, true)
	return rc.done(m, s.ServerStream.RecvMsg(m))
}

// parkedRequest is what the request of a call that takes one (unary or
// server-streaming) parked on the session it came over (oob.Park) until
// its handler has it: gRPC receives, and the codec pulls, the request
// before the client has ended its side of the stream, and gRPC waits for
// that end before its receive returns.
type parkedRequest struct {
	mu     sync.Mutex
	ended  bool
	unpark []func()
}

// add keeps unpark until end, or runs it at once once ended.
func (p *parkedRequest) add(unpark func()) {
	p.mu.Lock()
	if !p.ended {
		p.unpark = append(p.unpark, unpark)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	unpark()
}

// end gives back what the request parked.
func (p *parkedRequest) end() {
	p.mu.Lock()
	unpark := p.unpark
	p.unpark, p.ended = nil, true
	p.mu.Unlock()
	for _, f := range unpark {
		f()
	}
}

type parkedKey struct{}

// parkingRequest returns ctx, under which the pulls of a call that takes
// one request park its payloads (parkPulls) until gRPC's receive of it
// returned (endSingleRequest) or the call ended.
func parkingRequest(ctx context.Context) context.Context {
	c, _ := ctx.Value(callKey{}).(*callMessages)
	if c == nil {
		return ctx
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.single {
		return ctx
	}
	if c.parked == nil {
		c.parked = new(parkedRequest)
	}
	return context.WithValue(ctx, parkedKey{}, c.parked)
}

// parkPulls parks what p will pull, all of it before any is pulled, on the
// session the request of ctx came over, if ctx is parkingRequest's. It
// waits, within ctx, for the other requests parked on the session, and on
// the sessions of its remote host, to leave room (oob.Park).
func parkPulls(ctx context.Context, p *pulls) error {
	parked, _ := ctx.Value(parkedKey{}).(*parkedRequest)
	if parked == nil {
		return nil
	}
	// Every payload counts, those a descriptor says are in this process's
	// receive space too: a range that turns out unknown or stale is pulled
	// by its token like any other.
	var n uint64
	for _, j := range p.jobs {
		if j.run != nil {
			n += j.n // withinLimit bounded the sum
		}
	}
	s := transport.SessionFromContext(ctx)
	if n == 0 || s == nil {
		return nil // nothing to pull, or no session to pull over
	}
	unpark, err := oob.Park(ctx, s, n)
	if err != nil {
		return transferStatus(err)
	}
	parked.add(unpark)
	return nil
}

// SendMsg lets the message's marshaling write its payloads into receive
// space the client advertised.
func (s *requestStream) SendMsg(m any) error {
	if !canCarry(m) || !s.gdr {
		return s.ServerStream.SendMsg(m)
	}
	bindDestination(s.Context(), m)
	err := s.ServerStream.SendMsg(m)
	takeDestination(m) // not marshaled (SendMsg failed first): forget it
	if err != nil {
		notSent(m)
	}
	return err
}

// serverStats gives a server call's buffers back when the call no longer needs
// them: a response's once it was sent (the outbox keeps its own reference until
// the client pulled it), a request's when the call ends. A handler that keeps a
// received buffer past its return takes it with Detach. It also pulls the
// payloads of a unary request the codec decoded (pullRequest), and moves a
// failed pull of such a request to the request's call.
//
// A server given ServerOptions twice has two: the first to tag a call owns
// it, and the other leaves its calls alone, as the interceptors after the
// first do (callMessages.intercepted).
type serverStats struct{ _ byte } // not zero-sized: each has an address of its own

type callMessages struct {
	mu    sync.Mutex
	owner *serverStats // the handler that tagged the call
	// intercepted is set by the first of gdrpc's server interceptors to
	// run for the call: one given twice (ServerOptions twice) passes the
	// call on untouched, for binding a response's destination twice would
	// take it for one sent on two calls.
	intercepted atomic.Bool
	begun       atomic.Bool // the call's Begin was handled: TagRPC runs before it
	// held is what the call's received messages had attached, released when
	// the call ends; once it reaches pruneHeld, what the handler released
	// or took leaves it (a long stream's). The DeviceBuffers, not their
	// messages: a message the handler no longer holds is collected.
	held      []*gdrv1.DeviceBuffer
	pruneHeld int
	method    string
	plain     bool                   // the method's messages carry no payloads (lookupMethod)
	decoding  bool                   // a unary call, counted in decoding until its request is decoded
	single    bool                   // the client sends one request (unary or server-streaming)
	request   any                    // that request, once decoded (singleRequests)
	parked    *parkedRequest         // what its pulls parked on the session, until the handler has it
	failed    map[any]*status.Status // request -> its failed pull
	landed    map[any]landedPayloads // response not yet reported sent -> its payloads in the client's receive space
	unsent    any                    // a unary call's response until it is reported sent
	// clientCall is the client's number for the call (oob.CallHeader), 0
	// if it gave none: what lands in its space is written for that call.
	clientCall uint64
	// flow counts what the call's responses left in the outbox unpulled
	// (Limits.UnpulledBytes).
	flow oob.Flow
}

// noteHeld notes the payloads attached to m, a message the call received, in
// held. c.mu is held.
func (c *callMessages) noteHeld(m protoreflect.Message) {
	walkDeviceBuffers(m, func(db *gdrv1.DeviceBuffer) {
		if _, ok := attachedBuffer(db); ok {
			c.held = append(c.held, db)
		}
	})
}

// noteRequest notes v, a message the call received, as its request if the
// call takes one and has none yet: a second is refused (singleRequests).
// c.mu is held.
func (c *callMessages) noteRequest(v any) {
	if c.single && c.request == nil && isPointer(v) {
		c.request = v
		singleRequests.Store(v, struct{}{})
	}
}

// decoded ends the call's count in decoding, if it has one.
func (c *callMessages) decoded() {
	if c.decoding {
		c.decoding = false
		decoding.add(requestType(c.method), -1)
	}
}

type callKey struct{}

// failedRequest returns the status of the failed pull of req, a request of
// the call of ctx, or nil.
func failedRequest(ctx context.Context, req any) *status.Status {
	c, _ := ctx.Value(callKey{}).(*callMessages)
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.failed[req]
	delete(c.failed, req)
	return st
}

func (h *serverStats) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	if c, _ := ctx.Value(callKey{}).(*callMessages); c != nil && !c.begun.Load() {
		// Another of gdrpc's handlers tagged this call first. (One that
		// began is another call's, whose context this one's derives
		// from: this call gets a record of its own.)
		return ctx
	}
	m, ok := lookupMethod(info.FullMethodName)
	// A plain method's messages carry no payloads: nothing to give back,
	// pull or bound. Its record only keeps the request of a call that takes
	// one, so that a second request message is refused before the codec
	// files anything for it (Unmarshal, isSingleRequest).
	return context.WithValue(ctx, callKey{}, &callMessages{owner: h, method: info.FullMethodName, plain: ok && m.plain})
}

func (h *serverStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	c, _ := ctx.Value(callKey{}).(*callMessages) // TagRPC gives every call one
	if c != nil && c.owner != h {
		return // the call's owner handles it
	}
	switch s := s.(type) {
	case *stats.InHeader:
		if c != nil {
			if v := s.Header.Get(oob.CallHeader); len(v) == 1 {
				n, err := strconv.ParseUint(v[0], 16, 64)
				c.mu.Lock()
				if err == nil {
					c.clientCall = n
				}
				c.mu.Unlock()
			}
		}
	case *stats.Begin:
		if c == nil {
			return
		}
		c.begun.Store(true)
		if !s.IsClientStream {
			c.mu.Lock()
			c.single = true
			if !s.IsServerStream && !c.plain {
				c.decoding = true
				decoding.add(requestType(c.method), 1)
			}
			c.mu.Unlock()
		}
	case *stats.InPayload:
		p, pending := pendingPulls.take(s.Payload)
		if c == nil {
			return // TagRPC gives every call a record
		}
		// A plain method's request goes the same way: it can carry no
		// payload, so nothing below but its note applies to it (a call
		// number its client need not have sent names nothing written).
		c.mu.Lock()
		if pending && c.clientCall == 0 {
			c.clientCall = p.call // the request's body's; a header's comes first
		}
		c.noteRequest(s.Payload)
		c.decoded()
		c.mu.Unlock()
		if m := messageV2Of(s.Payload); m != nil && mayCarry(m.ProtoReflect().Descriptor()) {
			st, _ := failures.take(s.Payload)
			if pending {
				st = pullRequest(parkingRequest(ctx), p)
			}
			c.mu.Lock()
			if !pending || p.attaches {
				// A request whose payloads all stayed inline in host
				// memory has nothing attached to look for.
				c.noteHeld(m.ProtoReflect())
			}
			if len(c.held) >= max(c.pruneHeld, maxNoted) {
				c.held = slices.DeleteFunc(c.held, func(db *gdrv1.DeviceBuffer) bool { _, ok := attachedBuffer(db); return !ok })
				c.pruneHeld = 2 * len(c.held)
			}
			if st != nil {
				if c.failed == nil {
					c.failed = map[any]*status.Status{}
				}
				c.failed[s.Payload] = st
			}
			c.mu.Unlock()
		}
	case *stats.OutPayload:
		if !canCarry(s.Payload) {
			return
		}
		if c != nil {
			c.mu.Lock()
			delete(c.landed, s.Payload) // the client has them now
			if c.unsent == s.Payload {
				c.unsent = nil
			}
			c.mu.Unlock()
		}
		sentOn(ctx, s.Payload)
		if m := messageV2Of(s.Payload); m != nil {
			ReleaseAll(m)
		}
	case *stats.End:
		if c != nil {
			c.mu.Lock()
			c.decoded()
			held, landed, unsent, parked := c.held, c.landed, c.unsent, c.parked
			c.held, c.failed, c.landed, c.unsent = nil, nil, nil, nil
			if c.request != nil {
				singleRequests.Delete(c.request)
				c.request = nil
			}
			c.mu.Unlock()
			if parked != nil {
				parked.end()
			}
			for _, db := range held {
				if b := detach(db); b != nil {
					b.Release()
				}
			}
			for _, l := range landed {
				l.reclaim()
			}
			if m := messageV2Of(unsent); m != nil {
				// A response gRPC never sent (a send limit, a stream gone):
				// nobody else can release it, or pull its payloads.
				ReleaseAll(m)
				notSent(unsent)
				takeDestination(unsent) // never marshaled, if an interceptor replaced it
			}
		}
	}
}

func (*serverStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (*serverStats) HandleConn(context.Context, stats.ConnStats)                       {}

// TapHandle refuses gdr calls on connections whose handshake did not
// negotiate the codec, as ServerOptions' interceptors do, but before gRPC
// reads the request: gRPC takes one tap handle per server, so a server that
// wants this installs it with grpc.InTapHandle, or calls it from its own.
func TapHandle(ctx context.Context, info *tap.Info) (context.Context, error) {
	return ctx, refusalOf(ctx, usesGDR(info.Header.Get("content-type")))
}

// refusal reports whether the call of ctx, a server's, uses the gdr codec,
// and why it may not run, or nil. Only a gdr call's messages are bound to
// their destination (bindDestination): the gdr codec's marshal takes the
// binding, any other codec's would leave it, and the call's context with it,
// until its lease ends. It reads the call's content type alone: the whole
// incoming metadata would be copied on every call.
func refusal(ctx context.Context) (gdr bool, err error) {
	gdr = usesGDR(metadata.ValueFromIncomingContext(ctx, "content-type"))
	return gdr, refusalOf(ctx, gdr)
}

// refusalOf is refusal for a call that uses the gdr codec if gdr.
func refusalOf(ctx context.Context, gdr bool) error {
	if !gdr {
		return nil
	}
	if !registered.Load() {
		// gRPC would decode the call with the plain proto codec.
		return status.Errorf(codes.FailedPrecondition, "gdrpc: this server cannot serve %q calls: gdrcodec.Register was not called at start-up", Name)
	}
	return sessionRefusal(ctx)
}

// usesGDR reports whether a gRPC server decodes a call whose content-type
// headers are cts with the gdr codec. gRPC keeps the valid ones alone in
// the call's metadata and takes the last of them, so a gdr header followed
// by a plain one makes a call of the proto codec: one that took the gdr
// header for the call's would bind its response to a destination that
// codec's marshal never takes, and a peer could leave such bindings, each
// holding a message and its call's context, until their lease.
func usesGDR(cts []string) bool {
	return len(cts) > 0 && isGDRContentType(cts[len(cts)-1])
}

// isGDRContentType reports whether a gRPC server picks the gdr codec for a
// call with content type ct: as gRPC reads it, "application/grpc", then "+"
// or ";", then the codec's name.
func isGDRContentType(ct string) bool {
	const base = "application/grpc"
	if len(ct) <= len(base) || !strings.HasPrefix(ct, base) {
		return false
	}
	return (ct[len(base)] == '+' || ct[len(base)] == ';') && ct[len(base)+1:] == Name
}

// sessionRefusal returns why the gdr codec may not serve the call of ctx, a
// server's: its connection is no gdrpc session that negotiated the codec.
func sessionRefusal(ctx context.Context) error {
	s := transport.SessionFromContext(ctx)
	if s == nil || !s.Speaks(Name) {
		return status.Errorf(codes.FailedPrecondition, "gdrpc: the %q codec needs a gdrpc connection; this one did not negotiate it", Name)
	}
	return nil
}
