package gdrcodec

import (
	"context"
	"sync"
	"time"

	"github.com/gdrpc/gdrpc/transport"
	"google.golang.org/grpc"
)

// Payloads of messages sent without a hold (a server's responses) are bound
// to the process they went to, so that they leave the outbox as soon as no
// session to it remains rather than at the end of their lease. Marshal has
// no connection; the server's stats handler does, and sees the same message
// once it was sent (sentOn).
var sent = struct {
	sync.Mutex
	m     map[any]sentOffers // outgoing message -> its offers
	swept time.Time
}{m: map[any]sentOffers{}}

type sentOffers struct {
	tokens []transport.Token
	at     time.Time
}

// noteSent remembers the payloads v's marshaling offered until v is reported
// sent. Entries of messages never reported (a send that failed, a codec used
// without the server's stats handler) are dropped once their lease is over:
// the outbox has withdrawn their payloads by then.
func noteSent(v any, tokens []transport.Token) {
	if len(tokens) == 0 {
		return
	}
	now := time.Now()
	sent.Lock()
	defer sent.Unlock()
	sent.m[v] = sentOffers{tokens: tokens, at: now}
	if now.Sub(sent.swept) < time.Minute {
		return
	}
	sent.swept = now
	for k, o := range sent.m {
		if now.Sub(o.at) > transport.DefaultLease {
			delete(sent.m, k)
		}
	}
}

// sentOn binds the payloads of v, just sent on the call of ctx, to the peer
// of the call's session.
func sentOn(ctx context.Context, v any) {
	sent.Lock()
	o, ok := sent.m[v]
	delete(sent.m, v)
	sent.Unlock()
	if !ok {
		return
	}
	if s := transport.SessionFromContext(ctx); s != nil {
		transport.SentToward(s, o.tokens)
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
