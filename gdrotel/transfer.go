package gdrotel

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

// Attribute keys of the transfer instruments.
const (
	keyRoute     attribute.Key = "route"      // TransferInfo.Route: "rdma/cuda", "rdma", "cuda-ipc", "staged", "stream", "local"
	keyPath      attribute.Key = "path"       // the transport.Path taken
	keyDirection attribute.Key = "direction"  // "receive" (this side pulled the bytes) or "send"
	keyMemory    attribute.Key = "memory"     // this side's memory: "host" or "cuda"
	keyOutcome   attribute.Key = "outcome"    // "ok" or "error"
	keyErrorType attribute.Key = "error.type" // on outcome=error: the transport.TransferErrorKind, or "_OTHER"
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

// transferMetrics is the Recorder's transport.Metrics.
type transferMetrics struct{ r *Recorder }

var _ transport.Metrics = transferMetrics{}

// Transfers returns the receiver of the out-of-band engine's events, for
// transport.TransferConfig.Metrics. It records gdrpc.transfer.io,
// gdrpc.transfers, gdrpc.transfer.duration and gdrpc.transfer.fallbacks.
func (r *Recorder) Transfers() transport.Metrics { return transferMetrics{r} }

// transferKey is what a transfer's attributes are made from.
type transferKey struct {
	path      transport.Path
	memory    devicebuf.Kind
	pull      bool
	errorType string // "" for a transfer that succeeded
}

func transferAttrs(k transferKey) []attribute.KeyValue {
	direction := directionSend
	if k.pull {
		direction = directionReceive
	}
	kv := []attribute.KeyValue{
		keyRoute.String(transport.TransferInfo{Path: k.path, Memory: k.memory}.Route()),
		keyPath.String(k.path.String()),
		keyDirection.String(direction),
		keyMemory.String(k.memory.String()),
	}
	if k.errorType == "" {
		return append(kv, keyOutcome.String(outcomeOK))
	}
	return append(kv, keyOutcome.String(outcomeError), keyErrorType.String(k.errorType))
}

// Transfer records one finished transfer: its bytes, one transfer and its
// duration, under the same attributes.
func (t transferMetrics) Transfer(info transport.TransferInfo) {
	r := t.r
	o := r.transferOpts.get(transferKey{path: info.Path, memory: info.Memory, pull: info.Pull, errorType: errorType(info.Err)})
	ctx := context.Background()
	if info.Bytes > 0 {
		r.transferIO.Add(ctx, info.Bytes, o.add...)
	}
	r.transferCount.Add(ctx, 1, o.add...)
	r.transferDuration.Record(ctx, info.Elapsed.Seconds(), o.record...)
}

// errorType is the error.type of a failed transfer: the kind of the
// transport.TransferError in err's chain, "_OTHER" when there is none or its
// kind is unknown here, "" when err is nil.
func errorType(err error) string {
	if err == nil {
		return ""
	}
	te, ok := errors.AsType[*transport.TransferError](err)
	if !ok {
		return otherValue
	}
	switch te.Kind {
	case transport.TransferFailed:
		return "failed"
	case transport.TransferUnavailable:
		return "unavailable"
	case transport.TransferNotFound:
		return "not_found"
	case transport.TransferTimeout:
		return "timeout"
	case transport.TransferInvalid:
		return "invalid"
	case transport.TransferCanceled:
		return "canceled"
	case transport.TransferExhausted:
		return "exhausted"
	}
	return otherValue
}

// transferFallbackKey is what a transfer fallback's attributes are made from;
// reason is an admitted reason class.
type transferFallbackKey struct {
	wanted, took transport.Path
	reason       string
}

func transferFallbackAttrs(k transferFallbackKey) []attribute.KeyValue {
	return []attribute.KeyValue{
		keyWanted.String(k.wanted.String()),
		keyTook.String(k.took.String()),
		keyReason.String(k.reason),
	}
}

// Fallback records a transfer that took a worse path than wanted. The reason
// is recorded by its class (see WithMaxReasons): the text before its first
// colon.
func (t transferMetrics) Fallback(wanted, took transport.Path, reason string) {
	r := t.r
	k := transferFallbackKey{wanted: wanted, took: took, reason: reasonClass(reason)}
	o, ok := r.transferFallbackOpts.lookup(k)
	if !ok {
		k.reason = r.transferReasons.admit(k.reason)
		o = r.transferFallbackOpts.get(k)
	}
	r.transferFallbacks.Add(context.Background(), 1, o.add...)
}
