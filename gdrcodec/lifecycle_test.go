package gdrcodec_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// requireSettled polls (bounded) until nothing of the engine or codec is left
// over: outbox entries, pulls, parked bytes, spaces' ranges, attachments.
func requireSettled(t *testing.T, what string) {
	t.Helper()
	err := leaktest.Poll(15*time.Second, func() error {
		st := oob.ReadStats()
		switch {
		case st.Offered != 0:
			return fmt.Errorf("%d outbox entries", st.Offered)
		case st.Pulls != 0:
			return fmt.Errorf("%d pulls", st.Pulls)
		case st.Parked != 0 || st.ParkWaiting != 0:
			return fmt.Errorf("%d parked bytes, %d waiting", st.Parked, st.ParkWaiting)
		case st.Landed != 0 || st.PeerTaken != 0:
			return fmt.Errorf("%d landed, %d peer taken", st.Landed, st.PeerTaken)
		case st.Waiting != 0 || st.Unpulled != 0:
			return fmt.Errorf("%d waiting, %d unpulled", st.Waiting, st.Unpulled)
		case gdrcodec.Attached() != 0:
			return fmt.Errorf("%d attached buffers", gdrcodec.Attached())
		}
		return nil
	})
	require.NoError(t, err, "%s: left over", what)
}

// blockingServer's handlers signal entry and wait for release or their
// context's end, then answer with a payload anyway.
type blockingServer struct {
	tensor.Server
	entered chan struct{}
	release chan struct{}
	ctxDone chan error
	once    sync.Once
}

func newBlockingServer() *blockingServer {
	return &blockingServer{entered: make(chan struct{}), release: make(chan struct{}), ctxDone: make(chan error, 1)}
}

func (s *blockingServer) Make(ctx context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	s.once.Do(func() { close(s.entered) })
	select {
	case <-s.release:
	case <-ctx.Done():
		s.ctxDone <- ctx.Err()
	}
	return tensor.Make(nil, r)
}

func (s *blockingServer) Echo(ctx context.Context, m *tensorpb.Tensor) (*tensorpb.Tensor, error) {
	s.once.Do(func() { close(s.entered) })
	select {
	case <-s.release:
	case <-ctx.Done():
		s.ctxDone <- ctx.Err()
	}
	return m, nil
}

// lifecycleRig is newRig over TCP that also returns the server and its
// listener.
func lifecycleRig(t *testing.T, srv tensorpb.TensorServiceServer, opts ...gdrpc.Option) (*rig, *grpc.Server, *closeNotifyListener) {
	t.Helper()
	r := newRig(t, transport.ModeTCP, srv, opts...)
	return r, r.server, r.lis
}

// A handler still running when the server's GracefulStop begins answers
// with a response whose payload is out-of-band: the client must receive it,
// byte-exact (GracefulStop lets running calls finish).
func TestGracefulStopMidCall(t *testing.T) {
	srv := newBlockingServer()
	r, gs, lis := lifecycleRig(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const size = 1 << 20
	type result struct {
		m   *tensorpb.Tensor
		err error
	}
	res := make(chan result, 1)
	go func() {
		m, err := r.client.Make(ctx, &tensorpb.Sized{Size: size, Seed: 5})
		res <- result{m, err}
	}()
	<-srv.entered
	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	select {
	case <-lis.closed:
	case <-ctx.Done():
		t.Fatal("GracefulStop did not close the listener")
	}
	close(srv.release)
	got := <-res
	require.NoError(t, got.err, "a call GracefulStop let finish")
	checkSized(t, got.m, size, 5)
	select {
	case <-stopped:
	case <-ctx.Done():
		t.Fatal("GracefulStop did not return")
	}
	requireSettled(t, "after GracefulStop")
}

// A client that gives up while its handler runs: the handler answers anyway
// with a payload (its own, and one echoing the request's): nothing of
// either stays in the outbox or attached.
func TestCancelWhileHandlerRuns(t *testing.T) {
	for _, echo := range []bool{false, true} {
		t.Run(fmt.Sprintf("echo=%v", echo), func(t *testing.T) {
			srv := newBlockingServer()
			r, _, _ := lifecycleRig(t, srv)
			ctx, cancel := context.WithCancel(context.Background())
			errc := make(chan error, 1)
			req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 3)))}
			defer gdrcodec.ReleaseAll(req)
			go func() {
				var err error
				if echo {
					_, err = r.client.Echo(ctx, req)
				} else {
					_, err = r.client.Make(ctx, &tensorpb.Sized{Size: 1 << 20, Seed: 5})
				}
				errc <- err
			}()
			<-srv.entered
			cancel()
			require.Equal(t, codes.Canceled, status.Code(<-errc))
			require.ErrorIs(t, <-srv.ctxDone, context.Canceled)
			gdrcodec.ReleaseAll(req)
			requireSettled(t, "after the handler answered a cancelled call")
		})
	}
}

// Stop while a handler runs: the client gets Unavailable, the handler's
// later answer leaves nothing behind.
func TestStopMidCall(t *testing.T) {
	srv := newBlockingServer()
	r, gs, _ := lifecycleRig(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 3)))}
	go func() {
		_, err := r.client.Echo(ctx, req)
		errc <- err
	}()
	<-srv.entered
	stopped := make(chan struct{})
	go func() { gs.Stop(); close(stopped) }()
	require.Equal(t, codes.Unavailable, status.Code(<-errc))
	<-srv.ctxDone
	<-stopped
	gdrcodec.ReleaseAll(req)
	requireSettled(t, "after Stop mid-call")
}

// ClientConn closed while the handler runs.
func TestClientConnCloseMidCall(t *testing.T) {
	srv := newBlockingServer()
	r, _, _ := lifecycleRig(t, srv)
	errc := make(chan error, 1)
	req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 3)))}
	go func() {
		_, err := r.client.Echo(context.Background(), req)
		errc <- err
	}()
	<-srv.entered
	require.NoError(t, r.cc.Close())
	err := <-errc
	require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	<-srv.ctxDone
	gdrcodec.ReleaseAll(req)
	requireSettled(t, "after ClientConn.Close mid-call")
}

// waitPulls waits (bounded) for a pull to be under way.
func waitPulls(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool { return oob.ReadStats().Pulls > 0 }, 20*time.Second, 100*time.Microsecond, "a pull under way")
}

const bigPayload = 64 << 20

// The caller gives up while the server pulls the request's payload.
func TestCancelWhileServerPullsRequest(t *testing.T) {
	r, _, _ := lifecycleRig(t, &tensor.Server{})
	req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(bigPayload, 3)))}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := r.client.Digest(ctx, req); errc <- err }()
	waitPulls(t)
	cancel()
	err := <-errc
	require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	gdrcodec.ReleaseAll(req)
	requireSettled(t, "after a cancel mid request pull")
}

// The caller gives up while it pulls the response's payload, or closes
// its ClientConn then.
func TestCancelWhileClientPullsResponse(t *testing.T) {
	for _, closeCC := range []bool{false, true} {
		t.Run(fmt.Sprintf("close=%v", closeCC), func(t *testing.T) {
			r, _, _ := lifecycleRig(t, &tensor.Server{})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			var resp *tensorpb.Tensor
			go func() {
				var err error
				resp, err = r.client.Make(ctx, &tensorpb.Sized{Size: bigPayload, Seed: 4})
				errc <- err
			}()
			waitPulls(t)
			if closeCC {
				r.cc.Close()
			} else {
				cancel()
			}
			err := <-errc
			if err == nil {
				t.Logf("the pull finished first")
				checkSized(t, resp, bigPayload, 4)
			} else {
				require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
			}
			requireSettled(t, "after a cancel mid response pull")
		})
	}
}

// A client stream cancelled between its Sends: the server's Recv fails
// with Canceled and nothing is left.
// recvOneServer's Upload receives one message, closes got, and receives
// again (with waitEnd, once the call ended), its error to errc.
type recvOneServer struct {
	tensor.Server
	got     chan struct{}
	errc    chan error
	waitEnd bool
}

func (s *recvOneServer) Upload(st tensorpb.TensorService_UploadServer) error {
	m, err := st.Recv()
	if err != nil {
		s.errc <- err
		return err
	}
	gdrcodec.ReleaseAll(m)
	close(s.got)
	if s.waitEnd {
		<-st.Context().Done()
	}
	if m, err = st.Recv(); err == nil {
		gdrcodec.ReleaseAll(m)
	}
	s.errc <- err
	return err
}

func TestClientStreamCancelBetweenSends(t *testing.T) {
	srv := &recvOneServer{got: make(chan struct{}), errc: make(chan error, 1)}
	r, _, _ := lifecycleRig(t, srv)
	ctx, cancel := context.WithCancel(context.Background())
	st, err := r.client.Upload(ctx)
	require.NoError(t, err)
	m := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 3)))}
	require.NoError(t, st.Send(m))
	<-srv.got
	cancel()
	require.Equal(t, codes.Canceled, status.Code(<-srv.errc))
	m2 := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 4)))}
	err = st.Send(m2)
	require.Error(t, err)
	gdrcodec.ReleaseAll(m)
	gdrcodec.ReleaseAll(m2)
	_, err = st.CloseAndRecv()
	require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	requireSettled(t, "after a client stream cancelled between sends")
}

// A received buffer released twice, after Detach, and after the session
// closed.
func TestReleaseTwiceAndAfterClose(t *testing.T) {
	r, gs, _ := lifecycleRig(t, &tensor.Server{})
	m, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: 4})
	require.NoError(t, err)
	m2, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: 5})
	require.NoError(t, err)
	gdrcodec.ReleaseAll(m)
	gdrcodec.ReleaseAll(m)
	b := gdrcodec.Detach(m2.GetData())
	require.NotNil(t, b)
	gdrcodec.ReleaseAll(m2)
	r.cc.Close()
	gs.Stop()
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	b.Release()
	b.Release()
	requireSettled(t, "after releases")
}

// The listener's Shutdown while a handler runs: the call fails with
// Unavailable, Shutdown returns, nothing is left.
func TestListenerShutdownMidCall(t *testing.T) {
	srv := newBlockingServer()
	r, _, lis := lifecycleRig(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(1<<20, 3)))}
	defer gdrcodec.ReleaseAll(req)
	go func() { _, err := r.client.Echo(ctx, req); errc <- err }()
	<-srv.entered
	shut := make(chan error, 1)
	go func() { shut <- lis.Listener.(*transport.Listener).Shutdown(ctx) }()
	err := <-errc
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	<-srv.ctxDone
	require.NoError(t, <-shut)
	gdrcodec.ReleaseAll(req)
	requireSettled(t, "after Shutdown mid-call")
}

// GracefulStop (then the listener's Shutdown) while a payload is being
// pulled, the request's by the server or the response's by the client:
// the call completes, byte-exact.
func TestGracefulStopMidPull(t *testing.T) {
	for _, side := range []string{"request", "response"} {
		t.Run(side, func(t *testing.T) {
			r, gs, lis := lifecycleRig(t, &tensor.Server{})
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			errc := make(chan error, 1)
			var resp *tensorpb.Tensor
			var sum *tensorpb.Summary
			want := pattern(bigPayload, 3)
			req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(want))}
			defer gdrcodec.ReleaseAll(req)
			go func() {
				var err error
				if side == "request" {
					sum, err = r.client.Digest(ctx, req)
				} else {
					resp, err = r.client.Make(ctx, &tensorpb.Sized{Size: bigPayload, Seed: 3})
				}
				errc <- err
			}()
			waitPulls(t)
			stopped := make(chan struct{})
			go func() {
				gs.GracefulStop()
				_ = lis.Listener.(*transport.Listener).Shutdown(ctx)
				close(stopped)
			}()
			require.NoError(t, <-errc)
			if side == "request" {
				require.Equal(t, tensor.ChecksumBytes(want), sum.GetCrc32C())
			} else {
				checkSized(t, resp, bigPayload, 3)
			}
			select {
			case <-stopped:
			case <-ctx.Done():
				t.Fatal("GracefulStop/Shutdown did not return")
			}
			gdrcodec.ReleaseAll(req)
			requireSettled(t, "after GracefulStop mid pull")
		})
	}
}

// downloadWatch is Download that reports how its handler ended.
type downloadWatch struct {
	tensor.Server
	ended chan error
}

func (s *downloadWatch) Download(r *tensorpb.Sized, st tensorpb.TensorService_DownloadServer) error {
	err := s.Server.Download(r, st)
	s.ended <- err
	return err
}

// A server stream whose client never receives: its next message waits for
// the client's pulls (Limits.UnpulledBytes); the client then cancels. The
// handler's Send returns, and nothing is left.
func TestServerStreamUnreadThenCancel(t *testing.T) {
	srv := &downloadWatch{ended: make(chan error, 1)}
	r, _, _ := lifecycleRig(t, srv)
	const size = 1 << 20
	oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Limits: oob.Limits{UnpulledBytes: size}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: size, Seed: 1})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return oob.ReadStats().Waiting == 1 }, 10*time.Second, time.Millisecond, "a message waits")
	cancel()
	_, err = st.Recv()
	require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	tctx, tcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer tcancel()
	select {
	case err := <-srv.ended:
		require.Error(t, err)
	case <-tctx.Done():
		t.Fatal("the handler's Send did not return after the client cancelled")
	}
	requireSettled(t, "after an unread server stream was cancelled")
}

// A deadline passing while a payload is pulled (the request's by the
// server, the response's by the client) reports DeadlineExceeded.
func TestDeadlineMidPull(t *testing.T) {
	for _, side := range []string{"request", "response"} {
		t.Run(side, func(t *testing.T) {
			r, _, _ := lifecycleRig(t, &tensor.Server{})
			req := &tensorpb.Tensor{Data: gdrcodec.New(devicebuf.HostFromBytes(pattern(bigPayload, 3)))}
			defer gdrcodec.ReleaseAll(req)
			// Learn how long a pull takes, then set a deadline in its middle.
			start := time.Now()
			if side == "request" {
				_, err := r.client.Digest(context.Background(), req)
				require.NoError(t, err)
			} else {
				m, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: bigPayload, Seed: 3})
				require.NoError(t, err)
				gdrcodec.ReleaseAll(m)
			}
			took := time.Since(start)
			ctx, cancel := context.WithTimeout(context.Background(), took/2)
			defer cancel()
			var err error
			if side == "request" {
				_, err = r.client.Digest(ctx, req)
			} else {
				var m *tensorpb.Tensor
				m, err = r.client.Make(ctx, &tensorpb.Sized{Size: bigPayload, Seed: 3})
				if err == nil {
					gdrcodec.ReleaseAll(m)
				}
			}
			if err == nil {
				t.Skipf("the call beat its deadline (%v)", took/2)
			}
			require.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
			gdrcodec.ReleaseAll(req)
			requireSettled(t, "after a deadline mid pull")
		})
	}
}
