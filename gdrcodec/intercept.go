package gdrcodec

import (
	"context"
	"io"
	"slices"
	"strings"
	"sync"

	"github.com/gdrpc/gdrpc/transport"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"
)

// A hold keeps the out-of-band payloads of a call's outgoing messages in the
// outbox until the call ends: gRPC may replay the marshaled bytes of a request
// to another server (retries, hedging), and each replay is pulled again.
type hold struct {
	mu     sync.Mutex
	tokens []transport.Token
	done   bool
	// once: the call cannot replay its messages (replayable), so each payload
	// leaves the outbox after its first completed pull; the call's end
	// withdraws those never pulled.
	once bool
}

var holds sync.Map // outgoing message (pointer) -> *hold

// recvContexts gives Unmarshal the context of the call a message is received
// for (gRPC hands a codec none), so pulls end with the call's deadline or
// cancellation. Without one (a server decoding a request), pulls are bounded
// by the transfer timeout and the session's life.
var recvContexts sync.Map // incoming message (pointer) -> context.Context

func recvContext(v any) context.Context {
	if ctx, ok := recvContexts.Load(v); ok {
		return ctx.(context.Context)
	}
	return context.Background()
}

func holdOf(v any) *hold {
	if h, ok := holds.Load(v); ok {
		return h.(*hold)
	}
	return nil
}

func (h *hold) add(t transport.Token) {
	h.mu.Lock()
	done := h.done
	if !done {
		h.tokens = append(h.tokens, t)
	}
	h.mu.Unlock()
	if done {
		transport.Withdraw(t)
	}
}

func (h *hold) release() {
	h.mu.Lock()
	ts := h.tokens
	h.tokens, h.done = nil, true
	h.mu.Unlock()
	for _, t := range ts {
		transport.Withdraw(t)
	}
}

// UnaryClientInterceptor holds a request's payloads until the call returns,
// releases what the response brought when the call fails (the caller never
// sees it), and restores the status code of an out-of-band transfer that failed
// while the response was being decoded.
func UnaryClientInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		h := &hold{}
		if _, busy := holds.LoadOrStore(req, h); busy {
			h = nil // the same message in two calls at once: the first call holds it
		}
		recvContexts.Store(reply, ctx)
		err := invoker(ctx, method, req, reply, cc, opts...)
		recvContexts.Delete(reply)
		if m := messageV2Of(reply); err != nil && m != nil {
			ReleaseAll(m)
		}
		if h != nil {
			holds.Delete(req)
			h.release()
		}
		return restoreCode(err)
	}
}

// StreamClientInterceptor keeps the payloads of the messages a stream sends
// until the stream ends, or, when gRPC cannot replay them (no retry policy
// for the method), until the server pulled them once.
func StreamClientInterceptor() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			return nil, restoreCode(err)
		}
		s := &heldStream{ClientStream: cs, h: &hold{once: !replayable(cc, method)}}
		s.stop = context.AfterFunc(cs.Context(), s.h.release)
		return s, nil
	}
}

type heldStream struct {
	grpc.ClientStream
	h    *hold
	stop func() bool
}

func (s *heldStream) SendMsg(m any) error {
	_, busy := holds.LoadOrStore(m, s.h)
	err := s.ClientStream.SendMsg(m)
	if !busy {
		holds.Delete(m)
	}
	return restoreCode(err)
}

func (s *heldStream) RecvMsg(m any) error {
	recvContexts.Store(m, s.Context())
	err := s.ClientStream.RecvMsg(m)
	recvContexts.Delete(m)
	if err != nil {
		// The stream is over: nobody pulls its requests any more.
		s.stop()
		s.h.release()
	}
	if err == io.EOF {
		return err
	}
	return restoreCode(err)
}

// restoreCode gives back the code of a status that gRPC turned into Internal
// because it came out of the codec.
func restoreCode(err error) error {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Internal {
		return err
	}
	msg := st.Message()
	i := strings.Index(msg, codeMarker)
	if i < 0 {
		return err
	}
	rest := msg[i+len(codeMarker):]
	j := strings.IndexByte(rest, ']')
	if j < 0 {
		return err
	}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if c.String() == rest[:j] {
			return status.Error(c, msg)
		}
	}
	return err
}

// DialOptions returns what a gdrpc client needs on top of its dialer: the gdr
// codec, set for every call of the ClientConn (grpc.ForceCodecV2: gRPC's codec
// registry is not touched, so it needs no Register), and the interceptors above.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(gdrCodec)),
		grpc.WithChainUnaryInterceptor(UnaryClientInterceptor()),
		grpc.WithChainStreamInterceptor(StreamClientInterceptor()),
	}
}

// ServerOptions returns what a gdrpc server needs: a check that refuses gdr
// calls on connections whose handshake did not negotiate the codec (a plain TCP
// client naming the gdr subtype gets FailedPrecondition), and the release of a
// call's buffers below. gRPC finds a server's codecs by content-subtype in its
// registry, so gdr calls also need Register, called at start-up; without it they
// are refused with FailedPrecondition. ServerOptions itself registers nothing.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.InTapHandle(refuseUnnegotiated), grpc.StatsHandler(serverStats{})}
}

// serverStats gives a server call's buffers back when the call no longer needs
// them: a response's once it was sent (the outbox keeps its own reference until
// the client pulled it), a request's when the call ends. A handler that keeps a
// received buffer past its return takes it with Detach.
type serverStats struct{}

type callMessages struct {
	mu sync.Mutex
	in []proto.Message
}

type callKey struct{}

func (serverStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, callKey{}, &callMessages{})
}

func (serverStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	switch s := s.(type) {
	case *stats.InPayload:
		c, _ := ctx.Value(callKey{}).(*callMessages)
		if m := messageV2Of(s.Payload); c != nil && m != nil && mayCarry(m.ProtoReflect().Descriptor()) {
			c.mu.Lock()
			c.in = append(c.in, m)
			c.mu.Unlock()
		}
	case *stats.OutPayload:
		sentOn(ctx, s.Payload)
		if m := messageV2Of(s.Payload); m != nil {
			ReleaseAll(m)
		}
	case *stats.End:
		if c, _ := ctx.Value(callKey{}).(*callMessages); c != nil {
			c.mu.Lock()
			in := c.in
			c.in = nil
			c.mu.Unlock()
			for _, m := range in {
				ReleaseAll(m)
			}
		}
	}
}

func (serverStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (serverStats) HandleConn(context.Context, stats.ConnStats)                       {}

func refuseUnnegotiated(ctx context.Context, info *tap.Info) (context.Context, error) {
	gdr := false
	for _, ct := range info.Header.Get("content-type") {
		if strings.HasSuffix(ct, "+"+Name) {
			gdr = true
		}
	}
	if !gdr {
		return ctx, nil
	}
	if !registered.Load() {
		// gRPC would decode the call with the plain proto codec.
		return ctx, status.Errorf(codes.FailedPrecondition, "gdrpc: this server cannot serve %q calls: gdrcodec.Register was not called at start-up", Name)
	}
	s := transport.SessionFromContext(ctx)
	if s == nil || !slices.Contains(s.Peer().Caps.Codecs, Name) {
		return ctx, status.Errorf(codes.FailedPrecondition, "gdrpc: the %q codec needs a gdrpc connection; this one did not negotiate it", Name)
	}
	return ctx, nil
}
