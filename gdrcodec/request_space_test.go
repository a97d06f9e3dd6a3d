package gdrcodec_test

import (
	"context"
	"hash/crc32"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// retryConfig retries TensorService calls that fail with Unavailable.
const retryConfig = `{"methodConfig": [{
  "name": [{"service": "gdrpc.examples.tensor.TensorService"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
}]}`

// refusingRig is a rig between trusted peers, with space bytes of receive
// space both ways, whose server refuses a call of method with Unavailable
// before reading it whenever refuse is set (and clears it).
func refusingRig(t *testing.T, method string, refuse *atomic.Bool, space int) *rig {
	t.Helper()
	tapH := grpc.InTapHandle(func(ctx context.Context, info *tap.Info) (context.Context, error) {
		if info.FullMethodName == "/gdrpc.examples.tensor.TensorService/"+method && refuse.CompareAndSwap(true, false) {
			return nil, status.Error(codes.Unavailable, "busy")
		}
		return ctx, nil
	})
	r := newRigWith(t, transport.ModeUCX, nil, []grpc.ServerOption{tapH}, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: space})
	return r
}

// anotherClient is a client of r's server over a connection of its own,
// trusted, with opts.
func anotherClient(t *testing.T, r *rig, opts ...grpc.DialOption) tensorpb.TensorServiceClient {
	t.Helper()
	return anotherClientIn(t, r, transport.ModeUCX, opts...)
}

// anotherClientIn is anotherClient over sessions in mode (between trusted
// peers all the same).
func anotherClientIn(t *testing.T, r *rig, mode transport.Mode, opts ...grpc.DialOption) tensorpb.TensorServiceClient {
	t.Helper()
	d := dialer.New(gdrpc.WithTransport(mode), processEngine, gdrpc.WithTrustPeers())
	cc, err := grpc.NewClient(r.cc.Target(), append(d.DialOptions(insecure.NewCredentials()), opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return tensorpb.NewTensorServiceClient(cc)
}

// tensorOf returns a request carrying n bytes of seed's pattern in host
// memory.
func tensorOf(n int, seed uint32) *tensorpb.Tensor {
	b := devicebuf.HostFromBytes(pattern(n, seed))
	defer b.Release()
	return &tensorpb.Tensor{Name: "req", Data: gdrcodec.New(b)}
}

// digestChecked calls Digest with n bytes of seed's pattern and checks the
// server's checksum of what arrived.
func digestChecked(t *testing.T, c tensorpb.TensorServiceClient, n int, seed uint32) {
	t.Helper()
	req := tensorOf(n, seed)
	defer gdrcodec.ReleaseAll(req)
	sum, err := c.Digest(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, uint64(n), sum.Bytes)
	require.Equal(t, tensor.ChecksumBytes(pattern(n, seed)), sum.Crc32C)
}

// requestSpaceRig is a rig between trusted peers whose server advertises
// space bytes of receive space for requests (and whose client advertises as
// much for responses), after the first request it pulled.
func requestSpaceRig(t *testing.T, srv tensorpb.TensorServiceServer, space int) *rig {
	t.Helper()
	r := spaceRigServing(t, srv, space)
	digestChecked(t, r.client, 1<<20, 1)
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset(), "the first request is pulled")
	waitPeerSpace(t)
	return r
}

// A server configured with receive space advertises it after the first
// request it pulled; the client then writes unary requests' payloads there
// while marshaling them, and the server takes them without a rendezvous.
// Each range is given back once the handler let go of the request.
func TestRequestSpace(t *testing.T) {
	const mib = 1 << 20
	r := requestSpaceRig(t, nil, 4*mib)
	for i := range 6 { // more than the space holds, were the ranges not given back
		digestChecked(t, r.client, mib, uint32(10+i))
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	}
	require.Equal(t, map[string]int{"rdma@space": 6}, r.paths.reset())
	require.Equal(t, 0, oob.ReadStats().Landed)

	// Larger than the space: pulled by token.
	digestChecked(t, r.client, 5*mib, 20)
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset())
}

// A server given a limit instead of a size grows its space for requests with
// the payloads: a quarter of the limit after the first pull (four 1 MiB
// payloads fit), another space sized after a payload that did not fit, and
// none past the limit.
func TestRequestSpaceGrows(t *testing.T) {
	const mib = 1 << 20
	r := newRig(t, transport.ModeUCX, nil, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpaceLimit: 16 * mib})
	digestChecked(t, r.client, mib, 1)
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset(), "the first request is pulled")
	waitPeerSpaces(t, 1)
	require.Equal(t, 1, oob.ReadStats().Spaces)

	// Each range is back before the next call (the server's SPACE-FREE may
	// trail its response): the spaces hold the payloads one at a time.
	digestChecked(t, r.client, mib, 2)
	waitNothingTaken(t)
	digestChecked(t, r.client, 3*mib, 3)
	waitNothingTaken(t)
	require.Equal(t, map[string]int{"rdma@space": 2}, r.paths.reset(), "the 4 MiB space holds them")

	// 5 MiB does not fit: pulled, and the server adds room for more, 12 MiB
	// (four would be 20, the limit leaves 12).
	digestChecked(t, r.client, 5*mib, 4)
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset())
	waitPeerSpaces(t, 2)
	for i := range 3 {
		digestChecked(t, r.client, 5*mib, uint32(5+i))
		waitNothingTaken(t)
	}
	require.Equal(t, map[string]int{"rdma@space": 3}, r.paths.reset())

	// 13 MiB fits no space, and the limit has no room left for another.
	digestChecked(t, r.client, 13*mib, 9)
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset())
	waitSpacesMade(t)
	require.Equal(t, 2, oob.ReadStats().Spaces, "no space past the limit")
	require.Equal(t, 2, oob.ReadStats().PeerSpaces)
}

// Limits.SpaceBytes bounds the spaces a process advertises over all its
// sessions together: a space that would put them over it is not made (the
// payloads are pulled), and the bytes come back when a space is freed.
func TestRequestSpaceProcessBound(t *testing.T) {
	const mib = 1 << 20
	r := newRig(t, transport.ModeUCX, nil, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpaceLimit: 16 * mib, Limits: oob.Limits{SpaceBytes: 6 * mib}})
	digestChecked(t, r.client, mib, 1)
	waitPeerSpaces(t, 1)
	require.Equal(t, int64(4*mib), oob.ReadStats().SpaceBytes, "a quarter of the session's limit")

	// 5 MiB does not fit the space; the 12 MiB space the session's limit
	// leaves room for would put the process over its bound: none is made.
	for i := range 2 {
		digestChecked(t, r.client, 5*mib, uint32(2+i))
	}
	require.Equal(t, map[string]int{"rdma": 3}, r.paths.reset())
	waitSpacesMade(t)
	require.Equal(t, 1, oob.ReadStats().Spaces)
	require.Equal(t, int64(4*mib), oob.ReadStats().SpaceBytes)

	// The session goes, its space is freed, and another session gets one.
	require.NoError(t, r.cc.Close())
	require.Eventually(t, func() bool { return oob.ReadStats().SpaceBytes == 0 && transport.ReadStats().Sessions == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	second := anotherClient(t, r)
	digestChecked(t, second, mib, 4)
	waitPeerSpaces(t, 1)
	require.Equal(t, int64(4*mib), oob.ReadStats().SpaceBytes)
	digestChecked(t, second, mib, 5)
	require.Equal(t, map[string]int{"rdma": 1, "rdma@space": 1}, r.paths.reset())
}

// A request the server never decodes (a method it does not serve) leaves its
// range with the server only; the call's end tells the server, which gives
// it back.
func TestRequestSpaceUndecoded(t *testing.T) {
	const mib = 1 << 20
	r := requestSpaceRig(t, nil, 4*mib)
	for range 6 { // more than the space holds, were the ranges not given back
		req := tensorOf(mib, 2)
		var out tensorpb.Summary
		err := r.cc.Invoke(context.Background(), "/gdrpc.examples.tensor.TensorService/Absent", req, &out)
		require.Equal(t, codes.Unimplemented, status.Code(err), "%v", err)
		gdrcodec.ReleaseAll(req)
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	}
	require.Empty(t, r.paths.reset(), "the server pulled nothing")
	digestChecked(t, r.client, mib, 3)
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}

// failFirst fails the first attempt of every Digest with Unavailable after
// it checked the request's payload, and records the checksum each attempt
// saw.
type failFirst struct {
	tensor.Server
	sums chan uint32
}

func (f *failFirst) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if len(md.Get("grpc-previous-rpc-attempts")) > 0 || t.Name == "warm-up" {
		return f.Server.Digest(ctx, t)
	}
	defer gdrcodec.ReleaseAll(t)
	sum, _, err := tensor.Checksum(t, 0)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "checksum: %v", err)
	}
	f.sums <- sum
	return nil, status.Error(codes.Unavailable, "the first attempt fails on purpose")
}

// gRPC replays a request whose payload landed in the server's space after
// the server took it: the replay names a range given back (or still held),
// so the server pulls the payload by its token instead, and both attempts
// see the right bytes. A call that succeeded on that session leaves nothing
// taken.
func TestRequestSpaceRetry(t *testing.T) {
	const mib = 1 << 20
	srv := &failFirst{sums: make(chan uint32, 8)}
	r := spaceRigServing(t, srv, 4*mib)
	c := anotherClient(t, r, grpc.WithDefaultServiceConfig(retryConfig))
	warm := tensorOf(mib, 1)
	warm.Name = "warm-up"
	_, err := c.Digest(context.Background(), warm)
	require.NoError(t, err)
	gdrcodec.ReleaseAll(warm)
	waitPeerSpace(t)
	r.paths.reset()
	for i := range 3 {
		digestChecked(t, c, mib, uint32(30+i))
		require.Equal(t, tensor.ChecksumBytes(pattern(mib, uint32(30+i))), <-srv.sums, "the first attempt's bytes")
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	}
	require.Equal(t, map[string]int{"rdma@space": 3, "rdma": 3}, r.paths.reset(), "each replay pulled by token")
}

// waitNothingTaken waits until the server gave back every range of its space
// the client wrote into.
func waitNothingTaken(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
}

// A call that succeeds on the session its request landed over may still
// leave the write untaken: here the server's request type has no such
// field, and decodes the request without it. The call's end names the write
// all the same, and the server gives it back.
func TestRequestSpaceFieldUnknownToServer(t *testing.T) {
	const mib = 1 << 20
	r := requestSpaceRig(t, nil, 4*mib)
	for i := range 6 { // more than the space holds, were the ranges not given back
		req := tensorOf(mib, uint32(40+i))
		var out tensorpb.Tensor
		require.NoError(t, r.cc.Invoke(context.Background(), "/gdrpc.examples.tensor.TensorService/Make", req, &out))
		gdrcodec.ReleaseAll(req)
		gdrcodec.ReleaseAll(&out)
		waitNothingTaken(t)
	}
	r.paths.reset()
	digestChecked(t, r.client, mib, 3)
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}

// An interceptor chained after gdrpc's that invokes the call again (a retry
// middleware of the application's) marshals the request once per attempt
// under one call: each attempt's write is named at the call's end, the one
// the server refused before decoding it too.
func TestRequestSpaceMarshaledTwice(t *testing.T) {
	const mib = 1 << 20
	var refuse atomic.Bool
	r := refusingRig(t, "Digest", &refuse, 4*mib)
	again := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if status.Code(err) == codes.Unavailable {
			err = invoker(ctx, method, req, reply, cc, opts...)
		}
		return err
	}
	c := anotherClient(t, r, grpc.WithChainUnaryInterceptor(again))
	digestChecked(t, c, mib, 1) // pulled; the server advertises
	waitPeerSpace(t)
	r.paths.reset()
	for i := range 3 {
		refuse.Store(true)
		digestChecked(t, c, mib, uint32(2+i))
		require.False(t, refuse.Load(), "the first attempt was refused")
		waitNothingTaken(t)
	}
	require.Equal(t, map[string]int{"rdma@space": 3}, r.paths.reset(), "the second attempts' writes")
}

// A client stream's messages land in the server's space as unary requests
// do. Without a retry policy nothing replays them, so each payload leaves
// the outbox once the server gave its range back, while the stream goes on.
func TestRequestSpaceStream(t *testing.T) {
	const mib = 1 << 20
	r := requestSpaceRig(t, nil, 4*mib)
	st, err := r.client.Upload(context.Background())
	require.NoError(t, err)
	var want uint32
	for i := range 6 {
		p := pattern(mib, uint32(60+i))
		want = crc32.Update(want, crc32.MakeTable(crc32.Castagnoli), p)
		req := tensorOf(mib, uint32(60+i))
		require.NoError(t, st.Send(req))
		gdrcodec.ReleaseAll(req)
		// The server checksums and releases each message as it comes: the
		// range goes back, and with it the payload's outbox entry.
		waitNothingTaken(t)
		require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	}
	sum, err := st.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, uint64(6*mib), sum.Bytes)
	require.Equal(t, want, sum.Crc32C)
	require.Equal(t, map[string]int{"rdma@space": 6}, r.paths.reset())
}

// readOne reads the first message of an upload and answers at once.
type readOne struct{ tensor.Server }

func (*readOne) Upload(st tensorpb.TensorService_UploadServer) error {
	t, err := st.Recv()
	if err != nil {
		return err
	}
	gdrcodec.ReleaseAll(t)
	return st.SendAndClose(&tensorpb.Summary{Name: "first only"})
}

// A stream's messages the server never read (its handler returned first)
// leave their ranges with the server only; the stream's end names them, and
// the server gives them back.
func TestRequestSpaceStreamUnread(t *testing.T) {
	const mib = 1 << 20
	r := requestSpaceRig(t, &readOne{}, 4*mib)
	for range 3 { // more than the space holds, were the ranges not given back
		st, err := r.client.Upload(context.Background())
		require.NoError(t, err)
		for i := range 3 {
			req := tensorOf(mib, uint32(70+i))
			err := st.Send(req)
			gdrcodec.ReleaseAll(req)
			if err != nil {
				require.ErrorIs(t, err, io.EOF, "the server answered already")
				break
			}
		}
		sum, err := st.CloseAndRecv()
		require.NoError(t, err)
		require.Equal(t, "first only", sum.Name)
		waitNothingTaken(t)
		require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	}
}

// A stream the server refuses before reading it (its first attempt) is
// retried under a retry policy, its messages replayed on a new attempt: the
// interceptors do not commit gRPC's attempt. The replayed payloads, in the
// server's space already, are taken there.
func TestRequestSpaceStreamRetried(t *testing.T) {
	const mib = 1 << 20
	var refuse atomic.Bool
	r := refusingRig(t, "Upload", &refuse, 4*mib)
	c := anotherClient(t, r, grpc.WithDefaultServiceConfig(retryConfig))
	digestChecked(t, c, mib, 1) // pulled; the server advertises
	waitPeerSpace(t)
	r.paths.reset()
	refuse.Store(true)
	st, err := c.Upload(context.Background())
	require.NoError(t, err)
	want := sendTensors(t, st, mib, 2, 90)
	sum, err := st.CloseAndRecv()
	require.NoError(t, err)
	require.False(t, refuse.Load(), "the first attempt was refused")
	require.Equal(t, want, sum.Crc32C)
	waitNothingTaken(t)
	require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	require.Equal(t, map[string]int{"rdma@space": 2}, r.paths.reset())
}

// stallUpload never reads its stream: the client's payloads stay unpulled
// until the stream ends.
type stallUpload struct {
	tensor.Server
	started chan struct{}
}

func (s *stallUpload) Upload(st tensorpb.TensorService_UploadServer) error {
	s.started <- struct{}{}
	<-st.Context().Done()
	return st.Context().Err()
}

// A stream gRPC ends by itself, the application neither cancelling it nor
// reading to its end (gRPC's contract allows both), lets go of its payloads:
// the ClientConn closed, or a send failed. Payloads written into the
// server's space are named, and given back.
func TestRequestSpaceStreamEndedByGRPC(t *testing.T) {
	const mib = 1 << 20
	srv := &stallUpload{started: make(chan struct{}, 1)}
	t.Run("send failed", func(t *testing.T) {
		r := requestSpaceRig(t, srv, 4*mib)
		waitNothingTaken(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel() // only at the test's end
		st, err := r.client.Upload(ctx, grpc.MaxCallSendMsgSize(4096))
		require.NoError(t, err)
		req := tensorOf(mib, 1)
		require.NoError(t, st.Send(req)) // a descriptor on the wire: it fits
		gdrcodec.ReleaseAll(req)
		<-srv.started
		require.Equal(t, 1, oob.ReadStats().PeerTaken, "landed")
		err = st.Send(&tensorpb.Tensor{Name: strings.Repeat("x", 8192)})
		require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		waitNothingTaken(t)
		require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	})
	t.Run("conn closed", func(t *testing.T) {
		r := newRig(t, transport.ModeUCX, srv)
		st, err := r.client.Upload(context.Background())
		require.NoError(t, err)
		req := tensorOf(mib, 1)
		require.NoError(t, st.Send(req))
		gdrcodec.ReleaseAll(req)
		<-srv.started
		require.Equal(t, 1, oob.ReadStats().Offered)
		require.NoError(t, r.cc.Close())
		require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	})
}

// keepAll keeps every message of an upload until the stream's end, as a
// handler that gathers a stream's tensors before it uses them does.
type keepAll struct{ tensor.Server }

func (*keepAll) Upload(st tensorpb.TensorService_UploadServer) error {
	var kept []*tensorpb.Tensor
	defer func() {
		for _, m := range kept {
			gdrcodec.ReleaseAll(m)
		}
	}()
	for {
		m, err := st.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		kept = append(kept, m)
	}
	var sum uint32
	var n uint64
	for _, m := range kept {
		var k uint64
		var err error
		if sum, k, err = tensor.Checksum(m, sum); err != nil {
			return status.Error(codes.Internal, err.Error())
		}
		n += k
	}
	return st.SendAndClose(&tensorpb.Summary{Bytes: n, Crc32C: sum})
}

// The payloads a client stream writes into the server's request space wait
// for no pull: a server that keeps them until the stream's end holds the
// stream back no matter how far past Limits.UnpulledBytes they add up.
func TestRequestSpaceStreamKeptByServer(t *testing.T) {
	const mib = 1 << 20
	r := requestSpaceRig(t, &keepAll{}, 8*mib)
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: 8 * mib,
		Limits: oob.Limits{UnpulledBytes: mib}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := r.client.Upload(ctx)
	require.NoError(t, err)
	want := sendTensors(t, st, mib, 4, 70)
	sum, err := st.CloseAndRecv()
	require.NoError(t, err)
	require.Equal(t, uint64(4*mib), sum.Bytes)
	require.Equal(t, want, sum.Crc32C)
	require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset())
	waitNothingTaken(t)
}

// sendTensors sends count tensors of n bytes on st, of the patterns of seeds
// seed, seed+1, ..., and returns their CRC-32C, as the server computes it.
func sendTensors(t *testing.T, st tensorpb.TensorService_UploadClient, n, count int, seed uint32) uint32 {
	t.Helper()
	var want uint32
	for i := range uint32(count) {
		want = crc32.Update(want, crc32.MakeTable(crc32.Castagnoli), pattern(n, seed+i))
		req := tensorOf(n, seed+i)
		require.NoError(t, st.Send(req))
		gdrcodec.ReleaseAll(req)
	}
	return want
}
