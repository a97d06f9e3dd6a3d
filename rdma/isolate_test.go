//go:build cgo && !nordma

package rdma_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// TestClientDeathIsolated: a client process killed while it streams to a
// listener over shared memory blocks, in about a third of the kills, the
// shared-memory receive queue of the worker its endpoint is on
// (TestPeerDeathMidSendMMOff). The listener keeps each other process's
// client on a worker of its own, so after every kill the listener's worker
// still receives (a client of this process echoes through it), and the dead
// client's worker closes once its endpoint is released.
func TestClientDeathIsolated(t *testing.T) {
	c := newContext(t, "posix,sysv,cma,tcp")
	l, err := c.Worker().Listen("127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	l.IsolateClients()
	workers := rdma.Stats().Workers
	for i := range 15 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"=streamer", "GDRPC_RDMA_TEST_TLS=posix,sysv,cma,tcp", "GDRPC_RDMA_TEST_ADDR="+l.Addr().String())
			cmd.Stderr = os.Stderr
			require.NoError(t, cmd.Start())
			t.Cleanup(func() {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
			})
			ep, err := l.Accept(testCtx(t))
			require.NoError(t, err)
			require.False(t, ep.OnWorker(c.Worker()), "another process's client on the listener's worker")
			killMidStream(t, ep, cmd)
			require.NoError(t, ep.Close())

			// A client of this process: on the listener's worker.
			requireEchoVia(t, c, l)
		})
	}
	requireWorkers(t, workers, "dead clients' workers left")
}

// requireEchoVia dials l from c's worker and echoes through the pair: both
// ends are on c's worker when l is.
func requireEchoVia(t *testing.T, c *rdma.Context, l *rdma.Listener) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), deathBound)
	defer cancel()
	accepted := make(chan *rdma.Endpoint, 1)
	go func() {
		s, _ := l.Accept(ctx)
		accepted <- s
	}()
	cl, err := c.Worker().Dial(ctx, l.Addr().String())
	require.NoError(t, err)
	defer cl.Close()
	s := <-accepted
	require.NotNil(t, s)
	defer s.Close()
	require.True(t, s.OnWorker(c.Worker()), "a client of this process off the listener's worker")
	requireEcho(t, cl, s)
}

// TestServerDeathIsolated: a listener's process killed while it streams to
// this one over shared memory (TestPeerDeathMidSendMMOff) blocks the worker
// its peer endpoint is on. DialApart keeps the endpoint on a worker of its
// own, so after every kill the context's worker still receives, and the
// dead listener's worker closes once the endpoint is released.
func TestServerDeathIsolated(t *testing.T) {
	c := newContext(t, "posix,sysv,cma,tcp")
	l, err := c.Worker().Listen("127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	workers := rdma.Stats().Workers
	dialApart := func(c *rdma.Context, ctx context.Context, addr string) (*rdma.Endpoint, error) {
		return c.DialApart(ctx, addr)
	}
	for i := range 15 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			ch := startChildOn(t, "posix,sysv,cma,tcp", c, dialApart)
			require.False(t, ch.ep.OnWorker(c.Worker()), "an endpoint of DialApart on the context's worker")
			ch.command(t, cmdStream, uint64(8+rand.IntN(8000)), 1)
			killMidStream(t, ch.ep, ch.cmd)
			require.NoError(t, ch.key.Close())
			require.NoError(t, ch.ep.Close())
			requireEchoVia(t, c, l)
		})
	}
	requireWorkers(t, workers, "dead listeners' workers left")
}

// requireWorkers waits (bounded) until the process has n workers besides
// the default ones.
func requireWorkers(t *testing.T, n int64, msg string) {
	t.Helper()
	deadline := time.Now().Add(deathBound)
	for rdma.Stats().Workers != n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // polling an observable, bounded
	}
	require.Equal(t, n, rdma.Stats().Workers, msg)
}

// TestIsolatedWorkersBounded: an isolating listener keeps at most maxApart
// client workers apart; the endpoints of later clients go on its own
// worker, and carry bytes there, and the workers kept apart go with their
// endpoints.
func TestIsolatedWorkersBounded(t *testing.T) {
	c := newContext(t, "tcp")
	l, err := c.Worker().Listen("127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	l.IsolateClients()
	l.SetMaxApart(2)
	var clients []*rdma.Context
	for range 4 {
		clients = append(clients, newContext(t, "tcp")) // another worker id each: another client
	}
	workers := rdma.Stats().Workers
	var eps []*rdma.Endpoint
	var apart, shared int
	for _, client := range clients {
		ctx := testCtx(t)
		accepted := make(chan *rdma.Endpoint, 1)
		go func() {
			s, _ := l.Accept(ctx)
			accepted <- s
		}()
		cl, err := client.DialApart(ctx, l.Addr().String())
		require.NoError(t, err)
		eps = append(eps, cl)
		s := <-accepted
		require.NotNil(t, s)
		eps = append(eps, s)
		if s.OnWorker(c.Worker()) {
			shared++
		} else {
			apart++
		}
		requireEcho(t, cl, s)
	}
	require.Equal(t, 2, apart, "clients kept apart, up to the bound")
	require.Equal(t, 2, shared, "the others on the listener's worker")
	for _, ep := range eps {
		require.NoError(t, ep.Close())
	}
	requireWorkers(t, workers, "workers kept apart left")
}
