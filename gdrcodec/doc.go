// Package gdrcodec is the gRPC codec that moves payloads out-of-band.
//
// A message field of type gdr.v1.DeviceBuffer, or a bytes field marked with the
// (gdr.v1.device_buffer) option, carries a payload that may be large and may live
// in GPU memory. With the "gdr" content-subtype (what dialer.DialOptions selects),
// Marshal puts each payload of at least the eager threshold into this process's
// outbox and writes only a descriptor into the protobuf body; the receiver's
// Unmarshal pulls the bytes through a gdrpc session to the owner (RDMA write,
// CUDA IPC, staged GPU copies, or a bulk stream) into memory it registered, before
// the message reaches the application. Shorter payloads travel inline.
// With the gdr codec, a DeviceBuffer reached through singular message fields is
// written after the message's own fields, as another occurrence of those
// fields, which protobuf's decoders merge into the message's own; the proto
// replacement writes a copy of the message with its payloads in place, as
// some decoders of other languages keep only the last occurrence of a field.
//
// Register also replaces the "proto" codec with one that behaves like gRPC's for
// every ordinary message and sends attached device buffers inline, so a plain
// gRPC client in any language still receives correct bytes.
//
// Attach a devicebuf.Buffer to an outgoing DeviceBuffer with Attach (or New);
// read a received one with Buffer, take it over with Detach, and give the memory
// back with ReleaseAll: the garbage collector never frees it, and a message
// collected with a buffer still attached is logged as a leak (WithLogger).
// Received payloads land where WithReceiveAllocator says (host memory unless
// told otherwise, a GPU with devicebuf.NewCUDAAllocator). One that arrived
// inline into host memory stays in the message's inline bytes, which the
// garbage collector frees with the message: Buffer hands out a view of them,
// released with the rest. On a server with
// ServerOptions, a request's buffers are released when the call ends and a
// response's once it was sent: a handler returns each call a message of its
// own (one sent twice, or on two calls at once, fails the call).
//
// Register is called once, at start-up, before any gRPC server or client of the
// process exists: it is the only code here that writes gRPC's codec registry.
// A server needs it (gRPC finds a server's codecs in its registry); a client
// made with dialer.DialOptions does not. listener.ServerOptions and
// dialer.DialOptions bring ServerOptions and DialOptions along.
//
// net/rpc works the same way: NewServerCodec over a conn a gdrpc listener
// accepted, NewClientCodec over one from a gdrpc dialer.
//
// The examples attach, receive and release buffers through a gRPC call, keep a
// received payload with Detach, and serve net/rpc.
//
// This package knows protobuf and gRPC; it never touches UCX or device memory
// itself (devicebuf copies, transport moves bytes).
package gdrcodec
