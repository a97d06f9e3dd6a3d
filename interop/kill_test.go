package interop_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Dead-peer detection: sessions here ping every 200 ms and give up after 3 s
// without an answer (generous: a loaded 2-core CI machine under -race must
// not drop a live peer), so a killed peer must surface within deadBound even
// if no connection error reports it.
const (
	kaInterval = 200 * time.Millisecond
	kaTimeout  = 3 * time.Second
	deadBound  = 10 * time.Second
)

// requireSettled checks (bounded) that nothing of gdrpc, yamux or gRPC is
// left in this process once the test closed its clients and servers: no
// goroutines, no sessions, no outbox entries, no attached buffers.
func requireSettled(t *testing.T) {
	t.Helper()
	settle(t, "leaked", func() error { return leaks(-1) })
}

// waitDone waits (bounded) until the session closed and left the registry.
func waitDone(t *testing.T, s *transport.Session) {
	t.Helper()
	select {
	case <-s.Done():
	case <-time.After(testTimeout):
		t.Fatalf("session %d to the killed peer still open", s.ID())
	}
	require.Empty(t, transport.SessionsTo(s.Peer().ID), "the session left the registry")
}

// TestPeerKilledMidStream: the server process is killed with SIGKILL while a
// server stream is open; the client's Recv fails with Unavailable within
// deadBound, the session leaves the registry, and nothing leaks.
func TestPeerKilledMidStream(t *testing.T) {
	for _, tc := range transportCases[:3] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			noSessions(t)
			opts := tc.isolated(t, transport.WithKeepAlive(kaInterval, kaTimeout))
			srv := startChild(t, "server", nil, envUCX+"="+tc.ucx)
			addr := srv.waitLine("ADDR ")
			before := transport.ReadStats().Sessions
			rec := &dialRecorder{d: dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...)).DialContext}
			cc := dialClient(t, addr, opts, nil, grpc.WithContextDialer(rec.DialContext))
			client := testgrpc.NewTestServiceClient(cc)

			// One response now, the next in a minute: the stream stays open.
			stream, err := client.StreamingOutputCall(callCtx(t), &testgrpc.StreamingOutputCallRequest{
				ResponseParameters: []*testgrpc.ResponseParameters{
					{Size: 31415},
					{Size: 9, IntervalUs: int32(time.Minute / time.Microsecond)},
				},
			})
			require.NoError(t, err)
			first, err := stream.Recv()
			require.NoError(t, err)
			require.Len(t, first.GetPayload().GetBody(), 31415)
			sessions := rec.all()
			require.Len(t, sessions, 1)
			s := sessions[0]
			require.Equal(t, tc.want(), s.Transport())
			require.Equal(t, before+1, transport.ReadStats().Sessions)
			require.Len(t, transport.SessionsTo(s.Peer().ID), 1)

			srv.kill()
			killed := time.Now()
			_, err = stream.Recv()
			elapsed := time.Since(killed)
			require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			require.Less(t, elapsed, deadBound)
			t.Logf("Recv failed %v after SIGKILL: %v", elapsed.Round(time.Millisecond), err)
			waitDone(t, s)
			require.Equal(t, before, transport.ReadStats().Sessions)
			require.NoError(t, cc.Close())
			requireSettled(t)
		})
	}
}

// handlerEnds reports the error each stream handler returned.
type handlerEnds struct {
	ends chan error
}

func (h *handlerEnds) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	err := handler(srv, ss)
	h.ends <- err
	return err
}

// TestClientKilledMidStream: the client process is killed with SIGKILL while
// a bidirectional stream is open; the server's handler ends with an error
// within deadBound, the server's session leaves the registry, and the server
// leaks nothing.
func TestClientKilledMidStream(t *testing.T) {
	for _, tc := range transportCases[:3] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			noSessions(t)
			opts := tc.isolated(t, transport.WithKeepAlive(kaInterval, kaTimeout))
			ends := &handlerEnds{ends: make(chan error, 1)}
			tagger := &sessionTagger{sessions: make(chan *transport.Session, 1)}
			srv := startServer(t, opts, nil, bothServices, grpc.ChainStreamInterceptor(ends.intercept), grpc.StatsHandler(tagger))
			cl := startChild(t, "stream-client", nil, envUCX+"="+tc.ucx, envAddr+"="+srv.addr)
			cl.waitLine("STREAMING")
			var s *transport.Session
			select {
			case s = <-tagger.sessions:
			default:
				t.Fatal("the server saw no gdrpc call")
			}
			require.Equal(t, tc.want(), s.Transport())

			cl.kill()
			killed := time.Now()
			select {
			case err := <-ends.ends:
				require.Error(t, err)
				code := status.Code(err)
				require.True(t, code == codes.Canceled || code == codes.Unavailable, "%v", err)
				t.Logf("the handler ended %v after SIGKILL: %v", time.Since(killed).Round(time.Millisecond), err)
			case <-time.After(deadBound):
				t.Fatalf("the handler still runs %v after the client was killed", deadBound)
			}
			waitDone(t, s)
			require.Less(t, time.Since(killed), deadBound)
			srv.gs.Stop()
			requireSettled(t)
		})
	}
}

// killingAllocator is a receive allocator that kills a child process when
// asked for the destination of the payload (size bytes): the descriptor has
// arrived, the transfer has not started, so the owner dies between
// descriptor and FIN. Given a nil child, it only records the allocation.
type killingAllocator struct {
	devicebuf.Allocator
	size   int
	victim chan *child // the child to kill, given once it started
	once   sync.Once
	killed chan struct{}
	at     time.Time
}

func newKillingAllocator(size int) *killingAllocator {
	return &killingAllocator{Allocator: devicebuf.NewHostAllocator(), size: size, victim: make(chan *child, 1), killed: make(chan struct{})}
}

func (a *killingAllocator) Alloc(n int) (*devicebuf.Buffer, error) {
	if n == a.size {
		a.once.Do(func() {
			select {
			case c := <-a.victim:
				if c != nil {
					c.kill()
				}
				a.at = time.Now()
			case <-time.After(testTimeout):
			}
			close(a.killed)
		})
	}
	return a.Allocator.Alloc(n)
}

// use makes a the receive allocator of the gdr codec until the test ends.
func (a *killingAllocator) use(t *testing.T) {
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(a))
	t.Cleanup(func() { gdrcodec.Register() })
}

// wasAllocated checks that the payload's destination was allocated (and
// the victim, if any, killed then): the descriptor reached the receiver.
func (a *killingAllocator) wasAllocated(t *testing.T) {
	t.Helper()
	select {
	case <-a.killed:
	case <-time.After(testTimeout):
		t.Fatal("the payload's destination was never allocated: no descriptor arrived")
	}
	require.False(t, a.at.IsZero(), "no victim given to the allocator")
}

// sessionTagger records the gdrpc session of each call a server sees.
type sessionTagger struct {
	sessions chan *transport.Session
}

func (h *sessionTagger) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	if s := transport.SessionFromContext(ctx); s != nil {
		select {
		case h.sessions <- s:
		default:
		}
	}
	return ctx
}
func (h *sessionTagger) HandleRPC(context.Context, stats.RPCStats) {}
func (h *sessionTagger) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (h *sessionTagger) HandleConn(context.Context, stats.ConnStats) {}

// killedBySIGKILL reports whether a child's Wait error says SIGKILL ended it.
func killedBySIGKILL(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// TestOwnerKilledBeforeFIN kills the owner of an out-of-band payload after
// the receiver got its descriptor and before the receiver got FIN, at two
// moments: before the transfer (the receiver's allocator kills the owner when
// asked for the destination) and after the owner wrote the bytes (the owner
// kills itself before it sends FIN). The owner is the server (a response
// payload: the client's call fails with Unavailable or DeadlineExceeded within
// deadBound) or the client (a request payload: the server's pull fails and the
// server stays healthy). The surviving side leaks nothing.
func TestOwnerKilledBeforeFIN(t *testing.T) {
	const n = 4 << 20
	for _, tc := range transportCases[:3] {
		for _, when := range []string{"before-transfer", "before-fin"} {
			t.Run("transport="+tc.name+"/owner=server/killed="+when, func(t *testing.T) {
				noSessions(t)
				opts := tc.isolated(t, transport.WithKeepAlive(kaInterval, kaTimeout))
				env := []string{envUCX + "=" + tc.ucx}
				if when == "before-fin" {
					env = append(env, envDie+"=after-push")
				}
				srv := startChild(t, "server", nil, env...)
				addr := srv.waitLine("ADDR ")
				a := newKillingAllocator(n)
				if when == "before-transfer" {
					a.victim <- srv
				} else {
					a.victim <- nil
				}
				a.use(t)
				rec := &dialRecorder{d: dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...)).DialContext}
				cc := dialClient(t, addr, opts, nil, grpc.WithContextDialer(rec.DialContext))

				start := time.Now()
				got, err := tensorpb.NewTensorServiceClient(cc).Make(callCtx(t), &tensorpb.Sized{Size: n, Seed: 1})
				elapsed := time.Since(start)
				a.wasAllocated(t)
				require.Nil(t, got)
				code := status.Code(err)
				require.True(t, code == codes.Unavailable || code == codes.DeadlineExceeded, "%v", err)
				require.Less(t, elapsed, deadBound)
				t.Logf("Make failed %v after it started: %v", elapsed.Round(time.Millisecond), err)
				require.True(t, killedBySIGKILL(srv.wait()), "the server was killed with SIGKILL")
				if when == "before-fin" {
					require.Contains(t, srv.out.String(), "DYING after push")
				}
				sessions := rec.all()
				require.Len(t, sessions, 1)
				waitDone(t, sessions[0])
				require.NoError(t, cc.Close())
				requireSettled(t)
			})

			t.Run("transport="+tc.name+"/owner=client/killed="+when, func(t *testing.T) {
				noSessions(t)
				opts := tc.isolated(t, transport.WithKeepAlive(kaInterval, kaTimeout))
				paths := countPaths(t)
				a := newKillingAllocator(n)
				a.use(t)
				tagger := &sessionTagger{sessions: make(chan *transport.Session, 1)}
				srv := startServer(t, opts, nil, bothServices, grpc.StatsHandler(tagger))
				env := []string{envUCX + "=" + tc.ucx, envAddr + "=" + srv.addr, fmt.Sprintf("%s=%d", envSize, n)}
				if when == "before-fin" {
					env = append(env, envDie+"=after-push")
				}
				cl := startChild(t, "digest-client", nil, env...)
				if when == "before-transfer" {
					a.victim <- cl
				} else {
					a.victim <- nil
				}
				a.wasAllocated(t)
				require.True(t, killedBySIGKILL(cl.wait()), "the client was killed with SIGKILL")
				died := time.Now()
				require.NotContains(t, cl.out.String(), "OK", "the call cannot have succeeded")
				if when == "before-fin" {
					require.Contains(t, cl.out.String(), "DYING after push")
				}

				var s *transport.Session
				select {
				case s = <-tagger.sessions:
				case <-time.After(testTimeout):
					t.Fatal("the server saw no gdrpc call")
				}
				waitDone(t, s)
				t.Logf("the server's session to the killed client closed %v after it died", time.Since(died).Round(time.Millisecond))
				require.Less(t, time.Since(died), deadBound)
				if when == "before-fin" {
					// The owner wrote the bytes: the server's pull was under way
					// and must fail for want of FIN.
					paths.waitFailure(t)
				}
				for _, err := range paths.failures() {
					t.Logf("failed pull: %v", err)
				}
				// The pull fails, or never starts when the session is gone already.
				require.Empty(t, paths.reset(), "no pull succeeded")

				// The server is still healthy.
				gdrcodec.Register()
				cc := dialClient(t, srv.addr, opts, nil)
				got, err := tensorpb.NewTensorServiceClient(cc).Make(callCtx(t), &tensorpb.Sized{Size: 1 << 20, Seed: 4})
				require.NoError(t, err)
				requirePayload(t, got, 1<<20, 4)
				gdrcodec.ReleaseAll(got)
				require.NoError(t, cc.Close())
				srv.gs.Stop()
				requireSettled(t)
			})
		}
	}
}

// TestOwnerStallsBeforeFIN: the owner of a response payload is alive but
// never answers FIN (it stops after writing the bytes). The client's call must
// end at its own deadline (DeadlineExceeded) or when it is cancelled
// (Canceled), as any gRPC call does, or, with neither, at the transfer timeout
// (DeadlineExceeded); the client leaks nothing.
func TestOwnerStallsBeforeFIN(t *testing.T) {
	const (
		n = 1 << 20
		// The call's deadline, or the transfer timeout when the call has none.
		limit = 2 * time.Second
		// The transfer timeout when the call has a deadline: the call must end
		// at its deadline, long before this.
		longTransfer = 8 * time.Second
		// Slack for a loaded machine.
		slack = 5 * time.Second
	)
	for _, tc := range transportCases[:3] {
		for _, bound := range []string{"call-deadline", "call-cancel", "transfer-timeout"} {
			t.Run("transport="+tc.name+"/bound="+bound, func(t *testing.T) {
				noSessions(t)
				opts := tc.isolated(t)
				srv := startChild(t, "server", nil, envUCX+"="+tc.ucx, envDie+"=stall-after-push")
				addr := srv.waitLine("ADDR ")
				paths := countPaths(t)
				ctx := callCtx(t)
				wantCode := codes.DeadlineExceeded
				var cancelled chan time.Time // when the call was cancelled
				switch bound {
				case "call-deadline":
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, limit)
					defer cancel()
					oob.SetTransferConfig(oob.TransferConfig{Metrics: paths, Timeout: longTransfer})
				case "call-cancel":
					wantCode = codes.Canceled
					var cancel context.CancelFunc
					ctx, cancel = context.WithCancel(ctx)
					defer cancel()
					oob.SetTransferConfig(oob.TransferConfig{Metrics: paths, Timeout: longTransfer})
					cancelled = make(chan time.Time, 1)
					go func() { // cancel once the owner stalls: the pull is under way
						for !strings.Contains(srv.out.String(), "STALLING") {
							select {
							case <-srv.out.changed:
							case <-ctx.Done():
								return
							}
						}
						cancelled <- time.Now()
						cancel()
					}()
				default:
					oob.SetTransferConfig(oob.TransferConfig{Metrics: paths, Timeout: limit})
				}
				cc := dialClient(t, addr, opts, nil)
				start := time.Now()
				got, err := tensorpb.NewTensorServiceClient(cc).Make(ctx, &tensorpb.Sized{Size: n, Seed: 1})
				elapsed := time.Since(start)
				t.Logf("Make failed after %v: %v", elapsed.Round(time.Millisecond), err)
				require.Nil(t, got)
				require.Equal(t, wantCode, status.Code(err), "%v", err)
				require.Contains(t, srv.out.String(), "STALLING after push", "the owner wrote the bytes")
				switch dl, ok := ctx.Deadline(); {
				case cancelled != nil:
					at := <-cancelled
					require.Less(t, time.Since(at), slack, "the call outlived its cancellation")
				case bound == "call-deadline" && ok:
					// The deadline was set before the client was made.
					require.False(t, time.Now().Before(dl), "the call ended %v before its deadline", time.Until(dl))
					require.Less(t, time.Since(dl), slack, "the call outlived its deadline")
				default:
					require.GreaterOrEqual(t, elapsed, limit-50*time.Millisecond)
					require.Less(t, elapsed, limit+slack, "the call outlived its bound of %v", limit)
				}
				require.NoError(t, cc.Close())
				requireSettled(t)
			})
		}
	}
}

// TestReconnectAfterServerRestart: the server process dies and a new one
// listens on the same address; the gRPC client reconnects through a new
// gdrpc session (to a new owner process) and calls work again, out-of-band
// payloads included.
func TestReconnectAfterServerRestart(t *testing.T) {
	for _, tc := range transportCases[:3] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			noSessions(t)
			opts := tc.isolated(t, transport.WithKeepAlive(kaInterval, kaTimeout))
			paths := countPaths(t)
			first := startChild(t, "server", nil, envUCX+"="+tc.ucx)
			addr := first.waitLine("ADDR ")
			rec := &dialRecorder{d: dialer.New(gdrpc.WithSessionOptions(withEngine(opts)...)).DialContext}
			cc := dialClient(t, addr, opts, nil, grpc.WithContextDialer(rec.DialContext))
			client := tensorpb.NewTensorServiceClient(cc)
			got, err := client.Make(callCtx(t), &tensorpb.Sized{Size: 1 << 20, Seed: 8})
			require.NoError(t, err)
			requirePayload(t, got, 1<<20, 8)
			gdrcodec.ReleaseAll(got)
			s1 := rec.all()[0]

			first.kill()
			waitDone(t, s1)
			second := startChild(t, "server", nil, envUCX+"="+tc.ucx, envListen+"="+addr)
			require.Equal(t, addr, second.waitLine("ADDR "))

			got, err = client.Make(callCtx(t), &tensorpb.Sized{Size: 1 << 20, Seed: 9}, grpc.WaitForReady(true))
			require.NoError(t, err)
			requirePayload(t, got, 1<<20, 9)
			gdrcodec.ReleaseAll(got)
			sessions := rec.all()
			require.GreaterOrEqual(t, len(sessions), 2)
			s2 := sessions[len(sessions)-1]
			require.NotEqual(t, s1.Peer().ID, s2.Peer().ID, "a new server process")
			require.Equal(t, tc.want(), s2.Transport())
			require.Equal(t, 1, transport.ReadStats().Sessions)
			require.Equal(t, map[string]int{map[string]string{"ucx": "rdma", "tcp": "stream"}[tc.want()]: 2}, paths.reset())
			require.NoError(t, cc.Close())
			requireSettled(t)
		})
	}
}
