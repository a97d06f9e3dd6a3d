package dialer

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// Buffer and window sizes the options set (see transport.GRPCBufferSize); the
// HTTP/2 windows match the multiplexer's.
const (
	WriteBufferSize = transport.GRPCBufferSize
	ReadBufferSize  = transport.GRPCBufferSize
	WindowSize      = transport.DefaultWindow
)

// Dialer makes gdrpc sessions for gRPC.
type Dialer struct {
	opts []transport.Option
}

// New returns a Dialer whose sessions use opts.
func New(opts ...transport.Option) *Dialer {
	return &Dialer{opts: append([]transport.Option(nil), opts...)}
}

// DialContext dials a gdrpc session to addr (host:port) and returns the conn
// gRPC runs on. Closing the conn closes the session. It has the signature of
// grpc.WithContextDialer.
func (d *Dialer) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	s, err := transport.Dial(ctx, addr, d.opts...)
	if err != nil {
		return nil, err
	}
	c, err := s.Conn(ctx)
	if err != nil {
		_ = s.Close()
		return nil, err
	}
	return c, nil
}

// DialOptions returns the options a gRPC client needs to run over gdrpc: the
// dialer, transport credentials (creds wrapped by transport.NewCredentials;
// nil creds means no security), buffer sizes and HTTP/2 windows suited to a
// message transport, and the out-of-band codec (gdrcodec.DialOptions: the
// gdr codec for every call of the ClientConn and the interceptors that keep
// request payloads available until the call ends and return the status code
// of a response payload that could not be pulled; it registers nothing with
// gRPC). The AuthInfo of a call's peer (grpc.Peer) is creds' own, and
// transport.SessionFromPeer finds the session from the peer.
func (d *Dialer) DialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return append([]grpc.DialOption{
		grpc.WithContextDialer(d.DialContext),
		grpc.WithTransportCredentials(transport.NewCredentials(creds)),
		grpc.WithWriteBufferSize(WriteBufferSize),
		grpc.WithReadBufferSize(ReadBufferSize),
		grpc.WithInitialWindowSize(WindowSize),
		grpc.WithInitialConnWindowSize(WindowSize),
	}, gdrcodec.DialOptions()...)
}
