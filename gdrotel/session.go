package gdrotel

import (
	"context"
	"errors"
	"net"

	"go.opentelemetry.io/otel/attribute"

	"github.com/gdrpc/gdrpc/transport"
)

// Attribute keys of the session instruments (and keyOutcome, keyReason).
const (
	keyTransport attribute.Key = "transport" // what the session runs over: "ucx" or "tcp"
	keySide      attribute.Key = "side"      // "client" (this side dialed) or "server"
)

// Values of keyOutcome on gdrpc.session.closed: why the session closed.
const (
	closedLocally   = "closed"    // this side closed it
	closedIdle      = "idle"      // it carried nothing for its idle timeout
	closedKeepAlive = "keepalive" // the peer did not answer a keepalive in time
	closedPeerGone  = "peer_gone" // the peer closed it, or the connection broke
)

type sessionKey struct {
	transport string
	client    bool
}

func sessionAttrs(k sessionKey) []attribute.KeyValue {
	side := "server"
	if k.client {
		side = "client"
	}
	return []attribute.KeyValue{keyTransport.String(k.transport), keySide.String(side)}
}

type sessionClosedKey struct {
	sessionKey
	outcome string
}

func sessionClosedAttrs(k sessionClosedKey) []attribute.KeyValue {
	return append(sessionAttrs(k.sessionKey), keyOutcome.String(k.outcome))
}

func sessionFallbackAttrs(reason string) []attribute.KeyValue {
	return []attribute.KeyValue{keyReason.String(reason)}
}

// SessionUp records a session that opened.
func (r *Recorder) SessionUp(transportName string, client bool) {
	if r.off() {
		return
	}
	o := r.sessionOpts.get(sessionKey{transport: transportName, client: client})
	ctx := context.Background()
	r.sessionActive.Add(ctx, 1, o.add...)
	r.sessionOpened.Add(ctx, 1, o.add...)
}

// SessionDown records a session that closed and why, by the class of err
// (never its text).
func (r *Recorder) SessionDown(transportName string, client bool, err error) {
	if r.off() {
		return
	}
	k := sessionKey{transport: transportName, client: client}
	ctx := context.Background()
	r.sessionActive.Add(ctx, -1, r.sessionOpts.get(k).add...)
	r.sessionClosed.Add(ctx, 1, r.sessionClosedOpts.get(sessionClosedKey{k, closeOutcome(err)}).add...)
}

// closeOutcome classifies the cause of a session's end (transport.Session.Err).
func closeOutcome(err error) string {
	switch {
	case err == nil:
		return closedLocally
	case errors.Is(err, transport.ErrKeepAlive):
		return closedKeepAlive
	case errors.Is(err, transport.ErrIdle):
		return closedIdle
	case errors.Is(err, transport.ErrPeerGone):
		return closedPeerGone
	case errors.Is(err, net.ErrClosed):
		return closedLocally
	}
	return outcomeError
}

// SessionFallback records a session that stayed on TCP although one side
// offered UCX (transport.SessionMetrics.Fallback). The reason is recorded by
// its class (see WithMaxReasons): the text before its first colon.
func (r *Recorder) SessionFallback(reason string) {
	if r.off() {
		return
	}
	class := reasonClass(reason)
	o, ok := r.sessionFallbackOpts.lookup(class)
	if !ok {
		o = r.sessionFallbackOpts.get(r.sessionReasons.admit(class))
	}
	r.sessionFallbacks.Add(context.Background(), 1, o.add...)
}
