package gdrcodec

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Payloads of messages sent without a hold (a server's responses) are bound
// to the process they went to, so that they leave the outbox as soon as no
// session to it remains rather than at the end of their lease. Marshal has
// no connection; the server's stats handler does, and sees the same message
// once it was sent (sentOn).
var sent = newExpiring[[]oob.Token](oob.DefaultLease)

// noteSent remembers the payloads v's marshaling offered until v is reported
// sent. Entries of messages never reported (a send that failed, a codec used
// without the server's stats handler) are dropped once their lease is over:
// the outbox has withdrawn their payloads by then.
func noteSent(v any, tokens []oob.Token) {
	if len(tokens) > 0 {
		// Notes are keyed by the message: one message sent on two calls at
		// once is not supported (its buffers go once it is sent), and the
		// first call's note is kept, not replaced.
		sent.putNew(v, tokens)
	}
}

// sentOn binds the payloads of v, just sent on the call of ctx, to the peer
// of the call's session.
func sentOn(ctx context.Context, v any) { sentOver(transport.SessionFromContext(ctx), v) }

// sentOver binds the payloads of v, just sent over s (nil: no session of
// gdrpc's), to the peer of s.
func sentOver(s *transport.Session, v any) {
	tokens, ok := sent.take(v)
	if ok && s != nil {
		oob.SentToward(s, tokens)
	}
}

// notSent withdraws the payloads v's marshaling offered: gRPC failed to send
// v (its call is over), so nobody will pull them.
func notSent(v any) {
	tokens, _ := sent.take(v)
	for _, t := range tokens {
		oob.Withdraw(t)
	}
}

// replayable reports whether gRPC may send a client stream's messages again
// after the server received them: only under a retry policy. Without one,
// the only replays are transparent retries, which happen only when the
// server never saw the stream, so a payload that was pulled is not pulled
// again.
func replayable(cc *grpc.ClientConn, method string) bool {
	return cc.GetMethodConfig(method).RetryPolicy != nil
}

// destination is where a server's outgoing message goes: the session of its
// call, the context that bounds its send, and the call's record, which keeps
// the payloads written into the peer's receive space until the message is
// reported sent.
type destination struct {
	ctx  context.Context
	s    *transport.Session
	call *callMessages // nil outside a server call with the stats handler
}

// destinations holds the destinations of messages about to be marshaled;
// entries of messages never marshaled leave after a lease.
var destinations = newExpiring[*destination](oob.DefaultLease)

// bindDestination notes that v, about to be sent on the server call of ctx,
// goes to the peer of the call's session: its marshaling may then write
// payloads into receive space that peer advertised (oob.OfferTo).
func bindDestination(ctx context.Context, v any) {
	c, _ := ctx.Value(callKey{}).(*callMessages)
	bindTo(ctx, transport.SessionFromContext(ctx), c, v)
}

// bindTo notes that v goes to the peer of s, on call if not nil, its send
// bounded by ctx.
func bindTo(ctx context.Context, s *transport.Session, call *callMessages, v any) {
	if s == nil {
		return
	}
	if !canCarry(v) {
		return
	}
	if !destinations.putNew(v, &destination{ctx: ctx, s: s, call: call}) {
		// Another call sends v too and has not marshaled it yet. A marshal
		// sees only the message, so no destination can be told to be its
		// own from then on, and a payload written into one peer's receive
		// space, or bound to it, while its descriptor goes to another
		// would reach the wrong peer: v is marked shared until the mark's
		// lease ends, and its marshals take no destination.
		destinations.put(v, sharedMessage)
	}
}

// sharedMessage is the destination of a message that two calls were
// sending at once (bindTo): it stays, whoever takes it, until its lease
// ends.
var sharedMessage = &destination{}

// errSharedMessage fails the marshal of a message with buffers that was
// sent on two calls at once.
var errSharedMessage = codecError(codes.FailedPrecondition, "a message with buffers attached was sent on two calls at once: a server releases a response's buffers once it is sent, so send each call a message of its own")

func takeDestination(v any) *destination {
	d, _ := destinations.takeUnless(v, func(d *destination) bool { return d == sharedMessage })
	return d
}

// mayLand reports whether the message's payloads may be written into the
// peer's receive space: a gRPC call's only where its client numbered the
// call, for an unnumbered call ends with no CALL-ENDED, and a range its
// client did not take (a field its schema lacks) would stay taken for the
// session's life; a net/rpc reply's (a record with no owner) always.
func (d *destination) mayLand() bool {
	switch {
	case d.call == nil:
		return false // no call's record: nobody to take the ranges back
	case d.call.owner == nil:
		return true // a net/rpc reply
	}
	return d.clientCall() != 0
}

// clientCall is the client's number for the call the message answers, or 0.
func (d *destination) clientCall() uint64 {
	if d.call == nil {
		return 0
	}
	d.call.mu.Lock()
	defer d.call.mu.Unlock()
	return d.call.clientCall
}

// admit binds ts, the payloads of v's marshaling left in the outbox for the
// peer to pull, to the peer, once the call's earlier messages leave room
// (oob.Flow.Send): a server stream's next message waits here, within its
// call, rather than run ahead of a client that does not read it. A net/rpc
// reply has a record of its own (one message to a request), and so does a
// message of a call gdrpc's stats handler did not tag: such a message waits
// only for the peer's bound (oob.Limits.PeerUnpulledBytes), until its
// session closes or its payloads' lease ends. A net/rpc connection's later
// replies wait behind it (net/rpc writes them in turn), as an honest
// client's reader pulls the replies before it.
func (d *destination) admit(ts []oob.Token) error {
	if d == nil || len(ts) == 0 {
		return nil
	}
	if d.call == nil {
		return new(oob.Flow).Send(d.ctx, d.s, 0, ts)
	}
	return d.call.flow.Send(d.ctx, d.s, d.clientCall(), ts)
}

// landed records ds, v's payloads written into the peer's receive space,
// until v is reported sent; the call's end gives back those of messages
// never sent (the receiver never learns of them).
func (d *destination) landed(v any, ds []oob.Descriptor) {
	if d == nil || d.call == nil || len(ds) == 0 {
		return // without a call nobody reports the send: the receiver gives the ranges back
	}
	d.call.mu.Lock()
	if d.call.landed == nil {
		d.call.landed = map[any]landedPayloads{}
	}
	d.call.landed[v] = landedPayloads{s: d.s, ds: ds}
	d.call.mu.Unlock()
}

type landedPayloads struct {
	s  *transport.Session
	ds []oob.Descriptor
}

// reclaim gives back the receive space of payloads never sent.
func (l landedPayloads) reclaim() {
	for _, d := range l.ds {
		oob.Reclaim(l.s, d)
	}
}
