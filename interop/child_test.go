package interop_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/grpclog"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// Environment of the child roles.
const (
	envUCX    = "GDRPC_INTEROP_UCX"    // UCX_TLS of the child's sessions; "" for the TCP fallback
	envListen = "GDRPC_INTEROP_LISTEN" // address the server role listens on (127.0.0.1:0 if unset)
	envAddr   = "GDRPC_INTEROP_ADDR"   // address a client role dials
	envSize   = "GDRPC_INTEROP_SIZE"   // payload size of a client role
	// envDie set to "after-push" makes the child SIGKILL itself once it wrote
	// an out-of-band payload it owns into a receiver, before it answers FIN
	// (the owner reports the push to the metrics hook before sending FIN);
	// "stall-after-push" makes it stop there, alive, until its stdin closes:
	// the receiver never gets FIN from a live owner.
	envDie = "GDRPC_INTEROP_DIE"
	// envMaxAge sets the server role's MaxConnectionAge (a time.Duration);
	// the grace period is 10 s.
	envMaxAge = "GDRPC_INTEROP_MAX_AGE"
	// envKeepAlive sets the keepalive of a child's sessions as
	// "interval,timeout" (two time.Durations).
	envKeepAlive = "GDRPC_INTEROP_KEEPALIVE"
)

// parentGone is closed when the child's stdin closes.
var parentGone = make(chan struct{})

// childMetrics counts the child's pulls and, with GDRPC_INTEROP_DIE=after-push,
// kills the child after its first successful push.
type childMetrics struct {
	*pathCounter
	afterPush string // the value of GDRPC_INTEROP_DIE
}

func (m childMetrics) Transfer(i oob.TransferInfo) {
	if !i.Pull && i.Err == nil {
		switch m.afterPush {
		case "after-push":
			fmt.Println("DYING after push")
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // SIGKILL cannot be caught: the process ends here
		case "stall-after-push":
			fmt.Println("STALLING after push")
			<-parentGone
		}
	}
	m.pathCounter.Transfer(i)
}

// runChild plays a role in a re-executed test binary and returns its exit
// code. Every role ends when its stdin closes (the parent went away), or
// sooner when its work is done.
//
//   - server: serves the interop TestService and the TensorService on a
//     gdrpc listener, prints "ADDR host:port".
//   - digest-client: sends a Tensor with an out-of-band payload of
//     GDRPC_INTEROP_SIZE bytes to Digest at GDRPC_INTEROP_ADDR, prints the
//     outcome.
//   - interop-client: runs the gRPC interop cases against GDRPC_INTEROP_ADDR,
//     prints "OK <case>" for each, or "FAIL <case>: ..." and exits 1.
//   - stream-client: opens a FullDuplexCall at GDRPC_INTEROP_ADDR, gets one
//     response, prints "STREAMING" and waits with the stream open.
//   - make-client: calls Make for GDRPC_INTEROP_SIZE bytes at
//     GDRPC_INTEROP_ADDR and checks the payload byte by byte, then sends as
//     much to Digest and checks the checksum; prints
//     "OK transport=... pulls=map[path:count] same_host=... wide=... ..." or
//     "FAIL ...".
//   - hold-client: sends a Tensor of GDRPC_INTEROP_SIZE bytes to Digest at
//     GDRPC_INTEROP_ADDR, prints "CALLED" and keeps its session open until
//     its stdin closes.
//
// Every role prints "LOST n" before it returns: how many of its sessions
// closed because the peer did not answer keepalive.
func runChild(role string) int {
	losses := &sessionLosses{}
	code := runRole(role, losses)
	fmt.Println("LOST", losses.keepalive.Load())
	return code
}

func runRole(role string, losses *sessionLosses) int {
	opts, err := childOptions()
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	opts = append(opts, transport.WithMetrics(losses))
	metrics := childMetrics{pathCounter: newPathCounter(), afterPush: os.Getenv(envDie)}
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(parentGone)
	}()
	oob.SetTransferConfig(oob.TransferConfig{Metrics: metrics, Timeout: testTimeout})
	switch role {
	case "server":
		return childServer(opts)
	case "digest-client", "make-client", "hold-client":
		return childClient(role, opts, metrics.pathCounter)
	case "interop-client":
		return childInterop(opts)
	case "stream-client":
		return childStream(opts)
	}
	fmt.Fprintln(os.Stderr, "unknown child role", role)
	return 2
}

func childOptions() ([]transport.Option, error) {
	var opts []transport.Option
	if v := os.Getenv(envKeepAlive); v != "" {
		interval, timeout, _ := strings.Cut(v, ",")
		i, err := time.ParseDuration(interval)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", envKeepAlive, err)
		}
		t, err := time.ParseDuration(timeout)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", envKeepAlive, err)
		}
		opts = append(opts, transport.WithKeepAlive(i, t))
	}
	tls := os.Getenv(envUCX)
	if tls == "" {
		return append(opts, transport.WithMode(transport.ModeTCP)), nil
	}
	rc, err := rdma.NewContext(rdma.WithTransports(tls))
	if err != nil {
		return nil, fmt.Errorf("UCX context (UCX_TLS=%s): %w", tls, err)
	}
	return append(opts, transport.WithMode(transport.ModeUCX), transport.WithRDMAContext(rc)), nil
}

// sessionLosses counts the sessions that closed because their peer did not
// answer keepalive.
type sessionLosses struct{ keepalive atomic.Int64 }

func (l *sessionLosses) SessionUp(string, bool) {}
func (l *sessionLosses) SessionDown(_ string, _ bool, err error) {
	if errors.Is(err, transport.ErrKeepAlive) {
		l.keepalive.Add(1)
	}
}
func (l *sessionLosses) Fallback(string) {}

func childServer(opts []transport.Option) int {
	addr := os.Getenv(envListen)
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	lis, err := listener.Listen(addr, gdrpc.WithSessionOptions(withEngine(opts)...))
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	sopts := listener.ServerOptions(nil)
	if v := os.Getenv(envMaxAge); v != "" {
		age, err := time.ParseDuration(v)
		if err != nil {
			fmt.Println("FAIL", envMaxAge, err)
			return 1
		}
		sopts = append(sopts, grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionAge: age, MaxConnectionAgeGrace: 10 * time.Second}))
	}
	gs := grpc.NewServer(sopts...)
	bothServices(gs)
	go func() { _ = gs.Serve(lis) }()
	fmt.Println("ADDR", lis.Addr().String())
	<-parentGone
	gs.Stop()
	return 0
}

// holdClientTimeout bounds a hold-client's call: sixteen of them dial at
// once beside the others' sessions (TestKeepAliveAfterLoad), and on a loaded
// machine a dial's handshake may run out of its 10 s more than once before
// one succeeds.
const holdClientTimeout = 4 * testTimeout

func childClient(role string, opts []transport.Option, paths *pathCounter) int {
	var n int
	if _, err := fmt.Sscan(os.Getenv(envSize), &n); err != nil {
		fmt.Println("FAIL size:", err)
		return 1
	}
	timeout := testTimeout
	if role == "hold-client" {
		timeout = holdClientTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	d := dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...))
	cc, err := grpc.NewClient("passthrough:///"+os.Getenv(envAddr), d.DialOptions(nil)...)
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	defer cc.Close()
	client := tensorpb.NewTensorServiceClient(cc)
	switch role {
	case "digest-client", "hold-client":
		src := devicebuf.HostFromBytes(pattern(n, 3))
		req := &tensorpb.Tensor{Name: "from-child", Data: gdrcodec.New(src)}
		src.Release()
		fmt.Println("SENDING")
		var copts []grpc.CallOption
		if role == "hold-client" {
			// Sixty-four of these dial at once on a loaded machine
			// (TestKeepAliveAfterLoad, which is about the sessions once
			// up): a dial whose handshake ran out of time is retried, not
			// the call failed.
			copts = append(copts, grpc.WaitForReady(true))
		}
		sum, err := client.Digest(ctx, req, copts...)
		gdrcodec.ReleaseAll(req)
		if err != nil {
			fmt.Println("FAIL", err)
			return 1
		}
		fmt.Printf("OK bytes=%d crc=%08x\n", sum.Bytes, sum.Crc32C)
		if role == "hold-client" {
			fmt.Println("CALLED")
			<-parentGone
		}
	case "make-client":
		var pr peer.Peer
		got, err := client.Make(ctx, &tensorpb.Sized{Size: uint64(n), Seed: 5}, grpc.Peer(&pr))
		if err != nil {
			fmt.Println("FAIL", err)
			return 1
		}
		sess := transport.SessionFromPeer(&pr)
		if sess == nil {
			fmt.Println("FAIL the call came over no gdrpc session")
			return 1
		}
		defer gdrcodec.ReleaseAll(got)
		p, err := tensor.Bytes(got.Data)
		if err != nil {
			fmt.Println("FAIL", err)
			return 1
		}
		if want := pattern(n, 5); !bytes.Equal(p, want) {
			fmt.Printf("FAIL %d bytes arrived, want %d, equal prefix %d\n", len(p), len(want), commonPrefix(p, want))
			return 1
		}
		// And the other way: a request payload the server pulls.
		src := devicebuf.HostFromBytes(pattern(n, 6))
		req := &tensorpb.Tensor{Name: "up", Data: gdrcodec.New(src)}
		src.Release()
		sum, err := client.Digest(ctx, req)
		gdrcodec.ReleaseAll(req)
		if err != nil {
			fmt.Println("FAIL digest:", err)
			return 1
		}
		if want := tensor.ChecksumBytes(pattern(n, 6)); sum.Crc32C != want || sum.Bytes != uint64(n) {
			fmt.Printf("FAIL digest: server saw %d bytes crc %08x, want %d crc %08x\n", sum.Bytes, sum.Crc32C, n, want)
			return 1
		}
		fmt.Printf("OK transport=%s pulls=%v same_host=%v wide=%v make_crc=%08x digest_crc=%08x\n",
			sess.Transport(), paths.reset(), sess.Peer().SameHost, sess.WideLane(), tensor.ChecksumBytes(p), sum.Crc32C)
	}
	return 0
}

// childFatal is gRPC's logger in the interop-client role: Fatal records the
// message and ends the calling goroutine (the case's).
type childFatal struct {
	fatalLogger
	mu  sync.Mutex
	msg string
}

func (l *childFatal) fatal(msg string) {
	l.mu.Lock()
	l.msg = msg
	l.mu.Unlock()
	runtime.Goexit()
}

func (l *childFatal) Fatal(a ...any)            { l.fatal(fmt.Sprint(a...)) }
func (l *childFatal) Fatalln(a ...any)          { l.fatal(fmt.Sprintln(a...)) }
func (l *childFatal) Fatalf(f string, a ...any) { l.fatal(fmt.Sprintf(f, a...)) }

// take returns and clears the message of the last Fatal.
func (l *childFatal) take() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.msg
	l.msg = ""
	return m
}

func childInterop(opts []transport.Option) int {
	l := &childFatal{}
	grpclog.SetLoggerV2(l)
	d := dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...))
	cc, err := grpc.NewClient("passthrough:///"+os.Getenv(envAddr), d.DialOptions(nil)...)
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	defer cc.Close()
	client := testgrpc.NewTestServiceClient(cc)
	for _, c := range interopCases {
		attempts := 1
		if c.racy {
			attempts = racyAttempts
		}
		var msg string
		for range attempts {
			done := make(chan struct{})
			go func() {
				defer close(done)
				ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
				defer cancel()
				c.run(ctx, client, cc)
			}()
			<-done // the case ends within its context's bound
			if msg = l.take(); msg == "" {
				break
			}
		}
		if msg != "" {
			fmt.Printf("FAIL %s: %s\n", c.name, msg)
			return 1
		}
		fmt.Println("OK", c.name)
	}
	return 0
}

func childStream(opts []transport.Option) int {
	d := dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...))
	cc, err := grpc.NewClient("passthrough:///"+os.Getenv(envAddr), d.DialOptions(nil)...)
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	st, err := testgrpc.NewTestServiceClient(cc).FullDuplexCall(ctx)
	if err == nil {
		err = st.Send(&testgrpc.StreamingOutputCallRequest{ResponseParameters: []*testgrpc.ResponseParameters{{Size: 1000}}})
	}
	if err == nil {
		_, err = st.Recv()
	}
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	fmt.Println("STREAMING")
	select {
	case <-parentGone:
	case <-ctx.Done():
	}
	return 0
}

func commonPrefix(a, b []byte) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// child is the test binary re-executed in a role.
type child struct {
	t      testing.TB
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *lineWriter
	stderr *lineWriter
	exited chan struct{}
	err    error // of Wait, once exited is closed
}

// startChild runs the test binary in role, under the command prefix wrap
// (e.g. "ip netns exec NAME") if any, with env added to this environment.
// The child ends when the test does: its stdin closes, and it is killed if it
// does not exit within testTimeout.
func startChild(t testing.TB, role string, wrap []string, env ...string) *child {
	t.Helper()
	args := append(append([]string(nil), wrap...), os.Args[0], "-test.run=^$")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(append(os.Environ(), childEnv+"="+role), env...)
	c := &child{t: t, cmd: cmd, out: newLineWriter(), stderr: newLineWriter(), exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = c.out, c.stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	c.stdin = stdin
	require.NoError(t, cmd.Start())
	go func() {
		c.err = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		_ = c.stdin.Close()
		select {
		case <-c.exited:
		case <-time.After(testTimeout):
			t.Errorf("child %s did not exit; SIGQUIT for its goroutines, then SIGKILL", role)
			_ = c.cmd.Process.Signal(syscall.SIGQUIT)
			select {
			case <-c.exited:
			case <-time.After(5 * time.Second):
				c.kill()
			}
		}
		if t.Failed() {
			t.Logf("child %s stdout:\n%s\nstderr:\n%s", role, c.out.String(), c.stderr.String())
		}
	})
	return c
}

// waitLine waits (bounded by testTimeout) for a line of the child's stdout
// that starts with prefix and returns the rest of it. It fails the test if
// the child exits or prints "FAIL" first.
func (c *child) waitLine(prefix string) string {
	c.t.Helper()
	return c.waitLineFor(prefix, testTimeout)
}

// waitLineFor is waitLine bounded by d.
func (c *child) waitLineFor(prefix string, d time.Duration) string {
	c.t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		for _, l := range c.out.lines() {
			if rest, ok := strings.CutPrefix(l, prefix); ok {
				return strings.TrimSpace(rest)
			}
			if strings.HasPrefix(l, "FAIL") {
				c.t.Fatalf("child: %s\nstderr:\n%s", l, c.stderr.String())
			}
		}
		select {
		case <-c.out.changed:
		case <-c.exited:
			// the last lines may have come with the exit
			for _, l := range c.out.lines() {
				if rest, ok := strings.CutPrefix(l, prefix); ok {
					return strings.TrimSpace(rest)
				}
			}
			c.t.Fatalf("child exited (%v) before printing %q; stdout:\n%s\nstderr:\n%s", c.err, prefix, c.out.String(), c.stderr.String())
		case <-timer.C:
			c.t.Fatalf("no %q from the child in %v; stdout:\n%s\nstderr:\n%s", prefix, d, c.out.String(), c.stderr.String())
		}
	}
}

// kill sends SIGKILL and waits (bounded) until the child is gone.
func (c *child) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-c.exited:
	case <-time.After(testTimeout):
		c.t.Errorf("child %d did not die after SIGKILL", c.cmd.Process.Pid)
	}
}

// wait waits (bounded) for the child to exit and returns Wait's error.
func (c *child) wait() error {
	select {
	case <-c.exited:
		return c.err
	case <-time.After(testTimeout):
		c.t.Fatalf("child %d did not exit", c.cmd.Process.Pid)
		return nil
	}
}

// lineWriter collects a child's output by lines and signals each write.
type lineWriter struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	changed chan struct{}
}

func newLineWriter() *lineWriter { return &lineWriter{changed: make(chan struct{}, 1)} }

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.buf.Write(p)
	w.mu.Unlock()
	select {
	case w.changed <- struct{}{}:
	default:
	}
	return len(p), nil
}

// lines returns the complete lines written so far.
func (w *lineWriter) lines() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(w.buf.Bytes()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	if b := w.buf.Bytes(); len(b) > 0 && b[len(b)-1] != '\n' && len(out) > 0 {
		out = out[:len(out)-1] // the last line is not complete yet
	}
	return out
}

func (w *lineWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
