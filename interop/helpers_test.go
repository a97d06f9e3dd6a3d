package interop_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"hash/crc32"
	"math/big"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// testTimeout bounds every call and wait of a test.
const testTimeout = 30 * time.Second

// UCX transport families (UCX_TLS) of the UCX cases. UCX 1.13 cannot wire
// up a client-server endpoint with shared-memory transports alone
// ("posix,sysv,cma,self" fails with "Destination is unreachable"): the shm
// family includes tcp, and the byte stream then runs on a sysv/posix lane
// (requireUCXLanes checks it).
const (
	ucxShm = "posix,sysv,cma,tcp"
	ucxTCP = "tcp"
)

// skipUnless skips the test with reason, or fails it when GDRPC_REQUIRE names
// what.
func skipUnless(tb testing.TB, what, reason string, args ...any) {
	tb.Helper()
	if testenv.Required(what) {
		tb.Fatalf("%s required (GDRPC_REQUIRE) but: "+reason, append([]any{what}, args...)...)
	}
	tb.Skipf(reason, args...)
}

// requireUCX skips the test when UCX is unusable (fails it under
// GDRPC_REQUIRE=ucx).
func requireUCX(tb testing.TB) {
	tb.Helper()
	if err := rdma.Available(); err != nil {
		skipUnless(tb, "ucx", "UCX unavailable: %v", err)
	}
}

var ucxContexts sync.Map // UCX_TLS -> *rdma.Context, closed at the end of TestMain

// ucxContext returns a UCX context restricted to the transports tls.
func ucxContext(tb testing.TB, tls string) *rdma.Context {
	tb.Helper()
	requireUCX(tb)
	if c, ok := ucxContexts.Load(tls); ok {
		return c.(*rdma.Context)
	}
	c, err := rdma.NewContext(rdma.WithTransports(tls))
	if err != nil {
		skipUnless(tb, "ucx", "UCX context (UCX_TLS=%s): %v", tls, err)
	}
	actual, loaded := ucxContexts.LoadOrStore(tls, c)
	if loaded {
		_ = c.Close()
	}
	return actual.(*rdma.Context)
}

func closeContexts() {
	ucxContexts.Range(func(k, v any) bool {
		_ = v.(*rdma.Context).Close()
		ucxContexts.Delete(k)
		return true
	})
}

// transportCase is one way of running gdrpc under gRPC.
type transportCase struct {
	name string
	ucx  string // UCX_TLS of the session's UCX context; "" for the TCP fallback
	tls  bool   // TLS on top of the gdrpc conn
}

var transportCases = []transportCase{
	{name: "tcp"},
	{name: "ucx-shm", ucx: ucxShm},
	{name: "ucx-tcp", ucx: ucxTCP},
	{name: "tcp+tls", tls: true},
	{name: "ucx-shm+tls", ucx: ucxShm, tls: true},
	{name: "ucx-tcp+tls", ucx: ucxTCP, tls: true},
}

// options returns the transport options of the case (both sides), skipping
// the test when the case needs UCX and it is absent.
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

// want is the session transport the case must end up on.
func (tc transportCase) want() string {
	if tc.ucx != "" {
		return "ucx"
	}
	return "tcp"
}

// creds returns the inner credentials of both sides: TLS or none.
func (tc transportCase) creds(tb testing.TB) (server, client credentials.TransportCredentials) {
	tb.Helper()
	if !tc.tls {
		return insecure.NewCredentials(), insecure.NewCredentials()
	}
	p, err := testTLS()
	require.NoError(tb, err)
	return p.server, p.client
}

// tlsServerName is the name in the test certificate (with 127.0.0.1).
const tlsServerName = "gdrpc.test"

type tlsPair struct {
	server, client credentials.TransportCredentials
}

// testTLS makes a self-signed ECDSA certificate once per process.
var testTLS = sync.OnceValues(func() (*tlsPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: tlsServerName},
		DNSNames:              []string{tlsServerName},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	return &tlsPair{
		server: credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}),
		client: credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: tlsServerName, MinVersion: tls.VersionTLS13}),
	}, nil
})

// server is a gRPC server on a gdrpc listener.
type server struct {
	lis  net.Listener
	gs   *grpc.Server
	addr string
}

// startServer serves the services register adds on a gdrpc listener on
// 127.0.0.1 with the gdrpc server options; it stops when the test ends.
func startServer(tb testing.TB, opts []transport.Option, creds credentials.TransportCredentials, register func(*grpc.Server), extra ...grpc.ServerOption) *server {
	tb.Helper()
	noSessions(tb)
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(withEngine(opts)...))
	require.NoError(tb, err)
	sopts := listener.ServerOptions(creds)
	gs := grpc.NewServer(append(sopts, extra...)...)
	register(gs)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	tb.Cleanup(func() {
		gs.Stop()
		select {
		case err := <-served:
			require.NoError(tb, err)
		case <-time.After(testTimeout):
			tb.Error("Serve did not return after Stop")
		}
	})
	return &server{lis: lis, gs: gs, addr: lis.Addr().String()}
}

// noSessions waits (bounded) until the sessions of earlier tests are gone.
// Client and server of a test share this process's id, which every
// descriptor names as the owner, and a pull may take any live session to the
// owner: a session of an earlier test lingering after its conn closed (until
// its transfers have been idle a moment) would carry it, on its own transport.
func noSessions(tb testing.TB) {
	tb.Helper()
	settle(tb, "sessions of earlier tests", func() error {
		if n := transport.ReadStats().Sessions; n != 0 {
			return fmt.Errorf("%d still registered", n)
		}
		return nil
	})
}

// oobPath is the path of out-of-band payloads over a session of transport tr
// (Session.Transport).
func oobPath(tb testing.TB, tr string) string {
	tb.Helper()
	path, ok := map[string]string{"ucx": "rdma", "tcp": "stream"}[tr]
	require.True(tb, ok, "transport %q", tr)
	return path
}

// eagerThreshold is the payload size from which payloads go out-of-band
// over a session of transport tr.
func eagerThreshold(tr string) int {
	if tr == "tcp" {
		return gdrcodec.StreamEagerThreshold
	}
	return gdrcodec.DefaultEagerThreshold
}

// settle polls check until it returns nil, and fails the test with what,
// and check's last error, once testTimeout passed: for state that other
// goroutines (sessions closing, releases on their way) change in their own
// time, with nothing to wait on.
func settle(tb testing.TB, what string, check func() error) {
	tb.Helper()
	deadline := time.Now().Add(testTimeout)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%s: %v", what, err)
		}
		time.Sleep(10 * time.Millisecond) // polling, bounded by the deadline
	}
}

// dialClient returns a gRPC client of addr over gdrpc with the dialer's
// options (which bring the gdr codec's); it is closed when the test ends.
func dialClient(tb testing.TB, addr string, opts []transport.Option, creds credentials.TransportCredentials, extra ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	return dialClientWith(tb, addr, opts, creds, true, extra...)
}

// dialClientWith is dialClient; without gdr, the client uses only the gdrpc
// dial function and credentials, and so gRPC's default (proto) codec.
func dialClientWith(tb testing.TB, addr string, opts []transport.Option, creds credentials.TransportCredentials, gdr bool, extra ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	d := dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...))
	dopts := d.DialOptions(creds)
	if !gdr {
		dopts = []grpc.DialOption{
			grpc.WithContextDialer(d.DialContext),
			grpc.WithTransportCredentials(transport.NewCredentials(creds)),
		}
	}
	cc, err := grpc.NewClient("passthrough:///"+addr, append(dopts, extra...)...)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// plainClient returns a standard gRPC client of addr: plain TCP dial, the
// given credentials (insecure when nil), no gdrpc options, the default codec.
func plainClient(tb testing.TB, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	tb.Helper()
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(creds),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		}))
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// callCtx is a context bounded by testTimeout that ends with the test.
func callCtx(tb testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	tb.Cleanup(cancel)
	return ctx
}

// fatalLogger is gRPC's logger in this test binary. The interop cases of
// google.golang.org/grpc/interop report a failure with grpclog's Fatal, which
// would exit the process; here Fatal fails the test bound to the logger and
// ends the calling goroutine (the test's own: what t.FatalNow does). Errors and
// warnings go to that test's log.
type fatalLogger struct {
	mu sync.Mutex
	tb testing.TB
}

var glog = &fatalLogger{}

// bind makes tb the test that gRPC's Fatal fails, until tb ends.
func (l *fatalLogger) bind(tb testing.TB) {
	l.mu.Lock()
	l.tb = tb
	l.mu.Unlock()
	tb.Cleanup(func() {
		l.mu.Lock()
		if l.tb == tb {
			l.tb = nil
		}
		l.mu.Unlock()
	})
}

func (l *fatalLogger) log(sev, msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.tb != nil {
		l.tb.Logf("grpc %s: %s", sev, msg)
	}
}

func (l *fatalLogger) fatal(msg string) {
	l.mu.Lock()
	tb := l.tb
	if tb != nil {
		tb.Errorf("grpc FATAL: %s", msg)
	}
	l.mu.Unlock()
	if tb == nil {
		fmt.Fprintln(os.Stderr, "grpc FATAL outside a test:", msg)
		os.Exit(1)
	}
	tb.FailNow() // ends the calling goroutine, as t.Fatal does
	runtime.Goexit()
}

func (l *fatalLogger) Info(...any)                 {}
func (l *fatalLogger) Infoln(...any)               {}
func (l *fatalLogger) Infof(string, ...any)        {}
func (l *fatalLogger) Warning(a ...any)            { l.log("WARNING", fmt.Sprint(a...)) }
func (l *fatalLogger) Warningln(a ...any)          { l.log("WARNING", fmt.Sprintln(a...)) }
func (l *fatalLogger) Warningf(f string, a ...any) { l.log("WARNING", fmt.Sprintf(f, a...)) }
func (l *fatalLogger) Error(a ...any)              { l.log("ERROR", fmt.Sprint(a...)) }
func (l *fatalLogger) Errorln(a ...any)            { l.log("ERROR", fmt.Sprintln(a...)) }
func (l *fatalLogger) Errorf(f string, a ...any)   { l.log("ERROR", fmt.Sprintf(f, a...)) }
func (l *fatalLogger) Fatal(a ...any)              { l.fatal(fmt.Sprint(a...)) }
func (l *fatalLogger) Fatalln(a ...any)            { l.fatal(fmt.Sprintln(a...)) }
func (l *fatalLogger) Fatalf(f string, a ...any)   { l.fatal(fmt.Sprintf(f, a...)) }
func (l *fatalLogger) V(int) bool                  { return false }

// pathCounter counts the out-of-band pulls of this process by path.
type pathCounter struct {
	mu     sync.Mutex
	paths  map[string]int
	errs   []error
	failed chan struct{} // signalled on each failed pull
}

func newPathCounter() *pathCounter {
	return &pathCounter{paths: map[string]int{}, failed: make(chan struct{}, 1)}
}

// countPaths installs a pathCounter as the transfer metrics hook until the
// test ends, with a transfer timeout of testTimeout.
func countPaths(tb testing.TB) *pathCounter {
	tb.Helper()
	pc := newPathCounter()
	oob.SetTransferConfig(oob.TransferConfig{Metrics: pc, Timeout: testTimeout})
	tb.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
	return pc
}

func (p *pathCounter) Transfer(i oob.TransferInfo) {
	if !i.Pull {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if i.Err != nil {
		p.errs = append(p.errs, i.Err)
		select {
		case p.failed <- struct{}{}:
		default:
		}
		return
	}
	p.paths[i.Path.String()]++
}

func (p *pathCounter) Fallback(oob.Path, oob.Path, string) {}

// succeeded returns how many pulls were counted since the last reset, after
// checking that none failed.
func (p *pathCounter) succeeded(tb testing.TB) int {
	tb.Helper()
	require.Empty(tb, p.failures())
	n := 0
	for _, k := range p.reset() {
		n += k
	}
	return n
}

// concurrently runs f(w) for each w below workers, each on a goroutine of its
// own, and fails the test with every error they returned.
func concurrently(tb testing.TB, workers int, f func(w int) error) {
	tb.Helper()
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() { errs[w] = f(w) })
	}
	wg.Wait()
	require.NoError(tb, errors.Join(errs...))
}

// reset returns the pulls counted since the last reset.
func (p *pathCounter) reset() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.paths
	p.paths = map[string]int{}
	return m
}

// waitFailure waits (bounded) until a pull failed.
func (p *pathCounter) waitFailure(tb testing.TB) {
	tb.Helper()
	select {
	case <-p.failed:
		p.failed <- struct{}{} // leave it visible to the next caller
	case <-time.After(testTimeout):
		tb.Fatal("no pull failed")
	}
}

// failures returns the failed pulls counted so far.
func (p *pathCounter) failures() []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]error(nil), p.errs...)
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crc32cUpdate extends a CRC-32C (the checksum TensorService computes).
func crc32cUpdate(crc uint32, p []byte) uint32 { return crc32.Update(crc, castagnoli, p) }

// requirePayload checks that a Tensor's data payload is the Fill pattern of n
// bytes with seed.
func requirePayload(tb testing.TB, got *tensorpb.Tensor, n int, seed uint32) {
	tb.Helper()
	p, err := tensor.Bytes(got.GetData())
	require.NoError(tb, err)
	require.Equal(tb, n, len(p))
	require.True(tb, bytes.Equal(pattern(n, seed), p), "payload differs from the pattern")
}

// withEngine puts first in opts the engine with the process's configuration
// (oob.SetTransferConfig), which the tests set.
func withEngine(opts []transport.Option) []transport.Option {
	return append([]transport.Option{transport.WithEngine(oob.Engine())}, opts...)
}
