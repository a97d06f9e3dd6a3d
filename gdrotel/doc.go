// Package gdrotel records gdrpc's transfers, sessions and buffer pools as
// OpenTelemetry metrics.
//
// The core of gdrpc imports no metrics library: it reports session and
// transfer events through one small interface, gdrpc.Metrics, which a
// Recorder implements. ObservePool adds the counters of a buffer pool, read
// when the metrics are collected.
//
// # Wiring
//
// Make one Recorder per process from the application's MeterProvider (nil
// takes the global one), give it to the listener and the dialer with
// gdrpc.WithMetrics, and observe the pools you want counted with ObservePool:
//
//	rec, err := gdrotel.New(provider)
//	if err != nil { ... }
//
//	// A Recorder is a gdrpc.Metrics: sessions and transfers of the
//	// listener's and the dialer's it is given to.
//	lis, err := listener.Listen(":50051", gdrpc.WithMetrics(rec))
//	d := dialer.New(gdrpc.WithMetrics(rec))
//
//	// The pool of registered host memory, where received payloads and
//	// staging buffers come from.
//	unregister, err := rec.ObservePool("host", gdrpc.HostMemory())
//	defer unregister()
//
// # What it records
//
// Transfers, on both sides of each out-of-band transfer:
//
//	gdrpc.transfer.io        By          bytes moved
//	gdrpc.transfers          {transfer}  finished transfers
//	gdrpc.transfer.duration  s           histogram, buckets from 10µs to 10s
//
// with the attributes route (oob.TransferInfo.Route: "rdma/cuda" is
// GPUDirect RDMA, "rdma" an RDMA transfer of host memory, "cuda-ipc",
// "staged", "stream"; a payload of this process decoded in this process is
// a plain copy, not a transfer, and is not recorded), path (the oob.Path), direction
// ("receive" on the side that pulled the bytes, "send" on the owner's), memory
// ("host" or "cuda", this side's buffer), advertised (true for a payload the
// owner wrote into receive space the receiver advertised, no rendezvous) and
// outcome ("ok" or "error"). An advertised transfer also carries queued
// (true when the owner's copy could still run as its message went, and the
// receiver waited for it or handed the buffer out Pending). A
// failed transfer also carries error.type, the kind of its
// oob.TransferError ("timeout", "not_found", "unavailable",
// "exhausted", "invalid", "canceled", "failed", or "_OTHER"), and counts
// nothing in gdrpc.transfer.io: its length is what the peer's descriptor
// claimed, not bytes that arrived.
//
//	gdrpc.transfer.fallbacks {fallback}  transfers that did not take a better path
//
// with wanted and took (paths) and reason.
//
// Sessions:
//
//	gdrpc.session.active     {session}   open now (an up-down counter)
//	gdrpc.session.opened     {session}
//	gdrpc.session.closed     {session}
//	gdrpc.session.fallbacks  {fallback}  sessions that stayed on TCP although UCX was offered
//
// with transport ("ucx" or "tcp") and side ("client" or "server"); closed
// also has outcome: "closed" (this side closed it, or closed its gRPC
// connection and the peer's end came first), "idle", "keepalive" (the
// peer stopped answering), "peer_gone" (the peer closed it or the connection
// broke) or "error"; fallbacks have reason only.
//
// Pools (ObservePool), with the attribute pool:
//
//	gdrpc.pool.region.count   {region}        regions held
//	gdrpc.pool.region.usage   By              bytes of regions held (registered memory)
//	gdrpc.pool.buffer.count   {buffer}        buffers handed out, not yet returned
//	gdrpc.pool.buffer.usage   By              their bytes
//	gdrpc.pool.registrations  {registration}  registrations made
//	gdrpc.pool.allocations    {allocation}    by result: hit, miss, exhausted
//	gdrpc.pool.waits          {wait}          allocations that waited for a region
//	gdrpc.pool.region.freed   {region}        regions freed while the pool was open
//
// A hit is an allocation served from a region already registered, a miss one
// that made (and registered) a new region: hits over hits plus misses is the
// registration cache's hit ratio. Counts and bytes held are up-down counters
// (they add up across pools); the others are monotonic counters.
//
// # Cardinality and cost
//
// Every attribute but pool (whose values are the names given to ObservePool)
// takes its values from a small set. Error text never
// becomes an attribute: a transfer's error is reduced to its kind, a session's
// cause to its class, and a fallback's reason to the text before its first
// colon (gdrpc's reasons read "register destination: <error>"), of which each
// counter keeps the first WithMaxReasons apart and records the rest as
// "_OTHER". Instruments are made once, by New; each attribute set is made on
// its first use and reused, so recording an event takes a map look-up under
// a read lock and the SDK's own work. The duration histogram's buckets are
// advice: a View in the MeterProvider can replace them.
//
// What this package must never do: block or fail the event it records (an
// error of the SDK stays in the SDK), keep a pool alive past unregister, or
// put unbounded values (errors, addresses, tokens) into attributes.
package gdrotel
