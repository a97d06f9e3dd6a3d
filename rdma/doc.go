// Package rdma is the binding to UCX (libucp): contexts, workers and their
// progress engine, listeners, endpoints carrying a byte stream (an Endpoint is a
// net.Conn), registered memory, packed remote keys, and one-sided put/get/flush.
//
// It owns every call into UCX and is the only package of gdrpc that imports "C"
// for UCX. Above it everything is plain Go.
//
// # Loading and defaults
//
// libucp.so.0 is opened at run time (dlopen): a process without UCX gets
// ErrNotSupported carrying the loader's message from Available, not a failure
// to start. The build needs no UCX headers either: ucxabi.h declares the part of
// the UCX ABI the package calls (TestUCXABI checks it against the real headers).
// A build without cgo, or with the build tag nordma, compiles the same API and
// every call reports ErrNotSupported.
//
// Unless the environment sets them, a context sets UCX_ERROR_SIGNALS to empty
// (for the dlopen: UCX's signal handlers would hide Go's crash reports), and
// through ucp_config_modify MAX_RNDV_RAILS=1 and PROTO_ENABLE=n (see
// Workers); RCACHE_ENABLE=n and, where the host has InfiniBand devices,
// IB_RCACHE=n (a key packed from a Map then reaches that range only, and only
// until Close: UCX's registration caches would hand out a covering
// registration and keep it); and, where UCX_TLS may select the posix/sysv
// shared-memory transports, MM_ERROR_HANDLING=y (peer error handling would
// otherwise drop them). UCX's descriptors are marked close-on-exec after each
// call that opens them (Dial, Listen and Accept return once they are) and,
// for those UCX opens lazily, whenever a worker goes idle; the marking scans
// every descriptor of the process, so it runs on a goroutine of its own,
// never under a worker's lock, requests made during a scan share the next
// one, and scanning takes at most a fifth of a processor.
//
// # Workers
//
// A Worker runs in UCS_THREAD_MODE_SERIALIZED behind a mutex: whichever
// goroutine holds it makes the UCX calls. A goroutine that writes, puts or
// flushes runs the operation itself when the lock is free, and otherwise
// leaves it in a queue that the holder serves before releasing the lock;
// completions come back on channels. UCX callbacks carry integer ids or C
// pointers, never Go pointers. A driver goroutine per worker keeps progress
// going: it polls, yielding to other goroutines, for 1 ms after the last work
// (its own or another goroutine's; WithPollTime or GDRPC_RDMA_POLL changes
// it), keeps polling while requests are in flight, and otherwise arms the
// worker and sleeps on its event fd in Go's poller, as a network read does
// (its P then runs whatever else is ready at once), so an idle worker burns
// no CPU. A driver that finds its polling keeps its peer from running (both
// on one core: the work comes only after it parks) yields the core to the
// kernel between polling rounds from then on, and tries polling without
// yielding now and then (see spinPolicy). A reply
// that comes while the driver polls is handed to its reader on the driver's
// P, without waking a thread: after a round that handled events the driver
// yields, so the goroutine it readied runs at once; replies to RPCs and rendezvous messages
// typically come within a few hundred microseconds. Nor does the driver sleep
// on the lock while a writer holds it for its own send: it yields its P and
// tries again for a while first, so that the writer's unlock wakes no thread.
// A put or get between host memories larger than 4 MiB goes in pieces, and
// the worker serves its other endpoints between two of them: over shared
// memory a put is a copy made inside the UCX call, with the lock held. Work done outside the
// driver wakes a sleeping driver, to catch the reply that often follows a
// send. Hand-offs between OS threads cost tens of microseconds each on small
// virtual machines; this keeps them off the path of a write and a reply.
//
// When both ends of every connection of a worker are on that worker (client
// and server in one process, on one context), a sender's own progress call
// hands its bytes to the reader, and a polling driver would only take a
// processor from the goroutines doing the work. The driver then rests instead:
// it neither polls nor arms the worker (so a send raises no event), looks
// around every millisecond for what only it would see (connection requests,
// failures UCX's async thread detects), and sleeps on the event fd after
// 100 ms without work, whatever the poll time. It wakes as soon as a request
// is in flight or an endpoint to another worker appears.
//
// Every progress call polls every transport interface a lane uses; a tcp
// interface costs a system call each time. Contexts therefore default to one
// rma_bw lane: this package never uses rendezvous and a put takes one lane,
// and a second lane on another network device doubled the cost of every
// progress call and of every poll round. UCX_MAX_RNDV_RAILS=1 limits it under
// UCX's first protocol selection, the default of UCX 1.13; the newer one
// (the default of 1.16) adds the lane whatever the rail settings, so contexts
// ask for the first (UCX_PROTO_ENABLE=n).
//
// # Endpoints
//
// The byte stream uses UCX's stream API. Received data is taken from UCX when
// it arrives (ucp_stream_recv_data_nb) into a per-endpoint buffer, or straight
// into a waiting Read's buffer, so no receive is ever posted and a Read
// deadline strands nothing. Close flushes, sends a FIN (an active message) and
// waits (at most 2 s) for the peer's FIN-ACK before the force close: the peer
// reads everything that was written, then io.EOF. Only the peer's first FIN is
// answered: a peer closes once, and what it sends after its FIN is dropped. A
// failed peer ends every
// pending and later operation with an *EndpointError.
//
// # Direct copies
//
// With peer error handling, UCX gives a connection between two processes of
// one host a tcp lane for puts and gets (UCX 1.13, 1.16 and 1.18 alike): its
// shared-memory transports carry messages but no RMA. Memory a peer allocated
// with Context.Alloc lies in a shared-memory segment, though, and UCX
// attaches that segment in this process when it unpacks the peer's key
// (ucp_rkey_ptr gives the address). Puts and gets with such a key are then
// copies this process makes itself, off the worker, in pieces between which
// they stop when the context ends or the endpoint fails: at memory speed,
// complete when Put returns (Flush has nothing to wait for), and holding no
// worker lock. UCX computes the address from where it attached the segment
// and the address the peer names, without a bound, so a key is used so only
// where its whole region lies inside one shared, writable mapping that its
// unpack made (/proc/self/maps read before and after it, with the worker's
// lock held): a region that lies elsewhere would otherwise name other memory
// of this process, its own shared memory included. A peer that shrinks the
// file behind a posix segment makes the pages past its end fault: the copy,
// which runs with the runtime's panic-on-fault set, fails with an error
// instead of the process (where the user had UCX handle SIGBUS or SIGSEGV,
// UCX_ERROR_SIGNALS, there are no direct copies). Closing a key waits for the
// copies under way, which complete, as UCX's puts do. WithDirectCopies(false),
// or GDRPC_RDMA_DIRECT=false, keeps every put and get a UCX operation.
//
// # Known UCX limitations
//
//   - Keys bound nothing against a peer that drives UCX itself. UCX's tcp
//     transport has no keys and copies a put to whatever address it names,
//     and a context with RMA (every context of this package) serves emulated
//     puts and gets, as active messages over any transport, at any address a
//     peer names with a key that matches none of its lanes' memory domains.
//     A UCX endpoint gives its peer this process's memory; only the puts of
//     a peer that plays by the rules are bounded by keys (by the NIC on
//     verbs).
//   - UCX 1.13 to 1.18 crash (SIGSEGV in ucp_rkey_destroy on the error path
//     of ucp_ep_rkey_unpack) when a shared-memory transport fails to unpack
//     its part of a remote key: a sysv segment already removed, a posix
//     segment whose owner exited. UnpackKey checks our framing, the structure
//     of UCX's buffer, and, for the posix and sysv domains a lane reaches,
//     that the segment opens now and (posix) is a UCX segment, not any file
//     its owner holds; a segment that goes between that check and UCX's
//     attach still takes the process down. Unpack a key only while its owner
//     keeps the memory registered, and only from peers you trust: the key
//     names segments this process attaches.
//   - UCX 1.16 (Ubuntu 24.04 build) can fail an assertion in its async event
//     dispatch when two workers of one process churn connections and a
//     descriptor number moves from one worker to the other. One worker per
//     process (the Default context) does not meet it.
//
// What this package must never do: hand a Go pointer to UCX past the call that
// uses it (bytes are copied into C memory or pinned for exactly one operation),
// register Go heap memory for longer than one operation, touch memory of type
// MemoryCUDA from the CPU, or hand CUDA memory to a UCX that cannot register it.
// It knows nothing about peers, sessions or protocols: that is the transport's
// job.
package rdma
