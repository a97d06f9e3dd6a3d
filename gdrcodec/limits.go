package gdrcodec

import (
	"math"

	"google.golang.org/grpc/codes"
)

// DefaultMaxReceivePayload bounds the out-of-band payload bytes one received
// message may pull when WithMaxReceivePayload is not given: 1024 times gRPC's
// default maximum receive message size (4 MiB), 4 GiB. Out-of-band payloads
// are what gRPC's limit leaves out, and they are expected to be large; the
// factor keeps the bound proportionate to the one gRPC applies in-band.
const DefaultMaxReceivePayload = 1024 * (4 << 20)

// WithMaxReceivePayload bounds the out-of-band payload bytes one received
// message may pull, DeviceBuffers and marked bytes fields together. A message
// that announces more fails with ResourceExhausted before anything is
// allocated or pulled. It is the out-of-band counterpart of gRPC's
// MaxRecvMsgSize, which only sees the descriptors. If zero,
// DefaultMaxReceivePayload.
func WithMaxReceivePayload(n int64) Option { return func(o *options) { o.maxRecv = n } }

func (o *options) maxReceivePayload() uint64 {
	if o.maxRecv > 0 {
		return uint64(o.maxRecv)
	}
	return DefaultMaxReceivePayload
}

// MaxPayloads bounds the payloads one received message may carry: its
// DeviceBuffers and the marked bytes fields that name a payload. A message
// with more fails with ResourceExhausted, before anything is pulled: each
// payload costs an attachment or a pull, and gRPC's limit on the message's
// size alone lets 4 MiB of descriptors name a million.
const MaxPayloads = 4096

// withinLimit refuses a message whose payloads add up to more than the
// receive limit.
func withinLimit(jobs []job, limit uint64) error {
	var total uint64
	for _, j := range jobs {
		total += min(j.n, math.MaxUint64-total) // saturating
	}
	if total > limit {
		return codecError(codes.ResourceExhausted, "the message's out-of-band payloads claim %d bytes, over the limit of %d per message (gdrcodec.WithMaxReceivePayload)", total, limit)
	}
	return nil
}
