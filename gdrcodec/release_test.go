package gdrcodec_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Payloads received into GPU memory over CUDA IPC are freed when released: the
// owner's mapping of the receiver's allocation ends with the transfer, so once the
// calls are over (and the client released what it received) no GPU buffer, byte
// or IPC mapping is left, while the sessions live on.
func TestGPUBuffersFreedOnRelease(t *testing.T) {
	devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	r := newRig(t, transport.ModeTCP, &tensor.Server{Alloc: gpu}, gdrpc.WithTrustPeers())                 // CUDA IPC only with trusted peers
	oob.SetTransferConfig(oob.TransferConfig{Metrics: r.paths, Paths: oob.PathCUDAIPC, ReceiveSpace: -1}) // space_test.go has the space's
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(gpu))
	t.Cleanup(func() { gdrcodec.Register() })

	const calls, n = 40, 1 << 20
	want := tensor.ChecksumBytes(pattern(n, 7))
	base := devicebuf.Live()
	for range calls {
		got, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: n, Seed: 7})
		require.NoError(t, err)
		sum, err := r.client.Digest(context.Background(), got)
		require.NoError(t, err)
		require.Equal(t, want, sum.Crc32C)
		gdrcodec.ReleaseAll(got)
	}
	require.Equal(t, map[string]int{"cuda-ipc": 2 * calls}, r.paths.reset())
	left := devicebuf.Live().Sub(base)
	require.Zero(t, left.CUDABuffers, "GPU buffers left: %+v", left)
	require.Zero(t, left.CUDABytes, "GPU bytes left: %+v", left)
	require.Zero(t, left.IPCMappings, "IPC mappings left: %+v", left)
}

// liveBase returns devicebuf's counters for a test to compare what it left
// with, once the host pools are closed: a region an earlier test left idle
// would otherwise be freed (DefaultPoolIdleTimeout) at any time, and count
// as buffers and bytes this test freed.
func liveBase(t *testing.T) devicebuf.Counters {
	t.Helper()
	require.NoError(t, oob.CloseHostPools())
	return devicebuf.Live()
}

// leaksMade counts the leaks tests make on purpose; TestMain fails on any other.
var leaksMade atomic.Int64

// A message collected with a buffer attached is reported, and the buffer is not
// freed behind the owner's back: only releases free it.
func TestCollectedAttachmentIsReported(t *testing.T) {
	logs := &recordingHandler{records: make(chan slog.Record, 1)}
	gdrcodec.Register(gdrcodec.WithLogger(slog.New(logs)))
	t.Cleanup(func() { gdrcodec.Register() })
	base := liveBase(t)
	b, err := devicebuf.NewHostAllocator().Alloc(12345)
	require.NoError(t, err)
	leaksBefore := gdrcodec.Leaked()
	func() {
		msg := &tensorpb.Tensor{Data: gdrcodec.New(b)} // dropped without ReleaseAll
		require.NotNil(t, msg.Data)
	}()
	leaksMade.Add(1)
	var rec slog.Record
	require.Eventually(t, func() bool {
		runtime.GC()
		select {
		case rec = <-logs.records:
			return true
		default:
			return false
		}
	}, 10*time.Second, time.Millisecond, "the collected message is reported")
	require.Equal(t, slog.LevelWarn, rec.Level)
	require.Contains(t, rec.Message, "ReleaseAll")
	attrs := map[string]string{}
	rec.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	require.Equal(t, map[string]string{"bytes": "12345", "kind": devicebuf.Host.String()}, attrs)
	require.Equal(t, leaksBefore+1, gdrcodec.Leaked())

	// The attachment's reference is still held: the caller's release does not free it.
	require.NoError(t, b.Release())
	require.False(t, b.Released())
	require.Equal(t, int64(1), devicebuf.Live().Sub(base).HostBuffers)
	require.NoError(t, b.Release()) // the leaked reference, which this test knows of
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base))
}

// Without a logger of Register's, a leak goes to slog.Default(): it needs a
// person's attention, as one the application configured.
func TestCollectedAttachmentLoggedByDefault(t *testing.T) {
	logs := &recordingHandler{records: make(chan slog.Record, 16)}
	// SetDefault redirects package log too; restoring the default logger
	// does not undo that.
	defer func(l *slog.Logger, w io.Writer, flags int) {
		slog.SetDefault(l)
		log.SetOutput(w)
		log.SetFlags(flags)
	}(slog.Default(), log.Writer(), log.Flags())
	slog.SetDefault(slog.New(logs))
	gdrcodec.Register()
	b, err := devicebuf.NewHostAllocator().Alloc(777)
	require.NoError(t, err)
	func() {
		msg := &tensorpb.Tensor{Data: gdrcodec.New(b)} // dropped without ReleaseAll
		require.NotNil(t, msg.Data)
	}()
	leaksMade.Add(1)
	require.Eventually(t, func() bool {
		runtime.GC()
		select {
		case rec := <-logs.records:
			var bytes string
			rec.Attrs(func(a slog.Attr) bool {
				if a.Key == "bytes" {
					bytes = a.Value.String()
				}
				return true
			})
			return rec.Level == slog.LevelWarn && strings.Contains(rec.Message, "garbage-collected") && bytes == "777"
		default:
			return false
		}
	}, 10*time.Second, time.Millisecond, "the collected message is reported to slog.Default()")
	require.NoError(t, b.Release())
	require.NoError(t, b.Release()) // the leaked reference, which this test knows of
}

type recordingHandler struct{ records chan slog.Record }

func (h *recordingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordingHandler) Handle(_ context.Context, r slog.Record) error {
	select {
	case h.records <- r.Clone():
	default:
	}
	return nil
}
func (h *recordingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordingHandler) WithGroup(string) slog.Handler      { return h }

// A receive pool squatted by transfers that never completed serves later calls:
// the regions they left are freed for a call that needs their room, and all of
// them once idle.
func TestSquattedPoolServesLaterCalls(t *testing.T) {
	clock := devicebuftest.NewClock()
	pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 16 << 20, IdleTimeout: 30 * time.Second, Clock: clock})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pool.Close()) })
	r := newRig(t, transport.ModeTCP, nil)
	gdrcodec.Register(gdrcodec.WithReceiveAllocator(pool))
	t.Cleanup(func() { gdrcodec.Register() })

	// Destinations of refused transfers, released: regions of 8 + 4 + 4 MiB fill the pool.
	for _, n := range []int{8 << 20, 4 << 20, 2 << 20} {
		b, err := pool.Alloc(n)
		require.NoError(t, err)
		require.NoError(t, b.Release())
	}
	st := pool.Stats()
	require.Equal(t, 3, st.Regions)
	require.Equal(t, int64(16<<20), st.RegionBytes)

	// A later call whose payload needs a 16 MiB block.
	const n = 12 << 20
	want := pattern(n, 11)
	src := devicebuf.HostFromBytes(want)
	req := &tensorpb.Tensor{Data: gdrcodec.New(src)}
	src.Release()
	sum, err := r.client.Digest(context.Background(), req)
	require.NoError(t, err)
	require.Equal(t, tensor.ChecksumBytes(want), sum.Crc32C)
	gdrcodec.ReleaseAll(req)
	// The server gives the request's buffer back when the call ends, just after the
	// client saw its response.
	require.Eventually(t, func() bool { return pool.Stats().InUse == 0 }, 10*time.Second, time.Millisecond)
	st = pool.Stats()
	require.Equal(t, 1, st.Regions)
	require.Equal(t, int64(16<<20), st.RegionBytes)
	require.Equal(t, int64(3), st.Freed)
	require.Zero(t, st.Exhausted)

	clock.Advance(30 * time.Second)
	st = pool.Stats()
	require.Zero(t, st.Regions, "idle regions go back")
	require.Equal(t, int64(4), st.Freed)
}

// cachedServer answers every Make with the same message.
type cachedServer struct {
	tensor.Server
	m *tensorpb.Tensor
}

func (s *cachedServer) Make(context.Context, *tensorpb.Sized) (*tensorpb.Tensor, error) {
	return s.m, nil
}

// newCached returns a cachedServer whose message holds n bytes of seed's
// pattern.
func newCached(n int, seed uint32) *cachedServer {
	b := devicebuf.HostFromBytes(pattern(n, seed))
	defer b.Release()
	return &cachedServer{m: &tensorpb.Tensor{Data: gdrcodec.New(b)}}
}

// A server releases a response's buffers once it is sent, so a handler
// that returns one message twice gets, the second time, an error that says
// so, rather than a DeviceBuffer without its payload that its receiver
// refuses (inline) or that names nothing.
func TestResponseSentTwice(t *testing.T) {
	for _, n := range []int{1000, 1 << 20} {
		t.Run(fmt.Sprintf("size=%d", n), func(t *testing.T) {
			r := newRig(t, transport.ModeTCP, newCached(n, 3))
			got, err := r.client.Make(context.Background(), &tensorpb.Sized{})
			require.NoError(t, err)
			p, err := tensor.Bytes(got.Data)
			require.NoError(t, err)
			require.Equal(t, pattern(n, 3), p)
			gdrcodec.ReleaseAll(got)

			_, err = r.client.Make(context.Background(), &tensorpb.Sized{})
			require.ErrorContains(t, err, fmt.Sprintf("a DeviceBuffer of %d bytes with no payload attached", n))
			require.Zero(t, gdrcodec.Attached())
		})
	}
}

// One message returned by two calls at once: neither call's destination
// (the peer its payload is bound to, the receive space it may land in) may
// serve the other's, so a marshal that cannot tell them apart fails, when
// the message has buffers, with an error that says why; a call that goes
// gets its bytes exact. A message without buffers goes on both.
func TestResponseOnTwoCallsAtOnce(t *testing.T) {
	const n = 1 << 20
	for _, tc := range []struct {
		name    string
		srv     *cachedServer
		buffers bool
	}{
		{"buffers", newCached(n, 4), true},
		{"none", &cachedServer{m: &tensorpb.Tensor{Name: "ack"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var bound sync.WaitGroup
			bound.Add(2)
			both := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
				resp, err := handler(ctx, req) // gdrpc's interceptor, inside, binds resp to its call
				bound.Done()
				bound.Wait()
				return resp, err
			}
			r := newRigWith(t, transport.ModeTCP, tc.srv, []grpc.ServerOption{grpc.ChainUnaryInterceptor(both)})
			errs := make(chan error, 2)
			for range 2 {
				go func() {
					got, err := r.client.Make(context.Background(), &tensorpb.Sized{})
					if err == nil && tc.buffers {
						p, perr := tensor.Bytes(got.Data)
						if perr == nil && !bytes.Equal(pattern(n, 4), p) {
							perr = errors.New("the payload's bytes differ")
						}
						err = perr
					} else if err == nil && got.GetName() != "ack" {
						err = fmt.Errorf("got %v", got)
					}
					gdrcodec.ReleaseAll(got)
					errs <- err
				}()
			}
			var shared int
			for range 2 {
				err := <-errs
				switch {
				case err == nil:
				case !tc.buffers:
					require.NoError(t, err)
				case strings.Contains(err.Error(), "sent on two calls at once"):
					shared++
				default:
					require.ErrorContains(t, err, "no payload attached", "the other call may find the buffer released")
				}
			}
			if tc.buffers {
				require.GreaterOrEqual(t, shared, 1)
			}
			require.Eventually(t, func() bool { return gdrcodec.Attached() == 0 && oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond)
		})
	}
}

// A payload that arrives inline stays in its message: the decode attaches
// nothing and makes no buffer. Buffer hands out a view of the bytes, made at
// each call (callers at once each get one of their own), which the live
// counters leave out; ReleaseAll leaves the bytes, and Detach hands a view
// over and leaves the message without them.
func TestInlinePayloadStaysInItsMessage(t *testing.T) {
	base, attached := liveBase(t), gdrcodec.Attached()
	payload := pattern(1000, 3)
	var got tensorpb.Tensor
	require.NoError(t, decode(t, &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: 1000, Inline: payload}}, &got))
	require.Equal(t, attached, gdrcodec.Attached(), "the decode attached the inline payload")
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base), "the decode made a buffer")

	views := make(chan *devicebuf.Buffer, 8)
	var wg sync.WaitGroup
	for range cap(views) {
		wg.Go(func() {
			if b, ok := gdrcodec.Buffer(got.Data); ok {
				views <- b
			}
		})
	}
	wg.Wait()
	close(views)
	n := 0
	for b := range views {
		n++
		hb, err := b.HostBytes()
		require.NoError(t, err)
		require.Equal(t, payload, hb)
	}
	require.Equal(t, cap(views), n, "a caller got no payload")
	require.Equal(t, attached, gdrcodec.Attached(), "a view was attached")
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base), "views were counted live")

	gdrcodec.ReleaseAll(&got)
	require.Equal(t, payload, got.Data.GetInline(), "ReleaseAll took the message's own bytes")

	taken := gdrcodec.Detach(got.Data)
	require.NotNil(t, taken)
	hb, err := taken.HostBytes()
	require.NoError(t, err)
	require.Equal(t, payload, hb)
	require.Empty(t, got.Data.GetInline(), "Detach left the bytes in the message")
	_, ok := gdrcodec.Buffer(got.Data)
	require.False(t, ok, "a payload after Detach")
	require.NoError(t, taken.Release())
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base))
}

// An attachment lives by its message's address and dies with the message:
// many messages attached and dropped in turn, some at addresses the
// collector gave out again, each report their own leak once, and the table
// holds none of them after; a message at a reused address has no
// attachment until one is made for it.
func TestAttachmentsByAddress(t *testing.T) {
	logs := &recordingHandler{records: make(chan slog.Record, 1024)}
	gdrcodec.Register(gdrcodec.WithLogger(slog.New(logs)))
	t.Cleanup(func() { gdrcodec.Register() })
	base, attached, leaks := liveBase(t), gdrcodec.Attached(), gdrcodec.Leaked()
	const n = 200
	bufs := make([]*devicebuf.Buffer, n)
	for i := range bufs {
		bufs[i] = devicebuf.HostFromBytes([]byte{byte(i)})
		func() {
			db := gdrcodec.New(bufs[i]) // dropped without ReleaseAll
			b, ok := gdrcodec.Buffer(db)
			require.True(t, ok)
			require.Same(t, bufs[i], b)
		}()
		if i%20 == 0 {
			runtime.GC()
		}
		fresh := &gdrv1.DeviceBuffer{Length: 1}
		_, ok := gdrcodec.Buffer(fresh)
		require.False(t, ok, "a new message has an attachment")
		require.Nil(t, gdrcodec.Detach(fresh))
	}
	leaksMade.Add(n)
	require.Eventually(t, func() bool {
		runtime.GC()
		return gdrcodec.Leaked() == leaks+n
	}, 10*time.Second, time.Millisecond, "leaks reported: %d of %d", gdrcodec.Leaked()-leaks, n)
	require.Equal(t, attached, gdrcodec.Attached(), "entries of collected messages left")
	for _, b := range bufs {
		require.False(t, b.Released(), "a leaked attachment's buffer was freed")
		require.NoError(t, b.Release()) // the caller's reference
		require.NoError(t, b.Release()) // the leaked one, which this test knows of
	}
	require.Equal(t, devicebuf.Counters{}, devicebuf.Live().Sub(base))
}
