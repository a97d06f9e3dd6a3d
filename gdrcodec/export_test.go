package gdrcodec

import (
	"context"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// MarshalForTest marshals m with the gdr codec, as a client would.
func MarshalForTest(m proto.Message) ([]byte, error) {
	data, err := (&codec{name: Name, oob: true}).Marshal(m)
	if err != nil {
		return nil, err
	}
	defer data.Free()
	return data.Materialize(), nil
}

// UnmarshalForTest decodes b with the gdr codec as the receive of a call
// that gdrpc's options track, with no session in its context (a payload it
// names is pulled over whichever session reaches its owner).
func UnmarshalForTest(b []byte, m proto.Message) error {
	rc := expectReceive(context.Background(), m, false)
	defer rc.closeCall()
	return rc.done(m, UnmarshalUntrackedForTest(b, m))
}

// UnmarshalUntrackedForTest decodes b with the gdr codec as a receive that
// no gdrpc option tracks.
func UnmarshalUntrackedForTest(b []byte, m proto.Message) error {
	return (&codec{name: Name, oob: true}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, m)
}

// TrackedForTest returns how many messages the codec's call bookkeeping
// notes now: being received (recvCalls) and being sent (holds).
func TrackedForTest() (receiving, sending int) {
	recvCalls.Range(func(any, any) bool { receiving++; return true })
	holds.Range(func(any, any) bool { sending++; return true })
	return receiving, sending
}

// CallNotedForTest reports whether the server call of ctx has the codec's
// record of a method whose messages may carry payloads (a plain method's
// keeps its request alone), and the client's number for the call it holds
// (0: none).
func CallNotedForTest(ctx context.Context) (noted bool, clientCall uint64) {
	c, ok := ctx.Value(callKey{}).(*callMessages)
	if !ok || c.plain {
		return false, 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return true, c.clientCall
}

// DestinationsForTest returns how many outgoing messages are bound to a
// destination (bindDestination) and not yet marshaled.
func DestinationsForTest() int { return int(destinations.n.Load()) }

// DecodingForTest reports whether the server decodes a unary request of the
// type named now (its call began, its request not yet decoded).
func DecodingForTest(name protoreflect.FullName) bool { return decoding.has(name) }

// FiledDecodesForTest returns how many decoded messages the codec keeps
// process-wide for a stats event to take (a failed decode's status, a
// request's call number and pulls).
func FiledDecodesForTest() int64 { return failures.n.Load() + pendingPulls.n.Load() }
