package gdrcodec

import (
	"context"

	"google.golang.org/grpc"

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
		sent.put(v, tokens)
	}
}

// sentOn binds the payloads of v, just sent on the call of ctx, to the peer
// of the call's session.
func sentOn(ctx context.Context, v any) {
	tokens, ok := sent.take(v)
	if !ok {
		return
	}
	if s := transport.SessionFromContext(ctx); s != nil {
		oob.SentToward(s, tokens)
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
