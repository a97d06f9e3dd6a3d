// Command gdrtrace breaks a call's time down from execution traces, such as
// those gdrperf writes with -trace and -server-trace: how long the calling
// goroutine ran, waited (and for what) or sat runnable; how many times a
// goroutine was made runnable by another while the call ran (the hand-offs
// a call costs), in either process; how many idle Ps were given a thread
// meanwhile (threads woken: on a virtual machine each may cost the wake-up
// of an idle core) and which goroutines yielded; the calls into C (UCX,
// the CUDA driver) and syscalls made meanwhile; the other regions begun
// meanwhile, gdrpc's own steps among them (gdrpc.marshal, gdrpc.unmarshal,
// gdrpc.ipc-copy-queue: a GPU copy's queueing, gdrpc.rtr and gdrpc.wait-fin:
// a rendezvous); and a call's timeline across both processes: when each
// kind of hand-off, call into C and region happens in a call, and when the
// goroutine it readied got to run, the call returned or the region ended
// (medians from the call's start), which shows where a call waits for a
// thread rather than for work. The timeline assumes one call at a time
// (gdrperf's -inflight 1): the events of calls in flight together mix.
//
//	gdrperf -mem cuda -trust-peers -sizes 64MiB -iters 50 -warmup 10 -perftest none -baselines=false -trace c.trace -server-trace s.trace
//	gdrtrace -skip 10 c.trace s.trace
//
// Calls are the regions named by -region in the first trace (gdrperf marks
// each of gdrpc's calls "gdrperf.call", and each of plain gRPC's
// "gdrperf.grpc": -region gdrperf.grpc breaks down the baseline's calls of
// the same run). The second trace's events are placed
// in the first one's calls by time, which holds for traces taken on one host
// at the same time. Tracing slows the calls it watches: use it for where the
// time goes, and gdrperf without tracing for how long calls take.
package main
