package rdma_test

import (
	"net"
	"testing"

	"golang.org/x/net/nettest"
)

// TestConn runs nettest.TestConn over endpoint pairs. Both ends live on one
// worker: with two workers of one process churning connections, UCX 1.16
// (as built for Ubuntu 24.04) can fail an assertion in its async event
// dispatch (async.c: handler->async == async) when a descriptor number is
// reused across the two workers' async contexts. Two-worker pairs are
// covered by the other tests.
func TestConn(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
			client, server, err := connect(testCtx(t), c.Worker(), c.Worker())
			if err != nil {
				return nil, nil, nil, err
			}
			return client, server, func() {
				client.Close()
				server.Close()
			}, nil
		})
	})
}
