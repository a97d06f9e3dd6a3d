package rdma_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/rdma"
)

func TestEndpointCloseTwiceAndUseAfterClose(t *testing.T) {
	c := newContext(t, "tcp")
	client, server := pair(t, c)
	ctx := testCtx(t)
	dst, packed, rk := exposed(t, c, client, 4096)
	require.Equal(t, int64(1), rdma.Stats().RemoteKeys)

	require.NoError(t, client.Close())
	require.NoError(t, client.Close())
	<-client.Done()
	requireClosedErr(t, client.Err())

	_, err := client.Read(make([]byte, 1))
	requireClosedErr(t, err)
	_, err = client.Write([]byte("x"))
	requireClosedErr(t, err)
	requireClosedErr(t, client.SetDeadline(time.Now()))
	requireClosedErr(t, client.SetReadDeadline(time.Now()))
	requireClosedErr(t, client.SetWriteDeadline(time.Now()))
	requireClosedErr(t, client.PutBytes(ctx, []byte("x"), uint64(dst.Addr()), rk))
	requireClosedErr(t, client.Flush(ctx))
	_, err = client.UnpackKey(packed)
	requireClosedErr(t, err)
	// closing the endpoint released its keys; Close on the key is still fine
	require.Zero(t, rdma.Stats().RemoteKeys)
	require.NoError(t, rk.Close())
	require.NoError(t, rk.Close())

	// the peer sees the close as EOF
	_, err = server.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
}

func TestCloseWakesBlockedCalls(t *testing.T) {
	c := newContext(t, "tcp")
	client, _ := pair(t, c)
	errc := make(chan error, 2)
	go func() {
		_, err := client.Read(make([]byte, 10))
		errc <- err
	}()
	go func() {
		// 8 MiB pinned writes: the peer does not read, so eventually one blocks
		var err error
		buf := make([]byte, 8<<20)
		for err == nil {
			_, err = client.Write(buf)
		}
		errc <- err
	}()
	// Both blocked: each parked in its call, waiting for the endpoint.
	blocked := func(call string) bool {
		for _, g := range leaktest.Goroutines(call) {
			if strings.Contains(g, "[select") {
				return true
			}
		}
		return false
	}
	require.Eventually(t, func() bool {
		return blocked("rdma.(*Endpoint).Read(") && blocked("rdma.(*Endpoint).Write(")
	}, 10*time.Second, time.Millisecond, "Read and Write never blocked")
	require.NoError(t, client.Close())
	for range 2 {
		select {
		case err := <-errc:
			requireClosedErr(t, err)
		case <-time.After(10 * time.Second):
			t.Fatal("Close did not wake a blocked call")
		}
	}
}

func TestMemoryCloseTwice(t *testing.T) {
	c := newContext(t, "tcp")
	m, err := c.Alloc(100)
	require.NoError(t, err)
	require.Len(t, m.Bytes(), 100)
	require.Equal(t, rdma.MemoryHost, m.Type())
	require.Equal(t, 100, m.Len())
	require.NoError(t, m.Close())
	require.NoError(t, m.Close())
	_, err = m.PackKey()
	requireClosedErr(t, err)
	_, err = c.Alloc(0)
	require.Error(t, err)
	_, err = c.Map(0, 10, rdma.MemoryHost)
	require.Error(t, err)
}

func TestListenerCloseAndReject(t *testing.T) {
	c := newContext(t, "tcp")
	w2, err := c.NewWorker()
	require.NoError(t, err)
	defer w2.Close()
	l, err := w2.Listen("127.0.0.1:0")
	require.NoError(t, err)
	require.NotZero(t, l.Addr().(*rdma.Addr).Port)
	require.Equal(t, "ucx", l.Addr().Network())

	seen := make(chan net.Addr, 1)
	l.SetFilter(func(remote net.Addr) bool {
		select {
		case seen <- remote:
		default:
		}
		return false
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = c.Worker().Dial(ctx, l.Addr().String())
	require.ErrorIs(t, err, rdma.ErrRejected, "the filter's refusal, not the dial's deadline")
	select {
	case remote := <-seen:
		require.NotNil(t, remote)
	default:
		t.Fatal("the filter saw no connection request")
	}
	l.SetFilter(nil)

	accErr := make(chan error, 1)
	go func() {
		_, err := l.Accept(context.Background())
		accErr <- err
	}()
	require.NoError(t, l.Close())
	require.NoError(t, l.Close())
	select {
	case err := <-accErr:
		requireClosedErr(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not wake Accept")
	}
	_, err = l.Accept(ctx)
	requireClosedErr(t, err)
	require.Zero(t, rdma.Stats().Listeners)
}

func TestDialNobodyListening(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		// a port that was just free
		w2, err := c.NewWorker()
		require.NoError(t, err)
		l, err := w2.Listen("127.0.0.1:0")
		require.NoError(t, err)
		addr := l.Addr().String()
		require.NoError(t, l.Close())
		require.NoError(t, w2.Close())

		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		start := time.Now()
		_, err = c.Worker().Dial(ctx, addr)
		require.Error(t, err)
		require.False(t, errors.Is(err, context.DeadlineExceeded), "dial waited for the context: %v", err)
		require.Less(t, time.Since(start), promptBound)
		require.Zero(t, rdma.Stats().Endpoints)
	})
}

func TestDialContextBounds(t *testing.T) {
	c := newContext(t, "tcp")
	// 192.0.2.0/24 is TEST-NET: nothing answers (or the route fails at once)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Worker().Dial(ctx, "192.0.2.123:9")
	require.Error(t, err)
	require.Less(t, time.Since(start), promptBound)
	require.Zero(t, rdma.Stats().Endpoints)
}

func TestWorkerAndContextClose(t *testing.T) {
	requireUCX(t)
	c, err := rdma.NewContext(rdma.WithTransports("tcp"))
	require.NoError(t, err)
	w2, err := c.NewWorker()
	require.NoError(t, err)
	client, server, err := connect(testCtx(t), c.Worker(), w2)
	require.NoError(t, err)
	l, err := w2.Listen("127.0.0.1:0")
	require.NoError(t, err)
	m, err := c.Alloc(1 << 16)
	require.NoError(t, err)
	require.Equal(t, rdma.Counters{Contexts: 1, Workers: 2, Endpoints: 2, Listeners: 1, Memories: 1}, rdma.Stats())

	// closing the server's worker fails its endpoint locally and the client's
	// from the peer side
	require.NoError(t, w2.Close())
	require.NoError(t, w2.Close())
	<-server.Done()
	requireClosedErr(t, server.Err())
	select {
	case <-client.Done():
		require.Error(t, client.Err())
	case <-time.After(15 * time.Second):
		t.Fatal("client did not notice the peer worker closing")
	}
	_, err = w2.Listen("127.0.0.1:0")
	requireClosedErr(t, err)
	_, err = w2.Dial(testCtx(t), l.Addr().String())
	requireClosedErr(t, err)
	requireClosedErr(t, w2.Flush(testCtx(t)))
	_, err = l.Accept(testCtx(t))
	requireClosedErr(t, err)

	require.NoError(t, c.Close())
	require.NoError(t, c.Close())
	require.NoError(t, client.Close())
	require.NoError(t, server.Close())
	require.NoError(t, m.Close())
	_, err = c.Alloc(10)
	requireClosedErr(t, err)
	_, err = c.NewWorker()
	requireClosedErr(t, err)
	require.True(t, rdma.Stats().Zero(), "%+v", rdma.Stats())
}

func TestDefaultContext(t *testing.T) {
	requireUCX(t)
	d, err := rdma.Default()
	require.NoError(t, err)
	d2, err := rdma.Default()
	require.NoError(t, err)
	require.Same(t, d, d2)
	require.NoError(t, d.Close()) // does nothing
	require.NoError(t, d.Worker().Close())
	require.NotEmpty(t, d.Info().Version)
	// still usable
	w2, err := d.NewWorker()
	require.NoError(t, err)
	defer w2.Close()
	client, server, err := connect(testCtx(t), d.Worker(), w2)
	require.NoError(t, err)
	defer client.Close()
	defer server.Close()
	_, err = client.Write([]byte("default"))
	require.NoError(t, err)
	buf := make([]byte, 7)
	_, err = server.Read(buf)
	require.NoError(t, err)
}

// promptBound is how long a failing Dial may take: well under the contexts
// the tests give it, with room for a loaded CI machine.
const promptBound = 12 * time.Second

// No IPv6 address reaches UCX (ErrIPv6): listening or dialing on one fails
// before UCX is called; a name is taken by its IPv4 address.
func TestIPv6Refused(t *testing.T) {
	c := newContext(t, "tcp")
	for _, addr := range []string{"[::1]:0", "[::]:0", "[fe80::1%lo]:0"} {
		_, err := c.Worker().Listen(addr)
		require.ErrorIs(t, err, rdma.ErrIPv6, addr)
		_, err = c.Worker().Dial(testCtx(t), strings.Replace(addr, ":0", ":1", 1))
		require.ErrorIs(t, err, rdma.ErrIPv6, addr)
	}
	l, err := c.Worker().Listen("localhost:0")
	require.NoError(t, err)
	require.True(t, l.Addr().(*rdma.Addr).IP.To4() != nil, "listening on %v", l.Addr())
	require.NoError(t, l.Close())
}
