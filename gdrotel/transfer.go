package gdrotel

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/oob"
)

// Attribute keys of the transfer instruments.
const (
	keyRoute     attribute.Key = "route"      // TransferInfo.Route: "rdma/cuda", "rdma", "cuda-ipc", "staged", "stream"
	keyPath      attribute.Key = "path"       // the oob.Path taken
	keyDirection attribute.Key = "direction"  // "receive" (this side pulled the bytes) or "send"
	keyMemory    attribute.Key = "memory"     // this side's memory: "host" or "cuda"
	keyAdvertise attribute.Key = "advertised" // true: into receive space the receiver advertised, no rendezvous
	keyQueued    attribute.Key = "queued"     // on advertised=true: the owner's copy could still run when its message went (TransferInfo.Queued)
	keyOutcome   attribute.Key = "outcome"    // "ok" or "error"
	keyErrorType attribute.Key = "error.type" // on outcome=error: the oob.TransferErrorKind, or "_OTHER"
	keyWanted    attribute.Key = "wanted"     // a fallback's better path
	keyTook      attribute.Key = "took"       // the path a fallback took instead
	keyReason    attribute.Key = "reason"     // why, without the error's text
)

// Values of keyDirection and keyOutcome.
const (
	directionReceive = "receive"
	directionSend    = "send"
	outcomeOK        = "ok"
	outcomeError     = "error"
)

// The Recorder is a gdrpc.Metrics: pass it to gdrpc.WithMetrics.
var _ gdrpc.Metrics = (*Recorder)(nil)

// transferKey is what a transfer's attributes are made from.
type transferKey struct {
	path      oob.Path
	memory    devicebuf.Kind
	pull      bool
	advertise bool
	queued    bool
	errorType string // "" for a transfer that succeeded
}

func transferAttrs(k transferKey) []attribute.KeyValue {
	direction := directionSend
	if k.pull {
		direction = directionReceive
	}
	kv := []attribute.KeyValue{
		keyRoute.String(oob.TransferInfo{Path: k.path, Memory: k.memory}.Route()),
		keyPath.String(k.path.String()),
		keyDirection.String(direction),
		keyMemory.String(k.memory.String()),
		keyAdvertise.Bool(k.advertise),
	}
	if k.advertise {
		kv = append(kv, keyQueued.Bool(k.queued))
	}
	if k.errorType == "" {
		return append(kv, keyOutcome.String(outcomeOK))
	}
	return append(kv, keyOutcome.String(outcomeError), keyErrorType.String(k.errorType))
}

// Transfer records one finished transfer: its bytes (a successful one's),
// one transfer and its duration, under the same attributes. A failed
// transfer's length is what its descriptor claimed, a peer's word for bytes
// that did not all arrive: counted, it would let a peer set a byte counter
// (and, claiming a terabyte a time, wrap it negative).
func (r *Recorder) Transfer(info oob.TransferInfo) {
	if r.off() {
		return
	}
	o := r.transferOpts.get(transferKey{path: info.Path, memory: info.Memory, pull: info.Pull, advertise: info.Advertised, queued: info.Queued, errorType: errorType(info.Err)})
	ctx := context.Background()
	if info.Bytes > 0 && info.Err == nil {
		r.transferIO.Add(ctx, info.Bytes, o.add...)
	}
	r.transferCount.Add(ctx, 1, o.add...)
	r.transferDuration.Record(ctx, info.Elapsed.Seconds(), o.record...)
}

// errorType is the error.type of a failed transfer: the kind of the
// oob.TransferError in err's chain, "_OTHER" when there is none or its
// kind is unknown here, "" when err is nil.
func errorType(err error) string {
	if err == nil {
		return ""
	}
	te, ok := errors.AsType[*oob.TransferError](err)
	if !ok {
		return otherValue
	}
	switch te.Kind {
	case oob.TransferFailed:
		return "failed"
	case oob.TransferUnavailable:
		return "unavailable"
	case oob.TransferNotFound:
		return "not_found"
	case oob.TransferTimeout:
		return "timeout"
	case oob.TransferInvalid:
		return "invalid"
	case oob.TransferCanceled:
		return "canceled"
	case oob.TransferExhausted:
		return "exhausted"
	}
	return otherValue
}

// transferFallbackKey is what a transfer fallback's attributes are made from;
// reason is an admitted reason class.
type transferFallbackKey struct {
	wanted, took oob.Path
	reason       string
}

func transferFallbackAttrs(k transferFallbackKey) []attribute.KeyValue {
	return []attribute.KeyValue{
		keyWanted.String(k.wanted.String()),
		keyTook.String(k.took.String()),
		keyReason.String(k.reason),
	}
}

// TransferFallback records a transfer that took a worse path than wanted. The reason
// is recorded by its class (see WithMaxReasons): the text before its first
// colon.
func (r *Recorder) TransferFallback(wanted, took oob.Path, reason string) {
	if r.off() {
		return
	}
	k := transferFallbackKey{wanted: wanted, took: took, reason: reasonClass(reason)}
	o, ok := r.transferFallbackOpts.lookup(k)
	if !ok {
		k.reason = r.transferReasons.admit(k.reason)
		o = r.transferFallbackOpts.get(k)
	}
	r.transferFallbacks.Add(context.Background(), 1, o.add...)
}
