package gdrcodec_test

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// spaceRig is a rig between trusted peers whose client advertises space
// bytes of receive space.
func spaceRig(t *testing.T, space int) *rig { return spaceRigServing(t, nil, space) }

// spaceRigServing is spaceRig with srv as the server (nil: the tensor
// example's).
func spaceRigServing(t *testing.T, srv tensorpb.TensorServiceServer, space int) *rig {
	t.Helper()
	r := newRig(t, transport.ModeUCX, srv, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: space})
	return r
}

// makeChecked calls Make for n bytes of seed's pattern and checks what arrived.
func makeChecked(t *testing.T, r *rig, n int, seed uint32) *tensorpb.Tensor {
	t.Helper()
	got, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: uint64(n), Seed: seed})
	require.NoError(t, err)
	b, err := tensor.Bytes(got.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(n, seed), b)
	return got
}

// advertise makes r's client advertise its space (its first pull, of n
// bytes, prompts it), waits until the server took it, and forgets the paths
// so far.
func advertise(t *testing.T, r *rig, n int) {
	t.Helper()
	gdrcodec.ReleaseAll(makeChecked(t, r, n, 1))
	waitPeerSpace(t)
	r.paths.reset()
}

// waitPeerSpace waits until the server took the client's advertisement.
func waitPeerSpace(t *testing.T) {
	t.Helper()
	waitPeerSpaces(t, 1)
}

// waitSpacesMade waits until no receive space of this process is being made:
// a pull that prompts one starts its making before it returns, so a check
// that no space was made must come after this.
func waitSpacesMade(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool { return oob.ReadStats().Making == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
}

// waitPeerSpaces waits until this process's sessions took n advertisements
// of their peers.
func waitPeerSpaces(t *testing.T, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return oob.ReadStats().PeerSpaces == n }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
}

func TestReceiveSpace(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)

	// The first payload is pulled; the client then advertises 4 MiB of the
	// memory it landed in.
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 1))
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset())
	waitPeerSpace(t)
	require.Equal(t, 1, oob.ReadStats().Spaces)

	// The server writes the next ones into it while marshaling: four of 1 MiB
	// fill it, and a fifth, with the four held, takes the rendezvous.
	var held []*tensorpb.Tensor
	for i := range 4 {
		held = append(held, makeChecked(t, r, mib, uint32(10+i)))
	}
	require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset())
	for _, m := range held {
		// The application's message names neither the owner's token nor
		// the range of the space the payload landed in.
		d := m.GetData()
		require.True(t, d.GetSpace() == 0 && d.GetSpaceOffset() == 0 && d.GetSpaceGen() == 0 && d.GetSpacePath() == 0 && len(d.GetToken()) == 0 && len(d.GetOwner()) == 0, "%v", d)
	}
	require.Equal(t, 4, oob.ReadStats().Landed)
	require.Equal(t, 4, oob.ReadStats().PeerTaken)
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 20))
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset(), "space full: the rendezvous")
	for i, m := range held {
		b, err := tensor.Bytes(m.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(mib, uint32(10+i)), b) // not overwritten by the later calls
	}

	// Releasing the buffers gives their ranges back to the server.
	for _, m := range held {
		gdrcodec.ReleaseAll(m)
	}
	require.Equal(t, 0, oob.ReadStats().Landed)
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)

	// A payload larger than the free space, and a server stream's messages.
	gdrcodec.ReleaseAll(makeChecked(t, r, 5*mib, 30))
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset())
	st, err := r.client.Download(context.Background(), &tensorpb.Sized{Size: mib, Seed: 40})
	require.NoError(t, err)
	for i := range uint32(4) {
		m, err := st.Recv()
		require.NoError(t, err)
		b, err := tensor.Bytes(m.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(mib, 40+i), b)
		gdrcodec.ReleaseAll(m)
	}
	_, err = st.Recv()
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset())
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)

	// A buffer held past its session keeps the space's memory until it is
	// released; then nothing is left.
	kept := makeChecked(t, r, mib, 50)
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
	require.NoError(t, r.cc.Close())
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, time.Millisecond)
	require.Equal(t, 1, oob.ReadStats().Spaces)
	b, err := tensor.Bytes(kept.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(mib, 50), b)
	gdrcodec.ReleaseAll(kept)
	require.Eventually(t, func() bool {
		st := oob.ReadStats()
		return st.Spaces+st.Landed+st.PeerSpaces+st.PeerTaken == 0
	}, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
}

// A marked bytes field's pull sets aside no space (its destination is the
// field's own Go memory, not a receive allocator's), and later payloads do
// not touch the field.
func TestReceiveSpaceNotFromBytesFields(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)
	blob, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: mib, Seed: 3, Blob: true})
	require.NoError(t, err)
	requireBytes(t, pattern(mib, 3), blob.Blob)
	waitSpacesMade(t)
	require.Zero(t, oob.ReadStats().Spaces, "a bytes field's pull advertises nothing")
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 4))
	waitPeerSpace(t)
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 5))
	blob2, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: mib, Seed: 6, Blob: true})
	require.NoError(t, err)
	requireBytes(t, pattern(mib, 6), blob2.Blob)
	requireBytes(t, pattern(mib, 3), blob.Blob)
	require.Equal(t, map[string]int{"rdma": 3, "rdma@space": 1}, r.paths.reset())
}

// A client that advertises no space (WithReceiveSpace(0), here the engine's
// ReceiveSpace < 0) pulls every payload.
func TestReceiveSpaceOff(t *testing.T) {
	r := spaceRig(t, -1)
	for i := range 3 {
		gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, uint32(i)))
	}
	require.Equal(t, map[string]int{"rdma": 3}, r.paths.reset())
	waitSpacesMade(t)
	require.Zero(t, oob.ReadStats().Spaces)
}

// The space comes from the receive allocator the first pull used (here a
// pool of the client's), and goes back to it with the session.
func TestReceiveSpaceFromTheReceiveAllocator(t *testing.T) {
	pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 64 << 20, Oversize: true})
	require.NoError(t, err)
	defer pool.Close()
	r := spaceRig(t, 8<<20)
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(pool))
	t.Cleanup(func() { gdrcodec.Register() })
	gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, 1))
	waitPeerSpace(t)
	require.Equal(t, 1, pool.Stats().InUse, "the space's region")
	require.GreaterOrEqual(t, pool.Stats().BytesInUse, int64(8<<20))
	gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, 2))
	require.Equal(t, map[string]int{"rdma": 1, "rdma@space": 1}, r.paths.reset())
	require.NoError(t, r.cc.Close())
	require.Eventually(t, func() bool { return pool.Stats().InUse == 0 }, 10*time.Second, time.Millisecond)
}

// noneAbove reports whether no counter of d, the live objects now less
// those when a test began, is above zero: the test left nothing live.
// Objects of earlier tests that go meanwhile (a host pool that shrinks once
// idle, a registration its session's end lets go) take counters below.
func noneAbove(d devicebuf.Counters) bool {
	return max(d.HostBuffers, d.CUDABuffers, d.HostBytes, d.CUDABytes, d.PinnedRegions, d.Regions,
		d.Registrations, d.IPCMappings, d.Streams, d.Events) <= 0
}

// fakeGPUSpaceRig is a rig on a fake GPU between trusted peers whose
// payloads go by CUDA IPC: the server's in GPU memory, the client receiving
// into GPU memory with a 16 MiB space. closeAll closes the client and waits
// until no session, space or devicebuf object of the test is left.
func fakeGPUSpaceRig(t *testing.T, streamOrdered bool) (*devicebuftest.GPU, *rig, func()) {
	t.Helper()
	g := devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	base := devicebuf.Live()
	r := newRig(t, transport.ModeTCP, &tensor.Server{Alloc: gpu}, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Paths: oob.PathCUDAIPC, ReceiveSpace: 16 << 20, StreamOrdered: streamOrdered})
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	t.Cleanup(func() { gdrcodec.Register() })
	return g, r, func() {
		t.Helper()
		require.NoError(t, r.cc.Close())
		requireNothingLeft(t, base)
	}
}

// requireNothingLeft waits until no session, space or devicebuf object
// beyond base is left: a session leaves the registry before its spaces,
// their mappings, events and copy streams are closed.
func requireNothingLeft(tb testing.TB, base devicebuf.Counters) {
	tb.Helper()
	var sessions int
	var st oob.Stats
	if !assert.Eventually(tb, func() bool {
		sessions, st = transport.ReadStats().Sessions, oob.ReadStats()
		return sessions == 0 && st.Spaces+st.PeerSpaces == 0 && noneAbove(devicebuf.Live().Sub(base))
	}, 10*time.Second, time.Millisecond) {
		tb.Fatalf("left: %d sessions, %+v, %+v", sessions, st, devicebuf.Live().Sub(base))
	}
}

// GPU memory over CUDA IPC (a fake GPU): the client advertises a region of
// its GPU allocator's memory, the server copies into it device to device,
// and a received buffer goes back out (the server pulls it from the space).
// Once the session is gone, no GPU memory or IPC mapping is left.
func TestReceiveSpaceCUDAIPC(t *testing.T) {
	_, r, closeAll := fakeGPUSpaceRig(t, false)

	const n = 3<<20 + 5
	for i := range 4 {
		got := makeChecked(t, r, n, uint32(i))
		b, ok := gdrcodec.Buffer(got.Data)
		require.True(t, ok)
		require.Equal(t, devicebuf.CUDA, b.Kind())
		sum, err := r.client.Digest(context.Background(), got)
		require.NoError(t, err)
		require.Equal(t, tensor.ChecksumBytes(pattern(n, uint32(i))), sum.Crc32C)
		gdrcodec.ReleaseAll(got)
		if i == 0 {
			waitPeerSpaces(t, 2) // the client's, and the server's for requests (the rig configures both)
		}
	}
	require.Equal(t, 6, r.paths.takeQueued(), "the copies went unwaited for, marked by the receivers' events")
	require.Equal(t, map[string]int{"cuda-ipc": 2, "cuda-ipc@space": 6}, r.paths.reset(), "responses and requests after the first land")
	// Both ends closed: the server's mapping of the space (closed once its
	// session is), and the space.
	closeAll()
}

// With stream-ordered completion a payload the server's queued copy is
// still writing comes out Pending; its bytes are exact after Wait, and for
// work queued on a stream after WaitOn. The fake runs a queued copy only
// when something waits for it.
func TestReceiveSpaceStreamOrdered(t *testing.T) {
	g, r, closeAll := fakeGPUSpaceRig(t, true)

	const n = 1<<20 + 3
	gdrcodec.ReleaseAll(makeChecked(t, r, n, 1)) // pulled: the client then advertises
	waitPeerSpace(t)
	host, err := devicebuf.NewHostAllocator().Alloc(n)
	require.NoError(t, err)
	hb, _ := host.HostBytes()
	for i, wait := range []string{"Wait", "WaitOn"} {
		seed := uint32(i + 2)
		got, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: n, Seed: seed})
		require.NoError(t, err)
		b, ok := gdrcodec.Buffer(got.Data)
		require.True(t, ok)
		require.True(t, b.Pending(), wait)
		clear(hb)
		if wait == "Wait" {
			require.NoError(t, b.Wait())
			require.False(t, b.Pending())
			p, err := g.Peek(b.Ptr(), n)
			require.NoError(t, err)
			copy(hb, p)
		} else {
			s, err := devicebuf.NewStream(0)
			require.NoError(t, err)
			require.NoError(t, b.WaitOn(s))
			require.NoError(t, devicebuf.CopyAsync(s, host, b))
			require.NoError(t, s.Synchronize())
			require.NoError(t, s.Close())
		}
		requireBytes(t, pattern(n, seed), hb)
		gdrcodec.ReleaseAll(got)
	}
	require.NoError(t, host.Release())
	require.Equal(t, 2, r.paths.takeQueued())
	closeAll()
}

// A client that holds more payloads than its space has events
// (spaceEvents, 32): the server still queues every copy without waiting for
// it, the later copies sharing the events of held ranges, and every payload
// is exact, with either completion.
func TestReceiveSpaceEventsShared(t *testing.T) {
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream-ordered=%v", ordered), func(t *testing.T) {
			g, r, closeAll := fakeGPUSpaceRig(t, ordered)
			const n, held = 64<<10 + 7, 40
			gdrcodec.ReleaseAll(makeChecked(t, r, n, 1)) // pulled: the client then advertises
			waitPeerSpace(t)
			r.paths.reset()
			r.paths.takeQueued()
			var got []*tensorpb.Tensor
			defer releaseHeld(&got)
			for i := range held {
				m, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: n, Seed: uint32(i + 2)})
				require.NoError(t, err)
				got = append(got, m)
			}
			require.Equal(t, held, r.paths.takeQueued(), "copies the server queued, not waited for")
			require.Equal(t, map[string]int{"cuda-ipc@space": held}, r.paths.reset())
			if !ordered {
				for _, m := range got {
					b, _ := gdrcodec.Buffer(m.Data)
					require.False(t, b.Pending())
				}
			}
			checkHeld(t, g, &got, n)
			closeAll()
		})
	}
}

// checkHeld checks that each of held, Make's answers for seeds 2, 3, ...,
// is in GPU memory and exact once it arrived (Wait), then releases them.
func checkHeld(t *testing.T, g *devicebuftest.GPU, held *[]*tensorpb.Tensor, n int) {
	t.Helper()
	for i, m := range *held {
		b, ok := gdrcodec.Buffer(m.Data)
		require.True(t, ok)
		require.Equal(t, devicebuf.CUDA, b.Kind())
		require.NoError(t, b.Wait())
		p, err := g.Peek(b.Ptr(), n)
		require.NoError(t, err)
		requireBytes(t, pattern(n, uint32(i+2)), p)
	}
	releaseHeld(held)
}

// releaseHeld releases the messages in held, which it empties.
func releaseHeld(held *[]*tensorpb.Tensor) {
	for _, m := range *held {
		gdrcodec.ReleaseAll(m)
	}
	*held = nil
}

// Shared events, stream-ordered, against the copies' order: with the
// server's copy stream hung after 32 payloads landed, each payload queued
// behind the hang is Pending (its event, shared with a held payload's,
// marks its own copy, not the earlier one's), and every byte is exact once
// the stream runs on.
func TestReceiveSpaceEventsSharedInOrder(t *testing.T) {
	g, r, closeAll := fakeGPUSpaceRig(t, true)
	const n, first, more = 64<<10 + 7, 32, 8
	before := g.Streams()
	gdrcodec.ReleaseAll(makeChecked(t, r, n, 1)) // pulled: the client then advertises
	waitPeerSpace(t)
	r.paths.reset()
	var got []*tensorpb.Tensor
	defer releaseHeld(&got)
	call := func(i int) *tensorpb.Tensor {
		m, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: n, Seed: uint32(i + 2)})
		require.NoError(t, err)
		got = append(got, m)
		_, ok := gdrcodec.Buffer(m.Data)
		require.True(t, ok)
		return m
	}
	for i := range first { // every event marks a held range
		b, _ := gdrcodec.Buffer(call(i).Data)
		require.NoError(t, b.Wait())
	}
	require.Equal(t, map[string]int{"cuda-ipc@space": first}, r.paths.reset())
	// The copy queue's stream is the one stream made since the first call.
	var made []uintptr
	for _, h := range g.Streams() {
		if !slices.Contains(before, h) {
			made = append(made, h)
		}
	}
	require.Len(t, made, 1, "the copy queue's stream")
	release, err := g.Hang(made[0])
	require.NoError(t, err)
	defer release()
	s, err := devicebuf.NewStream(0)
	require.NoError(t, err)
	for i := first; i < first+more; i++ {
		b, _ := gdrcodec.Buffer(call(i).Data)
		// WaitOn asks the event first: a buffer whose event is complete
		// stops being Pending.
		require.NoError(t, b.WaitOn(s))
		require.True(t, b.Pending(), "payload %d, queued behind the hang, reported arrived", i)
	}
	require.Equal(t, more, r.paths.takeQueued()-first, "copies the server queued, not waited for")
	release()
	require.NoError(t, s.Synchronize())
	require.NoError(t, s.Close())
	checkHeld(t, g, &got, n)
	closeAll()
}

// With the default size a session's space grows with its payloads: a
// payload its space cannot hold twice, once pulled, prompts another space
// sized after it, and the next such payloads land there.
func TestReceiveSpaceGrows(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 0)
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 1))
	waitPeerSpace(t) // 64 MiB: four payloads of 1 MiB, at least the default
	first := makeChecked(t, r, 40*mib, 2)
	require.Equal(t, map[string]int{"rdma": 1, "rdma@space": 1}, r.paths.reset())
	second := makeChecked(t, r, 40*mib, 3) // 24 MiB free: pulled
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset())
	require.Eventually(t, func() bool { return oob.ReadStats().PeerSpaces == 2 }, 10*time.Second, time.Millisecond)
	waitSpacesMade(t)
	require.Equal(t, 2, oob.ReadStats().Spaces)
	third := makeChecked(t, r, 40*mib, 4)
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset(), "into the new space")
	for _, m := range []*tensorpb.Tensor{first, second, third} {
		gdrcodec.ReleaseAll(m)
	}
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)
	gdrcodec.ReleaseAll(makeChecked(t, r, 40*mib, 5))
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
	waitSpacesMade(t)
	require.Equal(t, 2, oob.ReadStats().Spaces, "two payloads fit now: no third space")
	require.Equal(t, 2, oob.ReadStats().PeerSpaces)
}

// nameServer answers Make with a tensor whose name is as long as the seed
// says: a response whose payload lands, and whose body then exceeds the
// server's send limit.
type nameServer struct{ tensor.Server }

func (s *nameServer) Make(ctx context.Context, r *tensorpb.Sized) (*tensorpb.Tensor, error) {
	t, err := s.Server.Make(ctx, &tensorpb.Sized{Size: r.Size, Seed: 1})
	if err == nil && r.Seed > 1 {
		t.Name = strings.Repeat("n", int(r.Seed))
	}
	return t, err
}

// A response whose payload was written into the client's space but which
// gRPC never sent (here: over the server's send limit) gives its range back
// at the call's end: the client, which never saw the descriptor, cannot.
func TestReceiveSpaceUnsentResponse(t *testing.T) {
	r := newRigWith(t, transport.ModeUCX, &nameServer{}, []grpc.ServerOption{grpc.MaxSendMsgSize(8 << 10)}, gdrpc.WithTrustPeers())
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Timeout: 20 * time.Second, ReceiveSpace: 4 << 20})
	gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, 1))
	waitPeerSpace(t)
	r.paths.reset()
	for range 5 { // more than the space holds, were the ranges not given back
		_, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: 16 << 10})
		require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		require.Equal(t, map[string]int{}, r.paths.reset(), "the client pulled nothing")
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)
	}
	gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, 1))
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}

// A new session (a client or server that restarted) starts without space:
// its first payload is pulled, and the client advertises again.
func TestReceiveSpaceAfterRestart(t *testing.T) {
	for round := range 2 {
		r := spaceRig(t, 4<<20)
		gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, uint32(round)))
		waitPeerSpace(t)
		gdrcodec.ReleaseAll(makeChecked(t, r, 1<<20, uint32(round+10)))
		require.Equal(t, map[string]int{"rdma": 1, "rdma@space": 1}, r.paths.reset(), "round %d", round)
		require.NoError(t, r.cc.Close())
		require.Eventually(t, func() bool {
			st := oob.ReadStats()
			return transport.ReadStats().Sessions == 0 && st.Spaces+st.PeerSpaces == 0
		}, 10*time.Second, time.Millisecond)
	}
}

// Each session to a server gets its own space, and a unary response's pulls
// take its call's session: calls on a second connection land in the space
// advertised over it, not over the first.
func TestReceiveSpacePerSession(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)
	r2 := &rig{client: anotherClient(t, r), paths: r.paths}
	for i := range 3 {
		for _, rr := range []*rig{r, r2} {
			gdrcodec.ReleaseAll(makeChecked(t, rr, mib, uint32(i)))
		}
		if i == 0 {
			require.Equal(t, map[string]int{"rdma": 2}, r.paths.reset(), "each connection's first response is pulled")
			require.Eventually(t, func() bool { return oob.ReadStats().PeerSpaces == 2 }, 10*time.Second, time.Millisecond)
		}
	}
	require.Equal(t, map[string]int{"rdma@space": 4}, r.paths.reset())
	waitSpacesMade(t)
	require.Equal(t, 2, oob.ReadStats().Spaces)
}

// A payload the client refuses (over its receive limit) after the server
// wrote it into the client's space gives its range back at once.
func TestReceiveSpaceRefusedPayload(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)
	advertise(t, r, mib)
	gdrcodec.Register(gdrcodec.WithMaxReceivePayload(mib / 2))
	t.Cleanup(func() { gdrcodec.Register() })
	for range 5 { // more than the space holds, were the ranges not given back
		_, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 2 * mib, Seed: 2})
		require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)
	}
	require.Empty(t, r.paths.reset(), "nothing taken")
	gdrcodec.Register()
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 3))
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}

// A response whose payload the server wrote into the client's space, but
// which the client never decoded, gives its range back once the call ends:
// a unary response refused before decoding (over the call's receive size),
// and the messages of a server stream the client cancelled after the first.
func TestReceiveSpaceUndecodedResponse(t *testing.T) {
	const mib = 1 << 20
	r := spaceRig(t, 4*mib)
	advertise(t, r, mib)
	for range 5 { // more than the space holds, were the ranges not given back
		_, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: mib, Seed: 2}, grpc.MaxCallRecvMsgSize(16))
		require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
		require.Equal(t, map[string]int{}, r.paths.reset(), "the client decoded nothing")
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	}

	ctx, cancel := context.WithCancel(context.Background())
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: mib, Seed: 40})
	require.NoError(t, err)
	first, err := st.Recv()
	require.NoError(t, err)
	b, err := tensor.Bytes(first.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(mib, 40), b)
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 4 }, 10*time.Second, time.Millisecond, "the server wrote its four messages")
	cancel()
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 1 }, 10*time.Second, time.Millisecond, "only the range the client took is left: %+v", oob.ReadStats())
	require.Equal(t, 1, oob.ReadStats().Landed)
	gdrcodec.ReleaseAll(first)
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())

	requireSpaceWhole(t, r, 4, mib, 50)
}

// lateSender's Download sends one message, waits for the client to cancel,
// then sends another (a handler that has not noticed yet) and reports that
// second send's outcome on sent.
type lateSender struct {
	tensor.Server
	sent chan error
}

func (s *lateSender) Download(r *tensorpb.Sized, st tensorpb.TensorService_DownloadServer) error {
	m, err := tensor.Make(nil, r)
	if err != nil {
		return err
	}
	if err := st.Send(m); err != nil {
		return err
	}
	<-st.Context().Done()
	m2, err := tensor.Make(nil, &tensorpb.Sized{Size: r.Size, Seed: r.Seed + 1})
	if err != nil {
		return err
	}
	err = st.Send(m2)
	if err != nil {
		gdrcodec.ReleaseAll(m2) // not sent: still the handler's
	}
	s.sent <- err
	return nil
}

// A message a handler sends after the client cancelled the stream leaves
// nothing behind: whether it landed in the client's space before the
// client's CALL-ENDED was handled or was offered after, its range and its
// outbox entry go.
func TestReceiveSpaceSendAfterCancel(t *testing.T) {
	const mib = 1 << 20
	srv := &lateSender{sent: make(chan error, 1)}
	r := spaceRigServing(t, srv, 4*mib)
	advertise(t, r, mib)
	for round := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		st, err := r.client.Download(ctx, &tensorpb.Sized{Size: mib, Seed: 40})
		require.NoError(t, err)
		first, err := st.Recv()
		require.NoError(t, err)
		cancel()
		<-srv.sent
		require.Eventually(t, func() bool {
			st := oob.ReadStats()
			return st.PeerTaken == 1 && st.Offered == 0
		}, 10*time.Second, time.Millisecond, "round %d: only the range the client took: %+v", round, oob.ReadStats())
		b, err := tensor.Bytes(first.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(mib, 40), b)
		gdrcodec.ReleaseAll(first)
		require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond)
	}
	r.paths.reset()
	gdrcodec.ReleaseAll(makeChecked(t, r, mib, 3))
	require.Equal(t, map[string]int{"rdma@space": 1}, r.paths.reset())
}

// advertisedSender's Download sends one message, waits until the client's
// receive space reached the server (its first message's pull prompts it),
// sends two more, which land in it, and reports on sent.
type advertisedSender struct {
	tensor.Server
	sent chan error
}

func (s *advertisedSender) Download(r *tensorpb.Sized, st tensorpb.TensorService_DownloadServer) error {
	for i := range uint32(3) {
		if i == 1 {
			for oob.ReadStats().PeerSpaces == 0 {
				select {
				case <-st.Context().Done():
					return st.Context().Err()
				case <-time.After(time.Millisecond):
				}
			}
		}
		m, err := tensor.Make(nil, &tensorpb.Sized{Size: r.Size, Seed: r.Seed + i})
		if err != nil {
			return err
		}
		if err := st.Send(m); err != nil {
			gdrcodec.ReleaseAll(m)
			s.sent <- err
			return err
		}
	}
	s.sent <- nil
	<-st.Context().Done()
	return nil
}

// A call made before the client advertised its first space (a stream whose
// first message's pull prompts the advertisement) still gets back what was
// written into the space for it and never decoded.
func TestReceiveSpaceFirstCall(t *testing.T) {
	const mib = 1 << 20
	srv := &advertisedSender{sent: make(chan error, 1)}
	r := spaceRigServing(t, srv, 4*mib)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: mib, Seed: 60})
	require.NoError(t, err)
	first, err := st.Recv()
	require.NoError(t, err)
	require.NoError(t, <-srv.sent)
	require.Equal(t, 2, oob.ReadStats().PeerTaken, "the second and third messages landed")
	cancel()
	require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond, "%+v", oob.ReadStats())
	b, err := tensor.Bytes(first.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(mib, 60), b)
	gdrcodec.ReleaseAll(first)
	require.Equal(t, map[string]int{"rdma": 1}, r.paths.reset(), "the first message was pulled")
}
