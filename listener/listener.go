package listener

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// Buffer and window sizes the options set; see package dialer.
const (
	WriteBufferSize = transport.GRPCBufferSize
	ReadBufferSize  = transport.GRPCBufferSize
	WindowSize      = transport.DefaultWindow
)

// Listen listens for gdrpc sessions on addr (host:port). Hand the listener to
// grpc.Server.Serve; Close (or the server's Stop) makes Serve return.
func Listen(addr string, opts ...transport.Option) (*transport.Listener, error) {
	return transport.Listen(addr, opts...)
}

// ServerOptions returns the options a gRPC server needs to serve gdrpc
// sessions: transport credentials (creds wrapped by transport.NewCredentials;
// nil creds means no security), buffer sizes and HTTP/2 windows suited to a
// message transport, and the out-of-band codec's (gdrcodec.ServerOptions:
// chained interceptors that refuse the gdr codec on connections that did not
// negotiate it and give a failed transfer's status code to the caller, and a
// stats handler that gives a call's buffers back). The server's own
// interceptors, stats handlers and tap handle compose with them. gRPC finds a
// server's codecs in its registry: call gdrcodec.Register at start-up, or gdr
// calls are refused with FailedPrecondition.
func ServerOptions(creds credentials.TransportCredentials) []grpc.ServerOption {
	return append([]grpc.ServerOption{
		grpc.Creds(transport.NewCredentials(creds)),
		grpc.WriteBufferSize(WriteBufferSize),
		grpc.ReadBufferSize(ReadBufferSize),
		grpc.InitialWindowSize(WindowSize),
		grpc.InitialConnWindowSize(WindowSize),
	}, gdrcodec.ServerOptions()...)
}
