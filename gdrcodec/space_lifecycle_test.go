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
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

const spaceMiB = 1 << 20

// spaceLifecycleRig is a rig between trusted peers over UCX whose engine
// takes cfg (its metrics the rig's path counter, its timeout 20 s unless
// set), with serverOpts before the rig's own; it also returns the server.
func spaceLifecycleRig(t *testing.T, srv tensorpb.TensorServiceServer, serverOpts []grpc.ServerOption, cfg oob.TransferConfig, opts ...gdrpc.Option) (*rig, *grpc.Server) {
	t.Helper()
	r := newRigWith(t, transport.ModeUCX, srv, serverOpts, append([]gdrpc.Option{gdrpc.WithTrustPeers()}, opts...)...)
	cfg.Metrics = r.paths
	if cfg.Timeout == 0 {
		cfg.Timeout = 20 * time.Second
	}
	oob.SetTransferConfig(cfg)
	return r, r.server
}

// requireSpacesGone polls until no session, receive space (either way) or
// space byte is left, nor anything requireSettled looks at.
func requireSpacesGone(t *testing.T, what string) {
	t.Helper()
	requireSettled(t, what)
	err := leaktest.Poll(15*time.Second, func() error {
		st := oob.ReadStats()
		if n := transport.ReadStats().Sessions; n != 0 {
			return fmt.Errorf("%d sessions", n)
		}
		if st.Spaces != 0 || st.SpaceBytes != 0 || st.PeerSpaces != 0 || st.Making != 0 {
			return fmt.Errorf("%+v", st)
		}
		return nil
	})
	require.NoError(t, err, "%s: spaces left", what)
}

// cancelServer cancels the client's call (through cancel, set per call)
// right before its handler returns, so the call's end races with the
// response's marshal, which writes the payload into the client's space.
type cancelServer struct {
	tensor.Server
	mu     sync.Mutex
	cancel context.CancelFunc
}

func (s *cancelServer) setCancel(c context.CancelFunc) {
	s.mu.Lock()
	s.cancel = c
	s.mu.Unlock()
}

func (s *cancelServer) Make(ctx context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	m, err := tensor.Make(nil, r)
	if r.Seed%2 == 0 {
		s.mu.Lock()
		if s.cancel != nil {
			s.cancel()
		}
		s.mu.Unlock()
	}
	return m, err
}

// outPayloadCanceller is a server stats handler that cancels the client's
// call once the response was marshaled (written into the client's space),
// before the client decodes it.
type outPayloadCanceller struct{ s *cancelServer }

func (h outPayloadCanceller) HandleRPC(ctx context.Context, rs stats.RPCStats) {
	if _, ok := rs.(*stats.OutPayload); ok {
		h.s.mu.Lock()
		if h.s.cancel != nil {
			h.s.cancel()
		}
		h.s.mu.Unlock()
	}
}
func (outPayloadCanceller) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return ctx
}
func (outPayloadCanceller) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (outPayloadCanceller) HandleConn(context.Context, stats.ConnStats) {}

// A call cancelled (or out of time) while the server writes its response
// into the client's space, or right after the write and before the
// client's decode, leaves nothing taken: after many such calls the space
// still holds four payloads, and they carry the right bytes.
func TestSpaceLifecycleCancelDuringResponseWrite(t *testing.T) {
	srv := &cancelServer{}
	r, _ := spaceLifecycleRig(t, srv, []grpc.ServerOption{grpc.StatsHandler(outPayloadCanceller{srv})}, oob.TransferConfig{ReceiveSpace: 4 * spaceMiB})
	advertise(t, r, spaceMiB)
	for i := range 24 {
		ctx, cancel := context.WithCancel(context.Background())
		if i%3 == 2 {
			ctx, cancel = context.WithTimeout(context.Background(), time.Duration(i%5)*100*time.Microsecond)
		}
		srv.setCancel(cancel)
		m, err := r.client.Make(ctx, &tensorpb.Sized{Size: spaceMiB, Seed: uint32(2 * i)})
		srv.setCancel(nil)
		cancel()
		if err == nil {
			b, berr := tensor.Bytes(m.Data)
			require.NoError(t, berr)
			requireBytes(t, pattern(spaceMiB, uint32(2*i)), b)
			gdrcodec.ReleaseAll(m)
		} else {
			require.Contains(t, []codes.Code{codes.Canceled, codes.DeadlineExceeded}, status.Code(err), "%v", err)
		}
		requireNoneTaken(t, i)
	}
	requireSpaceWhole(t, r, 4, spaceMiB, 101)
	requireSettled(t, "after calls cancelled around the response's write")
}

// requireNoneTaken waits until no range of a receive space is taken or
// landed, either way, after round i.
func requireNoneTaken(t *testing.T, i int) {
	t.Helper()
	require.Eventually(t, func() bool {
		st := oob.ReadStats()
		return st.PeerTaken == 0 && st.Landed == 0
	}, 10*time.Second, time.Millisecond, "round %d: %+v", i, oob.ReadStats())
}

// requireSpaceWhole checks that k payloads of n bytes (seeds from seed)
// land in the client's space again, all of them held at once, then
// releases them: the whole space is the server's again.
func requireSpaceWhole(t *testing.T, r *rig, k, n int, seed uint32) {
	t.Helper()
	r.paths.reset()
	var held []*tensorpb.Tensor
	for i := range k {
		held = append(held, makeChecked(t, r, n, seed+uint32(i)))
	}
	require.Equal(t, map[string]int{"rdma@space": k}, r.paths.reset(), "the whole space is the server's again")
	for _, m := range held {
		gdrcodec.ReleaseAll(m)
	}
}

// A buffer that landed in the client's space, held past its session's end
// and released (twice) afterwards, keeps its bytes, and the space's memory
// (from a pool) goes back exactly once, when the last range is released.
func TestSpaceLifecycleReleaseAfterSessionClosed(t *testing.T) {
	pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 64 << 20, Oversize: true})
	require.NoError(t, err)
	defer pool.Close()
	r, _ := spaceLifecycleRig(t, nil, nil, oob.TransferConfig{ReceiveSpace: 8 * spaceMiB})
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(pool))
	t.Cleanup(func() { gdrcodec.Register() })
	advertise(t, r, spaceMiB)
	a := makeChecked(t, r, spaceMiB, 7)
	b := makeChecked(t, r, spaceMiB, 8)
	require.Equal(t, map[string]int{"rdma@space": 2}, r.paths.reset())
	require.NoError(t, r.cc.Close())
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, time.Millisecond)
	st := oob.ReadStats()
	require.Equal(t, 1, st.Spaces)
	require.Equal(t, 2, st.Landed)
	require.EqualValues(t, 8*spaceMiB, st.SpaceBytes)
	gdrcodec.ReleaseAll(a)
	gdrcodec.ReleaseAll(a)
	st = oob.ReadStats()
	require.Equal(t, 1, st.Spaces, "a range is still held: %+v", st)
	require.Equal(t, 1, st.Landed)
	bb, err := tensor.Bytes(b.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(spaceMiB, 8), bb)
	// Memory the pool hands out now must not be the space's.
	probe, err := pool.Alloc(8 * spaceMiB)
	require.NoError(t, err)
	pb, _ := probe.HostBytes()
	for i := range pb {
		pb[i] = 0xAB
	}
	bb, err = tensor.Bytes(b.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(spaceMiB, 8), bb)
	probe.Release()
	gdrcodec.ReleaseAll(b)
	gdrcodec.ReleaseAll(b)
	requireSpacesGone(t, "after buffers held past their session were released")
}

// streamer's Download sends messages of r.Size bytes until its stream ends
// or it sent count of them, and reports how many it sent on sent.
type streamer struct {
	tensor.Server
	count int
	sent  chan int
}

func (s *streamer) Download(r *tensorpb.Sized, st tensorpb.TensorService_DownloadServer) error {
	i := 0
	defer func() { s.sent <- i }()
	for ; i < s.count; i++ {
		m, err := tensor.Make(nil, &tensorpb.Sized{Size: r.Size, Seed: r.Seed + uint32(i)})
		if err != nil {
			return err
		}
		if err := st.Send(m); err != nil {
			gdrcodec.ReleaseAll(m)
			return err
		}
	}
	return nil
}

// A server stream writes many messages into the client's space while the
// client reads slowly, holding what it read; the client then cancels. Only
// the ranges the client holds stay taken, their bytes intact, and once
// released nothing is left; the space is whole again.
func TestSpaceLifecycleServerStreamSlowReaderCancels(t *testing.T) {
	srv := &streamer{count: 64, sent: make(chan int, 4)}
	r, _ := spaceLifecycleRig(t, srv, nil, oob.TransferConfig{ReceiveSpace: 8 * spaceMiB})
	advertise(t, r, spaceMiB)
	for round := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		st, err := r.client.Download(ctx, &tensorpb.Sized{Size: spaceMiB, Seed: 300})
		require.NoError(t, err)
		var held []*tensorpb.Tensor
		for i := range 3 {
			m, err := st.Recv()
			require.NoError(t, err)
			b, err := tensor.Bytes(m.Data)
			require.NoError(t, err)
			requireBytes(t, pattern(spaceMiB, 300+uint32(i)), b)
			held = append(held, m)
		}
		cancel()
		<-srv.sent
		require.Eventually(t, func() bool {
			st := oob.ReadStats()
			return st.PeerTaken <= 3 && st.Offered == 0 && st.Landed <= 3
		}, 10*time.Second, time.Millisecond, "round %d: %+v", round, oob.ReadStats())
		for i, m := range held {
			b, err := tensor.Bytes(m.Data)
			require.NoError(t, err)
			requireBytes(t, pattern(spaceMiB, 300+uint32(i)), b)
			gdrcodec.ReleaseAll(m)
		}
		requireSettled(t, fmt.Sprintf("round %d", round))
	}
	requireSpaceWhole(t, r, 8, spaceMiB, 400)
}

// A session closing (either end) while a server stream writes into the
// client's space leaves no space, range, or byte of space behind, and what
// the client held keeps its bytes.
func TestSpaceLifecycleCloseMidStream(t *testing.T) {
	for _, end := range []string{"client", "server"} {
		t.Run(end, func(t *testing.T) {
			srv := &streamer{count: 1 << 20, sent: make(chan int, 4)}
			r, gs := spaceLifecycleRig(t, srv, nil, oob.TransferConfig{ReceiveSpace: 8 * spaceMiB})
			advertise(t, r, spaceMiB)
			st, err := r.client.Download(context.Background(), &tensorpb.Sized{Size: spaceMiB, Seed: 500})
			require.NoError(t, err)
			var kept *tensorpb.Tensor
			for i := range 6 {
				m, err := st.Recv()
				require.NoError(t, err)
				b, err := tensor.Bytes(m.Data)
				require.NoError(t, err)
				requireBytes(t, pattern(spaceMiB, 500+uint32(i)), b)
				if i == 2 {
					kept = m
				} else {
					gdrcodec.ReleaseAll(m)
				}
			}
			if end == "client" {
				require.NoError(t, r.cc.Close())
			} else {
				gs.Stop()
			}
			for {
				m, err := st.Recv()
				if err != nil {
					break
				}
				gdrcodec.ReleaseAll(m)
			}
			<-srv.sent
			require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, time.Millisecond)
			b, err := tensor.Bytes(kept.Data)
			require.NoError(t, err)
			requireBytes(t, pattern(spaceMiB, 502), b)
			gdrcodec.ReleaseAll(kept)
			r.cc.Close()
			requireSpacesGone(t, "after a session closed mid-stream at the "+end)
		})
	}
}

// A client stream whose messages land in the server's request space,
// cancelled between Sends, leaves nothing taken on either side.

func TestSpaceLifecycleClientStreamCancelBetweenSends(t *testing.T) {
	srv := &recvOneServer{got: make(chan struct{}), errc: make(chan error, 1), waitEnd: true}
	r := requestSpaceRig(t, srv, 4*spaceMiB)
	r.paths.reset()
	r.paths.takePushes()
	ctx, cancel := context.WithCancel(context.Background())
	st, err := r.client.Upload(ctx)
	require.NoError(t, err)
	m := tensorOf(spaceMiB, 3)
	require.NoError(t, st.Send(m))
	<-srv.got
	m2 := tensorOf(spaceMiB, 4)
	require.NoError(t, st.Send(m2)) // lands in the server's space, unread
	cancel()
	// gRPC may still hand the handler the message it buffered before the
	// cancel: either is fine.
	require.Contains(t, []codes.Code{codes.OK, codes.Canceled}, status.Code(<-srv.errc))
	gdrcodec.ReleaseAll(m)
	gdrcodec.ReleaseAll(m2)
	_, err = st.CloseAndRecv()
	require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
	requireSettled(t, "after a client stream into request space cancelled between sends")
	r.paths.reset()
	require.Equal(t, map[string]int{"rdma@space": 2}, r.paths.takePushes(), "both messages landed in the server's space")
	// The server's space is whole again.
	for i := range 6 {
		digestChecked(t, r.client, spaceMiB, uint32(10+i))
		waitNothingTaken(t)
	}
	require.Equal(t, map[string]int{"rdma@space": 6}, r.paths.reset())
}

// Several sessions to one server (a dialer.Pool), each advertising a space:
// the process's spaces stay within Limits.SpaceBytes; a session past it
// pulls; every payload arrives right; when the pool closes, nothing is left.
func TestSpaceLifecyclePoolWithinSpaceBytes(t *testing.T) {
	r, _ := spaceLifecycleRig(t, nil, nil, oob.TransferConfig{ReceiveSpace: 4 * spaceMiB, Limits: oob.Limits{SpaceBytes: 8 * spaceMiB}})
	d := dialer.New(gdrpc.WithTransport(transport.ModeUCX), processEngine, gdrpc.WithTrustPeers())
	pool, err := dialer.NewPool(r.cc.Target(), 4, d.DialOptions(insecure.NewCredentials())...)
	require.NoError(t, err)
	c := tensorpb.NewTensorServiceClient(pool)
	for i := range 32 {
		m, err := c.Make(context.Background(), &tensorpb.Sized{Size: spaceMiB, Seed: uint32(i)})
		require.NoError(t, err)
		b, err := tensor.Bytes(m.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(spaceMiB, uint32(i)), b)
		gdrcodec.ReleaseAll(m)
		st := oob.ReadStats()
		require.LessOrEqual(t, st.SpaceBytes, int64(8*spaceMiB), "%+v", st)
	}
	waitSpacesMade(t)
	require.Equal(t, 2, oob.ReadStats().Spaces)
	require.NoError(t, pool.Close())
	require.NoError(t, r.cc.Close())
	requireSpacesGone(t, "after the pool closed")
}

// Large responses (32 MiB) whose call's deadline passes while the server
// writes them into the client's space: nothing stays taken, and the space
// is whole again afterwards.
func TestSpaceLifecycleDeadlineDuringLargeWrite(t *testing.T) {
	const n = 32 * spaceMiB
	r, _ := spaceLifecycleRig(t, nil, nil, oob.TransferConfig{ReceiveSpace: 4 * n})
	advertise(t, r, n)
	for i := range 12 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(1+i)*time.Millisecond)
		m, err := r.client.Make(ctx, &tensorpb.Sized{Size: n, Seed: uint32(i)})
		cancel()
		if err == nil {
			b, berr := tensor.Bytes(m.Data)
			require.NoError(t, berr)
			requireBytes(t, pattern(n, uint32(i)), b)
			gdrcodec.ReleaseAll(m)
		} else {
			require.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
		}
		requireNoneTaken(t, i)
	}
	requireSpaceWhole(t, r, 4, n, 50)
	requireSettled(t, "after deadlines passed during large writes")
}

// failFirstUpload fails a client stream's first attempt with Unavailable
// after it took (and released) the first message, which landed in its
// request space; gRPC then replays the stream's messages on a new attempt.
type failFirstUpload struct {
	tensor.Server
	firstSums chan uint32
}

func (f *failFirstUpload) Upload(st tensorpb.TensorService_UploadServer) error {
	md, _ := metadata.FromIncomingContext(st.Context())
	if len(md.Get("grpc-previous-rpc-attempts")) > 0 {
		return f.Server.Upload(st)
	}
	m, err := st.Recv()
	if err != nil {
		return err
	}
	sum, _, err := tensor.Checksum(m, 0)
	gdrcodec.ReleaseAll(m)
	if err != nil {
		return status.Errorf(codes.Internal, "checksum: %v", err)
	}
	f.firstSums <- sum
	return status.Error(codes.Unavailable, "the first attempt fails on purpose")
}

// A client stream under a retry policy whose first message landed in the
// server's request space, was taken and given back, and whose first attempt
// then failed: the replay pulls the payload by token, and the server sees
// the right bytes.
func TestSpaceLifecycleClientStreamRetriedAfterTaken(t *testing.T) {
	srv := &failFirstUpload{firstSums: make(chan uint32, 4)}
	r := requestSpaceRig(t, srv, 4*spaceMiB)
	c := anotherClient(t, r, grpc.WithDefaultServiceConfig(retryConfig))
	digestChecked(t, c, spaceMiB, 1) // this connection's server space
	waitPeerSpaces(t, 2)
	for round := range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		st, err := c.Upload(ctx)
		require.NoError(t, err)
		want := sendTensors(t, st, spaceMiB, 1, 700+uint32(round))
		sum, err := st.CloseAndRecv()
		cancel()
		require.NoError(t, err, "round %d", round)
		require.Equal(t, want, sum.Crc32C, "round %d", round)
		require.Equal(t, tensor.ChecksumBytes(pattern(spaceMiB, 700+uint32(round))), <-srv.firstSums)
		requireSettled(t, fmt.Sprintf("round %d", round))
	}
}

// A client that never releases its responses (default, growing spaces):
// the first space fills, later payloads take the rendezvous with the right
// bytes, no further space is made for payloads of the same size, and what
// the held buffers pin is the one space's bytes.
func TestSpaceLifecycleNeverReleasedFillsAndFallsBack(t *testing.T) {
	r, _ := spaceLifecycleRig(t, nil, nil, oob.TransferConfig{})
	advertise(t, r, spaceMiB)
	waitSpacesMade(t)
	st := oob.ReadStats()
	require.Equal(t, 1, st.Spaces)
	require.EqualValues(t, oob.DefaultReceiveSpace, st.SpaceBytes)
	var held []*tensorpb.Tensor
	for i := range oob.DefaultReceiveSpace/spaceMiB + 8 {
		held = append(held, makeChecked(t, r, spaceMiB, uint32(i)))
	}
	require.Equal(t, map[string]int{"rdma@space": oob.DefaultReceiveSpace / spaceMiB, "rdma": 8}, r.paths.reset())
	waitSpacesMade(t)
	st = oob.ReadStats()
	require.Equal(t, 1, st.Spaces, "%+v", st)
	require.EqualValues(t, oob.DefaultReceiveSpace, st.SpaceBytes)
	for i, m := range held {
		b, err := tensor.Bytes(m.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(spaceMiB, uint32(i)), b)
		gdrcodec.ReleaseAll(m)
	}
	requireSettled(t, "after the held responses were released")
}
