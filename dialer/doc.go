// Package dialer is the client face of gdrpc for gRPC: a dial function for
// grpc.WithContextDialer that makes a gdrpc session per connection, and the
// grpc.DialOptions a client needs.
//
// A client swaps its dialer and nothing else:
//
//	d := dialer.New()
//	cc, err := grpc.NewClient("passthrough:///host:50051", d.DialOptions(nil)...)
//
// DialOptions selects the out-of-band codec for every call of the ClientConn,
// so a client needs no gdrcodec.Register; codec options given to it (the
// receive allocator: where payloads land, such as a GPU) apply to that
// ClientConn alone. Pass TLS credentials to it instead of nil for TLS. New
// takes package gdrpc's options: gdrpc.WithTrustPeers (sessions run over TCP
// unless the peers trust each other, then over UCX where both ends have it),
// the transport, logger, metrics, limits, transfer timeout and the others of
// package gdrpc; they apply to this Dialer's sessions alone. A call's session
// is found from its peer (grpc.Peer and gdrpc.SessionFromPeer). The package
// example runs a client against the example tensor service; package listener's
// examples show the server and TLS.
//
// A ClientConn to one address carries its calls over one connection; a
// client that keeps
// several large calls in flight to one server makes a Pool (NewPool), which
// sends each call over the least busy of several connections, each a session
// of its own, and which generated clients take in place of a ClientConn.
//
// A client process closes its ClientConns, then its Dialer (Close), before
// it exits: Close returns once the Dialer's sessions are closed, which
// ClientConn.Close does not wait for.
//
// It is thin: it owns no protocol logic (package transport does) and never
// touches UCX or device memory.
package dialer
