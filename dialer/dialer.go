package dialer

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/face"
	"github.com/gdrpc/gdrpc/transport"
)

// Dialer makes gdrpc sessions for gRPC.
type Dialer struct {
	opts []transport.Option
}

// New returns a Dialer whose sessions and transfers follow opts (package
// gdrpc's options: trust, transport, logging, metrics, limits and the rest).
func New(opts ...gdrpc.Option) *Dialer {
	return &Dialer{opts: face.SessionOptions(opts)}
}

// DialContext dials a gdrpc session to addr (host:port) and returns the conn
// gRPC runs on. Closing the conn closes the session. It has the signature of
// grpc.WithContextDialer.
func (d *Dialer) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	return transport.DialConn(ctx, addr, d.opts...)
}

// DialOptions returns the options a gRPC client needs to run over gdrpc: the
// dialer; transport credentials (creds wrapped so that handlers find the
// session; nil creds means no security); buffer sizes and HTTP/2 windows
// suited to a message transport; and the out-of-band codec
// (gdrcodec.DialOptions: the gdr codec for every call of the ClientConn and
// the interceptors that keep request payloads available until the call ends;
// it registers nothing with gRPC). codecOpts (gdrcodec.WithReceiveAllocator,
// WithMaxReceivePayload, ...) apply to the calls of this ClientConn alone, in
// place of all of gdrcodec.Register's (what they leave out takes its
// default); without them the codec follows gdrcodec.Register's. The AuthInfo of a
// call's peer (grpc.Peer) is creds' own, and gdrpc.SessionFromPeer finds the
// session.
func (d *Dialer) DialOptions(creds credentials.TransportCredentials, codecOpts ...gdrcodec.Option) []grpc.DialOption {
	return append([]grpc.DialOption{
		grpc.WithContextDialer(d.DialContext),
		grpc.WithTransportCredentials(transport.NewCredentials(creds)),
		grpc.WithWriteBufferSize(transport.GRPCBufferSize),
		grpc.WithReadBufferSize(transport.GRPCReadBufferSize),
		grpc.WithInitialWindowSize(transport.DefaultWindow),
		grpc.WithInitialConnWindowSize(transport.DefaultWindow),
	}, gdrcodec.DialOptions(codecOpts...)...)
}
