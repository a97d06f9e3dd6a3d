package gdrcodec

import (
	"net"
	"net/rpc"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// WithNetRPCPending / WithNetRPCPendingBytes: "past the bound the server
// reads no further request until a reply is written". A request whose reply
// is being written (a client that reads no reply holds the write up to the
// write timeout) has left the requests a seq may not repeat
// (TestNetRPCAnsweredSeqReused) but still counts towards both bounds.
func TestNetRPCPendingBoundHoldsWhileReplyWrites(t *testing.T) {
	body, err := proto.Marshal(&gdrv1.DeviceBuffer{Device: 7}) // a few bytes: counted by the bytes bound
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"count", []Option{WithNetRPCPending(1)}},
		{"bytes", []Option{WithNetRPCPending(-1), WithNetRPCPendingBytes(1)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cli, sv := net.Pipe() // a write waits for the peer's read; the client reads no reply
			defer cli.Close()
			s := NewServerCodec(sv, tc.opts...).(*serverCodec)
			defer s.Close()
			go func() { _, _ = cli.Write(frame(1, "Svc.Echo", "", body)) }()
			var r rpc.Request
			require.NoError(t, s.ReadRequestHeader(&r))
			require.NoError(t, s.ReadRequestBody(&gdrv1.DeviceBuffer{}))
			// net/rpc's handler goroutine answers seq 1 before its reader
			// loops back: the reply's write waits for a client that reads
			// nothing.
			go func() { _ = s.WriteResponse(&rpc.Response{Seq: 1, ServiceMethod: "Svc.Echo"}, &gdrv1.DeviceBuffer{}) }()
			time.Sleep(200 * time.Millisecond) // the reply's write is under way
			go func() { _, _ = cli.Write(frame(2, "Svc.Echo", "", body)) }()
			read := make(chan error, 1)
			go func() {
				var r2 rpc.Request
				read <- s.ReadRequestHeader(&r2)
			}()
			select {
			case err := <-read:
				t.Fatalf("a second request was read while the first one's reply is not written (bound 1): %v", err)
			case <-time.After(300 * time.Millisecond):
			}
			_ = cli.Close()
			_ = s.Close()
			<-read
		})
	}
}
