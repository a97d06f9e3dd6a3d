// Package listener is the server face of gdrpc for gRPC: a net.Listener for
// grpc.Server.Serve that accepts gdrpc sessions (and plain HTTP/2 clients on
// the same port), and the grpc.ServerOptions a server needs.
//
// A server swaps its listener and adds the options:
//
//	gdrcodec.Register() // once, at start-up: gRPC finds a server's codecs in its registry
//	lis, err := listener.Listen(":50051")
//	srv := grpc.NewServer(listener.ServerOptions(nil)...)
//	pb.RegisterYourServiceServer(srv, impl)
//	srv.Serve(lis)
//	// to stop: srv.GracefulStop(), then lis.Shutdown(ctx): clients pull a
//	// response's payloads after its call ended
//
// Pass TLS credentials to ServerOptions instead of nil for TLS: a handler's
// peer.AuthInfo is then the credentials' own (credentials.TLSInfo). A handler
// finds the session its call came over with gdrpc.SessionFromContext. Listen
// takes package gdrpc's options (trust, transport, logger, metrics,
// limits and the rest), which apply to this listener's sessions alone.
// The examples run a server with the example tensor service, and one with
// TLS.
//
// It is thin: it owns no protocol logic (package transport does) and never
// touches UCX or device memory.
package listener
