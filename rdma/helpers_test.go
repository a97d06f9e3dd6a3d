package rdma_test

import (
	"context"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// transports the tests run over, as UCX_TLS values. Client-server connection
// setup needs the tcp connection manager, so shm keeps tcp in the list; the
// stream and shm-allocated memory then go over sysv/posix (checked below).
var transports = []struct {
	name string
	tls  string
	lane string // a transport the endpoint's lanes must show
}{
	{"shm", "posix,sysv,cma,tcp", "sysv/memory"},
	{"tcp", "tcp", "tcp/lo"},
}

func forEachTransport(t *testing.T, f func(t *testing.T, tls string)) {
	for _, tr := range transports {
		t.Run("transport="+tr.name, func(t *testing.T) { f(t, tr.tls) })
	}
}

func newContext(t testing.TB, tls string) *rdma.Context {
	t.Helper()
	requireUCX(t)
	c, err := rdma.NewContext(rdma.WithTransports(tls))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

// defaultContext is a UCX context on the transports UCX picks itself,
// closed at the test's end.
func defaultContext(t testing.TB) *rdma.Context {
	t.Helper()
	requireUCX(t)
	c, err := rdma.NewContext()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// pair connects the default worker of c (client) to a listener on a second
// worker of c (server): two workers in one process.
func pair(t testing.TB, c *rdma.Context) (client, server *rdma.Endpoint) {
	t.Helper()
	return pairOn(t, c.Worker(), newWorker(t, c))
}

// pairOn connects worker cw (client) to a listener on worker sw (server); the
// test's end closes both endpoints.
func pairOn(t testing.TB, cw, sw *rdma.Worker) (client, server *rdma.Endpoint) {
	t.Helper()
	client, server, err := connect(testCtx(t), cw, sw)
	require.NoError(t, err)
	t.Cleanup(func() {
		client.Close()
		server.Close()
	})
	return client, server
}

func newWorker(t testing.TB, c *rdma.Context) *rdma.Worker {
	t.Helper()
	w, err := c.NewWorker()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	return w
}

// samePair connects worker w to a listener on w itself: both ends on one
// worker, whose driver then rests (the sender hands the bytes over).
func samePair(t testing.TB, w *rdma.Worker) (client, server *rdma.Endpoint) {
	t.Helper()
	return pairOn(t, w, w)
}

// pairings: the ends on two workers of one process (the client on the
// context's default worker), and both on the default worker.
var pairings = []struct {
	name string
	pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint)
}{
	{"workers=2", pair},
	{"workers=1", func(t testing.TB, c *rdma.Context) (*rdma.Endpoint, *rdma.Endpoint) {
		return samePair(t, c.Worker())
	}},
}

func forEachPairing(t *testing.T, f func(t *testing.T, tls string, pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint))) {
	forEachTransport(t, func(t *testing.T, tls string) {
		for _, p := range pairings {
			t.Run(p.name, func(t *testing.T) { f(t, tls, p.pair) })
		}
	})
}

func connect(ctx context.Context, cw, sw *rdma.Worker) (client, server *rdma.Endpoint, err error) {
	l, err := sw.Listen("127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	defer l.Close()
	type res struct {
		e   *rdma.Endpoint
		err error
	}
	acc := make(chan res, 1)
	go func() {
		e, err := l.Accept(ctx)
		acc <- res{e, err}
	}()
	client, err = cw.Dial(ctx, l.Addr().String())
	r := <-acc
	if err != nil {
		if r.e != nil {
			r.e.Close()
		}
		return nil, nil, err
	}
	if r.err != nil {
		client.Close()
		return nil, nil, r.err
	}
	return client, r.e, nil
}

func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	for i := n &^ 7; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

// sizes from 1 B to 64 MiB; the largest only without -short.
func sizes(t testing.TB) []int {
	s := []int{1, 7, 64, 4095, 4096, 65537, 1 << 20, 4<<20 + 3}
	if !testing.Short() {
		s = append(s, 64<<20)
	}
	return s
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return itoa(n>>20) + "MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return itoa(n>>10) + "KiB"
	}
	return itoa(n) + "B"
}

func itoa(n int) string {
	var b strings.Builder
	if n == 0 {
		return "0"
	}
	var d []byte
	for ; n > 0; n /= 10 {
		d = append([]byte{byte('0' + n%10)}, d...)
	}
	b.Write(d)
	return b.String()
}

func requireClosedErr(t testing.TB, err error) {
	t.Helper()
	require.Error(t, err)
	require.ErrorIs(t, err, net.ErrClosed)
}

// exposed allocates n bytes with c and unpacks their key on ep: the memory a
// peer exposes and the key that reaches it. Both are closed at cleanup.
func exposed(t testing.TB, c *rdma.Context, ep *rdma.Endpoint, n int) (*rdma.Memory, []byte, *rdma.RemoteKey) {
	t.Helper()
	m, err := c.Alloc(n)
	require.NoError(t, err)
	t.Cleanup(func() { m.Close() })
	packed, err := m.PackKey()
	require.NoError(t, err)
	rk, err := ep.UnpackKey(packed)
	require.NoError(t, err)
	t.Cleanup(func() { rk.Close() })
	return m, packed, rk
}
