// Package oob is gdrpc's out-of-band transfer engine: it moves the payloads
// that gRPC messages name by descriptor, outside the gRPC stream.
//
// An owner offers a payload (Offer) and gets a Descriptor: this process's id,
// a random token, the length and the memory's kind; the descriptor travels in
// the message. A receiver that decodes it pulls the payload (Fetch, FetchNew)
// through any live session to the owner: it sends a ready-to-receive message
// (RTR) naming the paths it accepts and where each may write, the owner
// writes the bytes (an RDMA put into the receiver's registered memory, a CUDA
// IPC copy, host staging for GPU memory, or the session's bulk stream) and
// answers with a FIN that says how it went. Tokens are capabilities: one
// payload, one length, until the owner withdraws it or its lease ends.
//
// The engine plugs into sessions through transport.Engine: sessions made with
// transport.WithEngine(oob.New(cfg)), or oob.Engine() for the process's
// configuration, carry its control messages and bulk frames (packages
// dialer and listener make one per Dialer and Listener). Sessions hold their
// share of its bounds (Limits); a session's trust (transport.WithTrustPeers)
// decides which paths its peer may use.
//
// Every peer is untrusted unless its session says otherwise: a receiver
// registers each destination for its transfer alone, clears it before a path
// whose arrival cannot be counted, and accepts a FIN only for a path it
// offered; an owner writes exactly the payload's length, only where the
// receiver's side applies the write (UCX over TCP, verbs) unless the peer is
// trusted, and never past its own buffer. Each wait is bounded by a context,
// the transfer timeout or the session's life.
package oob
