package transport_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

const testTimeout = 20 * time.Second

// Transport families for UCX contexts. Client-server connection setup needs
// UCX's tcp connection manager, so the shm family keeps tcp in the list; the
// stream then runs over shared memory (TestConnTransfer checks the lanes).
const (
	ucxShm = "posix,sysv,cma,tcp"
	ucxTCP = "tcp"
)

// requireUCX skips the test when UCX is unusable, or fails it when
// GDRPC_REQUIRE contains ucx.
func requireUCX(tb testing.TB) {
	tb.Helper()
	testenv.Need(tb, "ucx", rdma.Available())
}

var ucxContexts sync.Map // UCX_TLS -> *rdma.Context, kept for the process life

// ucxContext returns a UCX context restricted to the transports tls.
func ucxContext(tb testing.TB, tls string) *rdma.Context {
	tb.Helper()
	requireUCX(tb)
	if c, ok := ucxContexts.Load(tls); ok {
		return c.(*rdma.Context)
	}
	c, err := rdma.NewContext(rdma.WithTransports(tls))
	if err != nil {
		if testenv.Required("ucx") {
			tb.Fatalf("UCX context (%s): %v", tls, err)
		}
		tb.Skipf("UCX context (%s): %v", tls, err)
	}
	actual, loaded := ucxContexts.LoadOrStore(tls, c)
	if loaded {
		_ = c.Close()
	}
	return actual.(*rdma.Context)
}

// transportCase is one way of running a session.
type transportCase struct {
	name  string
	ucx   string   // UCX_TLS, "" for TCP
	lanes []string // one of these must show in the endpoint's transport info
}

var transportCases = []transportCase{
	{name: "tcp"},
	{name: "ucx-shm", ucx: ucxShm, lanes: []string{"sysv/memory", "posix/memory"}},
	{name: "ucx-tcp", ucx: ucxTCP, lanes: []string{"tcp/"}},
}

// options returns the options of the case, skipping the test when UCX is
// needed and absent.
func (tc transportCase) options(tb testing.TB, extra ...transport.Option) []transport.Option {
	tb.Helper()
	return tc.optionsOn(tb, ucxContext, extra)
}

// isolated is options with a UCX context of the test's own
// (testenv.UCXContext), for a test that kills or stops a peer process.
func (tc transportCase) isolated(tb testing.TB, extra ...transport.Option) []transport.Option {
	tb.Helper()
	return tc.optionsOn(tb, testenv.UCXContext, extra)
}

// optionsOn is options with the UCX context that contextOf returns.
func (tc transportCase) optionsOn(tb testing.TB, contextOf func(testing.TB, string) *rdma.Context, extra []transport.Option) []transport.Option {
	tb.Helper()
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	if tc.ucx != "" {
		opts = []transport.Option{transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(contextOf(tb, tc.ucx))}
	}
	return append(opts, extra...)
}

func (tc transportCase) want() string {
	if tc.ucx != "" {
		return "ucx"
	}
	return "tcp"
}

// setup is a listener with one session dialed to it.
type setup struct {
	l          *transport.Listener
	client     *transport.Session
	server     *transport.Session
	cc, sc     net.Conn // the gRPC stream conns
	serverOpts []transport.Option
}

// listenDial listens, dials one session and returns both ends with their gRPC
// stream conns. On an error it closes what it opened.
func listenDial(opts []transport.Option) (*setup, error) {
	l, err := transport.Listen("127.0.0.1:0", opts...)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := l.Accept()
		ch <- res{c, err}
	}()
	fail := func(err error, closers ...io.Closer) (*setup, error) {
		for _, c := range closers {
			_ = c.Close()
		}
		_ = l.Close() // ends a pending Accept
		return nil, err
	}
	cs, err := transport.Dial(ctx, l.Addr().String(), opts...)
	if err != nil {
		return fail(err)
	}
	cc, err := cs.Conn(ctx)
	if err != nil {
		return fail(err, cs)
	}
	var r res
	select {
	case r = <-ch:
	case <-ctx.Done():
		return fail(errors.New("accept timed out"), cc, cs)
	}
	if r.err != nil {
		return fail(r.err, cc, cs)
	}
	ss := transport.SessionOf(r.c)
	if ss == nil {
		return fail(errors.New("accepted conn has no session"), r.c, cc, cs)
	}
	return &setup{l: l, client: cs, server: ss, cc: cc, sc: r.c}, nil
}

// dialPair is listenDial that closes everything when the test ends.
func dialPair(tb testing.TB, opts []transport.Option) *setup {
	tb.Helper()
	st, err := listenDial(opts)
	require.NoError(tb, err)
	tb.Cleanup(func() {
		_ = st.server.Close()
		_ = st.client.Close()
		_ = st.l.Close()
	})
	return st
}

// makePipe is a nettest.MakePipe over a dialed session pair.
func makePipe(tb testing.TB, opts []transport.Option) func() (net.Conn, net.Conn, func(), error) {
	return func() (net.Conn, net.Conn, func(), error) {
		st, err := listenDial(opts)
		if err != nil {
			return nil, nil, nil, err
		}
		stop := func() {
			_ = st.cc.Close()
			_ = st.sc.Close()
			_ = st.client.Close()
			_ = st.server.Close()
			_ = st.l.Close()
		}
		return st.cc, st.sc, stop, nil
	}
}
