// Package dialer is the client face of gdrpc for gRPC: a dial function for
// grpc.WithContextDialer that makes a gdrpc session per connection, and the
// grpc.DialOptions a client needs.
//
// It is thin: it owns no protocol logic (package transport does) and never
// touches UCX or device memory.
package dialer
