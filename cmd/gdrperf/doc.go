// Command gdrperf measures gdrpc's out-of-band throughput against the
// baselines a user would compare it with, all in the same run, like
// ucx_perftest or nccl-tests do for their libraries.
//
// For each payload size it runs a unary gRPC call whose payload moves
// out-of-band (op pull: the client calls Make and pulls the server's buffer;
// op push: the client calls Digest with its buffer attached and the server
// pulls it) and reports the median throughput, the path the bytes took
// (rdma, stream, cuda-ipc, staged; from the transport's metrics hook), and
// beside it, with ratios:
//
//   - plain gRPC over TCP with a bytes field (a second, ordinary gRPC server
//     in the server process: default proto codec, no gdrpc dialer, message
//     size limits raised);
//   - ucx_perftest ucp_put_bw, where the gdrpc session runs over UCX (as the
//     run's first call found it): it measures UCX's puts, in the environment
//     gdrpc sees (UCX_TLS and the like), so beside a session over TCP
//     (-transport tcp, or auto without -trust-peers) it is skipped with a
//     note saying so; skipped with a note too when ucx_perftest is not in
//     PATH, while a -perftest PATH that is not there is an error;
//   - with -mem cuda: an in-process device-to-device copy of the same size
//     (with -server-device naming another GPU than -device: a peer copy
//     between the two, in the direction the payload moves), and the naive
//     way (device to host, plain gRPC bytes, host to device);
//   - with -mem cuda -recv host (GPU payload, host destination: the staged
//     path where UCX cannot register GPU memory): an in-process device-to-host
//     copy, and the ratio to min(that copy, ucx_perftest).
//
// Payloads below the codec's eager threshold travel inline (path "inline"):
// 64 KiB, and over a TCP session (the default without -trust-peers) host
// payloads under 128 KiB (gdrcodec.StreamEagerThreshold). Such a row compares
// a unary call that carries its payload in the message, gdrpc's conn against
// plain gRPC over TCP, between two processes.
//
// Payloads are checked outside the time measured. With -op pull the calls
// ask for one of two payloads in turn (the server keeps both), so that bytes
// left over from the previous call, or another call's, are told from the
// ones asked for: the first call's whole payload is compared, the others'
// first, middle and last 4 KiB (copied to the host for a GPU payload). With
// -inflight 1 and -check every (the default) every call's payload is checked
// once its time was taken, and released after the check, the release timed
// with the call; with -inflight N, whose figure is the batch's wall time,
// each goroutine's last call is checked after the batch and the others are
// released unchecked. -check ends checks, one call at a time, only the
// verified first call and the last measured one, and releases the others
// unchecked (timed as well): reading a GPU payload back is a GPU operation
// of the client's, and on a GPU both processes share the server's next copy
// then waits for the GPU to switch back to its context. With -op
// push the server checksums the first request, and one more after the timed
// ones, whole (CRC-32C); the timed requests go unchecked, since the server's
// checksum would count in their time. The plain gRPC baseline (and the naive
// way) checks its first call. A payload that differs, gdrpc's or a
// baseline's, fails the run: the exit status is 1 and the message is
// printed; a baseline call that fails is only a note. The verified call
// comes first, alone, before the warm-up and outside the time measured,
// whatever -warmup is (the server's checksum, the comparison and noting the
// session are no measured call's); -warmup counts the unverified calls after
// it, which start once the receive space the verified call prompted (the
// server's for -op push with -request-space, the client's for -op pull) is
// there, so that they take the measured calls' path and pay its first use. gdrpc MiB/s is size / the median call time (with an even count of
// calls, the middle two times' mean); xfer is size / the median time of the
// out-of-band transfer alone as the transport's metrics hook timed it (the
// receiver's pull for -op pull, the owner's write for -op push). The ratios:
// x grpc is gdrpc MiB/s / grpc-tcp MiB/s; x perftest is gdrpc MiB/s /
// ucx_perftest MiB/s, the whole call against UCX's puts alone; xfer/perftest
// is xfer MiB/s / ucx_perftest MiB/s, the out-of-band transfer alone against
// them. In JSON a figure not measured is null.
//
// A payload the server wrote into the client's receive space
// while it marshaled the response (gdrpc.WithReceiveSpace, between trusted
// peers) has no pull: its path reads "<route>@space" and it has no xfer.
// With -op push into the server's request space, xfer is the client's own
// write into that space while it marshaled the request (a host copy or
// UCX's put, timed to its end); a GPU copy queued without waiting has none.
// -receive-space sets the client's space (0: none), to set the rendezvous
// against it in one run; -request-space sets the server's space for
// requests (none by default), which op push's payloads land in, and
// -request-space-limit gives the server spaces for requests that grow with
// the payloads (gdrpc.WithReceiveSpaceLimit). -stream-ordered takes GPU payloads that landed in
// the space before their copies end (gdrpc.WithStreamOrdered) and orders a
// stream of each calling goroutine after them; a goroutine's stream catches
// up inside the timing of its last call (of every call with -inflight 1).
// -hold N keeps each calling goroutine's last N received payloads, releasing
// the oldest as the next arrives, as a caller holding a window of tensors
// does: each holds its range of the space meanwhile (N+1 ranges per
// goroutine while the next arrives). A range's first write
// touches its pages for the first time, which a host may charge for; give
// -warmup more calls than N to measure the ranges written before.
//
// With -inflight N, N goroutines make the calls (the warm-up's too, after the
// verified first call), -iters each, and gdrpc, plain gRPC and the naive way
// report aggregate throughput: all the bytes over the wall time of the
// measured calls. That is what a service moving many payloads at once gets:
// one call's RPC and rendezvous overlap the others' copies. The in-process
// copies stay one after another (the device's bandwidth). -conns spreads the
// calls over that many client connections, each a session of its own: a
// dialer.Pool, which sends each call over the connection with the fewest in
// flight; the baselines' calls go over as many plain gRPC connections, each
// goroutine keeping to one. -inflight takes a list too (1,4,8): each size then gets
// a row per value, in one run, so that the single call stands beside the
// aggregate rows and the count of calls that fills the device shows. The
// call µs column is one call's time: the median call with one in flight, and
// with N in flight the mean call under load (N × size / rate), which is what
// bounds the aggregate where the device is not busy all the while.
// call/(rpc+copy) sets it against a plain 1 KiB unary call made with as many
// in flight (rpc 1KiB µs, timed the same way in each row, after the row's
// gdrpc calls) plus one in-process copy of
// the payload: with N in flight, how far a call under load is from what
// gRPC alone takes under that load.
//
// The table's first line names the run's settings, among them the GOMAXPROCS
// of both processes and the CPUs each may run on (cpus=, as taskset sets
// them): on a host whose idle cores are slow to wake, a call takes markedly
// less time with few Ps, or with both processes on a few cores (README,
// Performance).
//
// Same host (the default): the tool re-executes itself as the server, so the
// client and the server are separate processes; a server process that ends
// by a signal or with an error, or before the run did, fails the run.
// Across hosts: run "gdrperf -server HOST:PORT" on one, PORT given (plain
// gRPC then listens on PORT+1 and ucx_perftest on PORT+2, where -connect
// looks for them) and "gdrperf -connect HOST:PORT" on the other, with the
// same -transport, -mem, -paths and -trust-peers on both; -server-cpuprofile
// and -server-trace are for the re-executed server only (give -cpuprofile or
// -trace to gdrperf -server).
//
// Usage:
//
//	gdrperf [-sizes 1MiB,16MiB,64MiB] [-iters 10] [-warmup 10] [-inflight 1|1,4,8] [-conns 1] [-op pull|push]
//	        [-transport auto|ucx|tcp] [-mem host|cuda] [-recv host|cuda] [-device 0] [-server-device N]
//	        [-paths all|cuda-ipc,rdma,stream] [-format table|json] [-server ADDR | -connect ADDR]
//	        [-perftest PATH|none] [-call-timeout 1m] [-busy N] [-receive-space SIZE|0] [-request-space SIZE]
//	        [-request-space-limit SIZE] [-connects N] [-runs N] [-trust-peers] [-eager SIZE]
//	        [-stream-ordered] [-hold N]
//	        [-baselines=false] [-cpuprofile F] [-server-cpuprofile F] [-trace F] [-server-trace F] [-v]
//
// -busy N runs N CPU-bound processes beside client and server for the whole
// run (with -server or -connect, beside that end), each spinning one core:
// small calls under contention, as in a service that shares its cores with
// other work.
//
// -sizes takes each size once (1MiB and 1024KiB are one): a size names a row.
//
// -connects N then times N new connections each way, alternating: a new
// ClientConn up to the response of its first call (a 1 KiB Make), gdrpc's
// with its session's handshake, move to UCX and lanes, against plain gRPC's
// over TCP; a line under the table (medians and p90), or a JSON object
// after the rows.
//
// -runs N measures everything N times, each run with a server process of
// its own (unless -connect names one) and new connections, and prints each
// run's table, then one of the medians over the runs, a row per size and
// count in flight: gdrpc MiB/s and the 1 KiB RPC as medians, the call's
// time, xfer, ucx_perftest MiB/s and the ratios (xfer/perftest among them)
// with their ranges. With -format json a run's
// rows carry "run", and objects {"summary": {...}} follow them. Where a
// process's threads land changes its figures from one run to the next
// (README, Performance): compare the medians of several runs. Cut short (a
// signal, a timeout around the tool), it still prints the medians over the
// runs that ended, where two did; a run that measured nothing (no server, no
// connection) ends the series. An interrupted run prints the rows it
// measured before the signal.
//
// The exit status is 1 when gdrpc could not be measured for some size (the
// notes say why), when a payload differed from the one sent, or when the
// server process of a same-host run failed; a missing baseline is only a
// note.
//
// What it owns: the benchmark's processes, its baseline service and the
// report. What it must never do: change the library's behaviour to look
// faster (it uses only the public API a user has), or hang: every call,
// child process and spawned ucx_perftest is bounded by a timeout, and a
// ucx_perftest process dies with the process that started it (on Linux, a
// parent-death signal).
package main
