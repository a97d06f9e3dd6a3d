package rdma_test

import (
	"net"
	"testing"

	"golang.org/x/net/nettest"
)

func TestConn(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		w2, err := c.NewWorker()
		if err != nil {
			t.Fatal(err)
		}
		defer w2.Close()
		nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
			client, server, err := connect(testCtx(t), c.Worker(), w2)
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
