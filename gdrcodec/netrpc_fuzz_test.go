package gdrcodec

import (
	"bytes"
	"io"
	"net/rpc"
	"testing"

	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// readOnly is a connection that reads from r and takes every write.
type readOnly struct{ io.Reader }

func (readOnly) Write(p []byte) (int, error) { return len(p), nil }
func (readOnly) Close() error                { return nil }

// FuzzNetRPCServerRead feeds a server codec arbitrary bytes as a client's
// stream: whatever they hold, reading requests gives each a message or an
// error, never a panic, and ends with an error once the bytes do. The
// connection is no gdrpc session, so a body that names a payload is refused
// before anything is pulled.
func FuzzNetRPCServerRead(f *testing.F) {
	body := []byte{0x08, 0x01} // a DeviceBuffer field
	f.Add(frame(1, "Svc.Echo", "", nil))
	f.Add(append(frame(1, "S.M", "", body), frame(2, "S.M", "", nil)...))
	f.Add(append(frame(7, "S.M", "x", body), frame(7, "S.M", "", body)...)) // a seq while it is pending
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Add([]byte{0x03, 0x01, 0x00, 0x00})
	f.Fuzz(func(t *testing.T, in []byte) {
		c := NewServerCodec(readOnly{bytes.NewReader(in)}).(*serverCodec)
		defer c.Close()
		for i := 0; ; i++ {
			var r rpc.Request
			if err := c.ReadRequestHeader(&r); err != nil {
				return
			}
			var err error
			if i%2 == 0 {
				var m gdrv1.DeviceBuffer
				err = c.ReadRequestBody(&m)
			} else {
				err = c.ReadRequestBody(nil) // as net/rpc does for a method it does not know
			}
			// As net/rpc does, whatever the body gave: the request leaves.
			_ = c.WriteResponse(&rpc.Response{Seq: r.Seq, ServiceMethod: r.ServiceMethod, Error: "x"}, nil)
			if err != nil {
				return
			}
		}
	})
}

// FuzzNetRPCClientRead is FuzzNetRPCServerRead for a client codec reading
// a server's replies, to requests it sent and to ones it never did.
func FuzzNetRPCClientRead(f *testing.F) {
	body := []byte{0x08, 0x01}
	f.Add(frame(0, "S.M", "", body))
	f.Add(append(frame(0, "S.M", "an error", body), frame(9, "S.M", "", nil)...))
	f.Add([]byte{0x80, 0x80, 0x80})
	f.Fuzz(func(t *testing.T, in []byte) {
		c := NewClientCodec(readOnly{bytes.NewReader(in)}).(*clientCodec)
		defer c.Close()
		for seq := range uint64(4) {
			if err := c.WriteRequest(&rpc.Request{Seq: seq, ServiceMethod: "S.M"}, &gdrv1.DeviceBuffer{}); err != nil {
				t.Fatalf("request %d: %v", seq, err)
			}
		}
		for {
			var r rpc.Response
			if err := c.ReadResponseHeader(&r); err != nil {
				return
			}
			var err error
			if r.Error != "" || r.Seq >= 4 {
				err = c.ReadResponseBody(nil) // as net/rpc does for an error or an unknown seq
			} else {
				var m gdrv1.DeviceBuffer
				err = c.ReadResponseBody(&m)
			}
			if err != nil {
				return
			}
		}
	})
}
