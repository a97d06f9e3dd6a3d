package listener

import (
	"runtime"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/face"
	"github.com/gdrpc/gdrpc/transport"
)

// Listen listens for gdrpc sessions on addr (host:port); their sessions and
// transfers follow opts (package gdrpc's options). Hand the listener to
// grpc.Server.Serve; Close (or the server's Stop) makes Serve return. Plain
// gRPC clients (HTTP/2, with or without TLS) are served on the same port.
//
// A client pulls a response's out-of-band payloads after its call ended, so
// a server process stops with the server's Stop or GracefulStop and then
// the listener's Shutdown, which returns once the sessions it accepted
// are closed (their transfers over, or cut short at its context's end),
// before it exits.
func Listen(addr string, opts ...gdrpc.Option) (*transport.Listener, error) {
	return transport.Listen(addr, face.SessionOptions(opts)...)
}

// ServerOptions returns the options a gRPC server needs to serve gdrpc
// sessions: transport credentials (creds wrapped so that handlers find the
// session; nil creds means no security), buffer sizes and HTTP/2 windows
// suited to a message transport, stream workers, and the out-of-band codec's
// (gdrcodec.ServerOptions: chained interceptors that refuse the gdr codec on
// connections that did not negotiate it and give a failed transfer's status
// code to the caller, and a stats handler that gives a call's buffers back).
// The server's own interceptors, stats handlers and tap handle compose with
// them. gRPC finds a server's codecs in its registry: call gdrcodec.Register
// at start-up, or gdr calls are refused with FailedPrecondition.
//
// Stream workers (gRPC's NumStreamWorkers, one per GOMAXPROCS) serve calls on
// long-lived goroutines instead of a new goroutine per call: a call's handler
// goes deep (marshal, a put or a copy into the client's receive space, the
// UCX driver's queue) and a fresh goroutine grows and copies its stack on the
// way, on the call's path. gRPC starts a goroutine as before when every
// worker is busy. The workers start with grpc.NewServer and end with Stop or
// GracefulStop (a server that is only left, its listener closed, keeps them);
// their number is GOMAXPROCS when ServerOptions runs. A later
// grpc.NumStreamWorkers option overrides it, 0 turning workers off (the
// option is experimental in gRPC-Go).
func ServerOptions(creds credentials.TransportCredentials) []grpc.ServerOption {
	return append([]grpc.ServerOption{
		grpc.Creds(transport.NewCredentials(creds)),
		grpc.WriteBufferSize(transport.GRPCBufferSize),
		grpc.ReadBufferSize(transport.GRPCReadBufferSize),
		grpc.InitialWindowSize(transport.DefaultWindow),
		grpc.InitialConnWindowSize(transport.DefaultWindow),
		grpc.NumStreamWorkers(uint32(runtime.GOMAXPROCS(0))),
	}, gdrcodec.ServerOptions()...)
}
