package gdrcodec

import (
	"net"
	"net/rpc"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// A request whose seq is that of one already answered is a new request:
// net/rpc's wire allows a client to reuse a seq once its reply arrived (a
// sequential client with one fixed seq does). The server codec forgets the
// answered request before the reply's first byte goes out: a client that
// gets the reply and asks again at once is served, not refused as a
// duplicate of a request "not answered yet" and its connection ended.
func TestNetRPCAnsweredSeqReused(t *testing.T) {
	conn := newHookConn(t)
	s := NewServerCodec(conn).(*serverCodec)
	defer s.Close()
	go func() { _, _ = conn.pw.Write(frame(5, "Svc.Echo", "", nil)) }()
	var r rpc.Request
	require.NoError(t, s.ReadRequestHeader(&r))
	require.NoError(t, s.ReadRequestBody(&gdrv1.DeviceBuffer{}))

	var again error
	read := false
	var once sync.Once
	conn.onWrite = func() {
		once.Do(func() {
			// The reply's bytes are handed to the connection: the client
			// has them (over a net.Pipe, before Write even returns) and
			// asks again with the seq it got its answer for.
			go func() { _, _ = conn.pw.Write(frame(5, "Svc.Echo", "", nil)) }()
			var r2 rpc.Request
			again, read = s.ReadRequestHeader(&r2), true
		})
	}
	require.NoError(t, s.WriteResponse(&rpc.Response{Seq: 5, ServiceMethod: "Svc.Echo"}, &gdrv1.DeviceBuffer{}))
	require.True(t, read)
	require.NoError(t, again, "a request with the seq of one already answered was refused, and its connection ended")
}

// seenHeaderErrors is a server codec that reports what ReadRequestHeader
// returned as an error.
type seenHeaderErrors struct {
	rpc.ServerCodec
	errs chan error
}

func (c *seenHeaderErrors) ReadRequestHeader(r *rpc.Request) error {
	err := c.ServerCodec.ReadRequestHeader(r)
	if err != nil {
		select {
		case c.errs <- err:
		default:
		}
	}
	return err
}

// The same through net/rpc's ServeCodec: a client that makes one call at a
// time with one fixed seq (its previous call answered) keeps its connection
// (it lost it on its second call, over a net.Pipe every time).
func TestNetRPCSequentialClientReusingSeq(t *testing.T) {
	cli, sv := net.Pipe()
	defer cli.Close()
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Svc", echoes{}))
	sc := &seenHeaderErrors{ServerCodec: NewServerCodec(sv), errs: make(chan error, 1)}
	served := make(chan struct{})
	go func() { srv.ServeCodec(sc); close(served) }()
	c := NewClientCodec(cli)
	for i := range 100 {
		require.NoError(t, c.WriteRequest(&rpc.Request{Seq: 0, ServiceMethod: "Svc.Echo"}, &gdrv1.DeviceBuffer{}), "call %d", i)
		var r rpc.Response
		err := c.ReadResponseHeader(&r)
		if err != nil {
			cli.Close()
			<-served
			var why error
			select {
			case why = <-sc.errs:
			default:
			}
			t.Fatalf("call %d (seq 0, the one before answered): %v; the server's reading ended with: %v", i, err, why)
		}
		require.NoError(t, c.ReadResponseBody(&gdrv1.DeviceBuffer{}))
		require.Empty(t, r.Error)
	}
	require.NoError(t, c.Close())
	<-served
}
