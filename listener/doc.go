// Package listener is the server face of gdrpc for gRPC: a net.Listener for
// grpc.Server.Serve that accepts gdrpc sessions (and plain HTTP/2 clients on
// the same port), and the grpc.ServerOptions a server needs.
//
// It is thin: it owns no protocol logic (package transport does) and never
// touches UCX or device memory.
package listener
