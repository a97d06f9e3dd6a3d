// Package interop holds the tests that prove gdrpc is still gRPC: the gRPC
// interop test cases shipped with gRPC-Go run over every gdrpc transport (UCX
// shared memory, UCX tcp, the TCP fallback) with and without TLS; plain gRPC
// peers (a standard gRPC-Go client, a Python grpcio client) call a gdrpc
// server; a server and clients in two network namespaces talk over UCX tcp
// and the TCP fallback; peers are killed mid-stream and owners of
// out-of-band payloads are killed or stall before FIN; a retry policy replays
// an out-of-band request; clients reconnect after a server restart and across
// connection rotation (GOAWAY).
//
// It contains tests only. It must never be imported, and never reaches into
// the internals of other packages: everything it does goes through their
// public API, as a user's program would. Child processes are the test binary
// re-executed in a role (see runChild).
package interop
