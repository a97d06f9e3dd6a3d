// Package transport owns everything that knows about a peer: the session (one
// per underlying connection), its handshake and capability negotiation, the
// multiplexing of the session's byte stream (yamux: one gRPC stream, one
// control stream, bulk streams; the gRPC and control streams and the bulk
// frames run on connections of their own, lanes, when both ends allow it;
// transfers in flight together share the bulk lane in pieces, and a UCX
// session between hosts over UCX's tcp alone moves large ones on a wide lane
// over TCP), the net.Conn and
// net.Listener gRPC runs on,
// keepalive and dead-peer detection, the process-wide registry of live
// sessions by peer process id, gRPC transport credentials that expose the
// session to handlers. The out-of-band transfer engine (package oob) plugs
// into sessions through Engine (WithEngine).
//
// Every session starts on a plain TCP connection. The client sends a
// versioned handshake (process id, its ed25519 public key, a nonce, host id,
// capabilities, requested mode); the server answers with its own, signed over
// both messages, and, when both have UCX and the mode allows, the port of its
// UCX listener and a session token; the client proves its id with a signature
// over both. A process id is derived from its key, so no peer can claim
// another's. The client then dials UCX,
// proves the session with the token, and the session runs over the UCX
// endpoint; otherwise it runs over the TCP connection. A listener also accepts
// plain HTTP/2 (and TLS) clients on the same port and hands their raw
// connections to gRPC unchanged.
//
// The mode is ModeAuto by default, or set by WithMode or the environment
// variable GDRPC_TRANSPORT=ucx|tcp (ucx only where WithTrustPeers says the
// peers are trusted). ModeAuto moves onto UCX only when
// WithTrustPeers says the peers are trusted: a UCX connection lets
// its peer write anywhere in this process. The chosen transport shows in
// Session.Transport, in the network of the conns' addresses ("gdrpc+ucx",
// "gdrpc+tcp") and in debug logs; a handler finds its session from the peer
// address (SessionFromContext, SessionFromPeer), while the AuthInfo it sees is
// the inner credentials' own.
//
// What this package must never do: call UCX other than through package rdma,
// touch device memory (package devicebuf owns it), or keep a session alive past its peer: every wait is
// bounded by a context, a deadline or the session's life, and a peer that
// stops answering keepalives is dropped.
package transport
