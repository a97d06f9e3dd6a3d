package gdrotel_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/gdrotel"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// harness is a Recorder whose metrics a ManualReader collects.
type harness struct {
	rec    *gdrotel.Recorder
	reader *sdkmetric.ManualReader
}

func newHarness(tb testing.TB, opts ...gdrotel.Option) *harness {
	tb.Helper()
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	tb.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	rec, err := gdrotel.New(provider, opts...)
	require.NoError(tb, err)
	return &harness{rec: rec, reader: reader}
}

// reading is one collection, by metric name.
type reading map[string]metricdata.Metrics

func (h *harness) collect(tb testing.TB) reading {
	tb.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(tb, h.reader.Collect(context.Background(), &rm))
	r := reading{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(tb, gdrotel.ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			r[m.Name] = m
		}
	}
	return r
}

// encode writes attributes as "key=value,..." in key order.
func encode(set attribute.Set) string { return set.Encoded(attribute.DefaultEncoder()) }

// sum returns the data points of the int64 sum name, by their attributes, and
// checks its unit and whether it is monotonic.
func (r reading) sum(tb testing.TB, name, unit string, monotonic bool) map[string]int64 {
	tb.Helper()
	m, ok := r[name]
	if !ok {
		return nil
	}
	require.Equal(tb, unit, m.Unit, name)
	s, ok := m.Data.(metricdata.Sum[int64])
	require.True(tb, ok, "%s is a %T, not an int64 sum", name, m.Data)
	require.Equal(tb, monotonic, s.IsMonotonic, name)
	points := map[string]int64{}
	for _, dp := range s.DataPoints {
		points[encode(dp.Attributes)] = dp.Value
	}
	return points
}

// histogram returns the data points of the float64 histogram name, by their
// attributes, and checks its unit.
func (r reading) histogram(tb testing.TB, name, unit string) map[string]metricdata.HistogramDataPoint[float64] {
	tb.Helper()
	m, ok := r[name]
	require.True(tb, ok, "no %s", name)
	require.Equal(tb, unit, m.Unit, name)
	h, ok := m.Data.(metricdata.Histogram[float64])
	require.True(tb, ok, "%s is a %T, not a float64 histogram", name, m.Data)
	points := map[string]metricdata.HistogramDataPoint[float64]{}
	for _, dp := range h.DataPoints {
		points[encode(dp.Attributes)] = dp
	}
	return points
}

const (
	pullCUDA  = "advertised=false,direction=receive,memory=cuda,outcome=ok,path=rdma,route=rdma/cuda"
	pushHost  = "advertised=false,direction=send,memory=host,outcome=ok,path=rdma,route=rdma"
	pullStale = "advertised=false,direction=receive,error.type=not_found,memory=host,outcome=error,path=stream,route=stream"
	pullOther = "advertised=false,direction=receive,error.type=_OTHER,memory=host,outcome=error,path=none,route=none"
	// Into advertised receive space, the owner's copy queued or waited for.
	landedQueued = "advertised=true,direction=receive,memory=cuda,outcome=ok,path=cuda-ipc,queued=true,route=cuda-ipc"
	landedHost   = "advertised=true,direction=receive,memory=host,outcome=ok,path=rdma,queued=false,route=rdma"
)

func TestTransfer(t *testing.T) {
	h := newHarness(t)
	m := h.rec
	m.Transfer(oob.TransferInfo{Path: oob.PathRDMA, Memory: devicebuf.CUDA, Pull: true, Bytes: 64 << 20, Elapsed: 4 * time.Millisecond})
	m.Transfer(oob.TransferInfo{Path: oob.PathRDMA, Memory: devicebuf.Host, Bytes: 1 << 20, Elapsed: 250 * time.Microsecond})
	m.Transfer(oob.TransferInfo{Path: oob.PathRDMA, Memory: devicebuf.Host, Bytes: 3 << 20, Elapsed: 750 * time.Microsecond})
	m.Transfer(oob.TransferInfo{Path: oob.PathStream, Memory: devicebuf.Host, Pull: true, Bytes: 1000, Elapsed: time.Second,
		Err: fmt.Errorf("fetch: %w", &oob.TransferError{Kind: oob.TransferNotFound, Err: errors.New("owner refused: token 0badc0de unknown")})})
	m.Transfer(oob.TransferInfo{Path: oob.PathNone, Memory: devicebuf.Host, Pull: true, Bytes: 0, Elapsed: 2 * time.Second, Err: errors.New("no memory at 0x7f00")})
	m.Transfer(oob.TransferInfo{Path: oob.PathCUDAIPC, Memory: devicebuf.CUDA, Pull: true, Bytes: 8 << 20, Elapsed: time.Microsecond, Advertised: true, Queued: true})
	m.Transfer(oob.TransferInfo{Path: oob.PathRDMA, Memory: devicebuf.Host, Pull: true, Bytes: 2 << 20, Elapsed: time.Microsecond, Advertised: true})

	r := h.collect(t)
	require.Equal(t, map[string]int64{ // a failed transfer's claimed length is not counted
		pullCUDA:     64 << 20,
		pushHost:     4 << 20,
		landedQueued: 8 << 20,
		landedHost:   2 << 20,
	}, r.sum(t, "gdrpc.transfer.io", "By", true))
	require.Contains(t, r["gdrpc.transfer.io"].Description, "a failed transfer counts none", "the help text exporters ship")
	require.Equal(t, map[string]int64{
		pullCUDA:     1,
		pushHost:     2,
		pullStale:    1,
		pullOther:    1,
		landedQueued: 1,
		landedHost:   1,
	}, r.sum(t, "gdrpc.transfers", "{transfer}", true))

	durations := r.histogram(t, "gdrpc.transfer.duration", "s")
	require.Len(t, durations, 6)
	push := durations[pushHost]
	require.Equal(t, uint64(2), push.Count)
	require.InDelta(t, 0.001, push.Sum, 1e-12)
	require.Equal(t, []float64{
		0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
		0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
	}, push.Bounds)
	require.Equal(t, uint64(1), push.BucketCounts[bucketOf(push.Bounds, 0.00025)], "250µs")
	require.Equal(t, uint64(1), push.BucketCounts[bucketOf(push.Bounds, 0.00075)], "750µs")
	require.Equal(t, uint64(1), durations[pullCUDA].Count)
	require.InDelta(t, 0.004, durations[pullCUDA].Sum, 1e-12)
	require.Equal(t, uint64(1), durations[pullStale].Count)
	require.InDelta(t, 1.0, durations[pullStale].Sum, 1e-12)
}

// bucketOf returns the index of the bucket that holds v: (bounds[i-1], bounds[i]].
func bucketOf(bounds []float64, v float64) int {
	for i, b := range bounds {
		if v <= b {
			return i
		}
	}
	return len(bounds)
}

func TestTransferErrorType(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want string
	}{
		{name: "failed", err: &oob.TransferError{Kind: oob.TransferFailed}, want: "failed"},
		{name: "unavailable", err: &oob.TransferError{Kind: oob.TransferUnavailable}, want: "unavailable"},
		{name: "not found", err: &oob.TransferError{Kind: oob.TransferNotFound}, want: "not_found"},
		{name: "timeout", err: &oob.TransferError{Kind: oob.TransferTimeout}, want: "timeout"},
		{name: "invalid", err: &oob.TransferError{Kind: oob.TransferInvalid}, want: "invalid"},
		{name: "canceled", err: &oob.TransferError{Kind: oob.TransferCanceled}, want: "canceled"},
		{name: "exhausted", err: &oob.TransferError{Kind: oob.TransferExhausted}, want: "exhausted"},
		{name: "wrapped", err: fmt.Errorf("pull: %w", &oob.TransferError{Kind: oob.TransferTimeout}), want: "timeout"},
		{name: "unknown kind", err: &oob.TransferError{Kind: 99}, want: "_OTHER"},
		{name: "other error", err: context.DeadlineExceeded, want: "_OTHER"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.rec.Transfer(oob.TransferInfo{Path: oob.PathStream, Pull: true, Bytes: 10, Err: tt.err})
			want := "advertised=false,direction=receive,error.type=" + tt.want + ",memory=host,outcome=error,path=stream,route=stream"
			got := h.collect(t)
			require.Equal(t, map[string]int64{want: 1}, got.sum(t, "gdrpc.transfers", "{transfer}", true))
			// Its length is the descriptor's claim: no bytes counted, so a
			// peer's claims cannot set (or wrap) the byte counter.
			for k, v := range got.sum(t, "gdrpc.transfer.io", "By", true) {
				require.Zero(t, v, "bytes counted for a failed transfer: %s", k)
			}
		})
	}
}

func TestTransferFallback(t *testing.T) {
	h := newHarness(t, gdrotel.WithMaxReasons(2))
	m := h.rec
	m.TransferFallback(oob.PathRDMA, oob.PathStream, "register destination: ucp_mem_map: Out of memory at 0x7f0012340000")
	m.TransferFallback(oob.PathRDMA, oob.PathStream, "register destination: invalid parameter")
	m.TransferFallback(oob.PathCUDAIPC, oob.PathRDMA, "export IPC handle: CUDA_ERROR_INVALID_VALUE")
	m.TransferFallback(oob.PathRDMA, oob.PathStream, "pack key: no memory")            // a third reason: past the limit
	m.TransferFallback(oob.PathRDMA, oob.PathStream, "clear destination: device lost") // and a fourth
	m.TransferFallback(oob.PathCUDAIPC, oob.PathRDMA, "register destination: again")   // a kept reason, other paths

	require.Equal(t, map[string]int64{
		"reason=register destination,took=stream,wanted=rdma":   2,
		"reason=export IPC handle,took=rdma,wanted=cuda-ipc":    1,
		"reason=_OTHER,took=stream,wanted=rdma":                 2,
		"reason=register destination,took=rdma,wanted=cuda-ipc": 1,
	}, h.collect(t).sum(t, "gdrpc.transfer.fallbacks", "{fallback}", true))
}

// A reason with no class records as _OTHER without taking one of the
// WithMaxReasons slots from the reasons that have one.
func TestReasonWithoutClassTakesNoSlot(t *testing.T) {
	h := newHarness(t, gdrotel.WithMaxReasons(1))
	h.rec.SessionFallback("")
	h.rec.SessionFallback(": no class")
	h.rec.SessionFallback("UCX upgrade failed: dial: refused")
	h.rec.TransferFallback(oob.PathRDMA, oob.PathStream, "")
	h.rec.TransferFallback(oob.PathRDMA, oob.PathStream, "pack key: no memory")
	r := h.collect(t)
	require.Equal(t, map[string]int64{"reason=_OTHER": 2, "reason=UCX upgrade failed": 1},
		r.sum(t, "gdrpc.session.fallbacks", "{fallback}", true))
	require.Equal(t, map[string]int64{"reason=_OTHER,took=stream,wanted=rdma": 1, "reason=pack key,took=stream,wanted=rdma": 1},
		r.sum(t, "gdrpc.transfer.fallbacks", "{fallback}", true))
}

// A Recorder not made by New (nil, as `rec, _ := gdrotel.New(...)` leaves
// it when New fails, or the zero value) records nothing rather than panic
// in a session's goroutine, and refuses to observe a pool.
func TestRecorderNotMadeByNew(t *testing.T) {
	for _, tc := range []struct {
		name string
		rec  *gdrotel.Recorder
	}{{"nil", nil}, {"zero", &gdrotel.Recorder{}}} {
		t.Run(tc.name, func(t *testing.T) {
			var m gdrpc.Metrics = tc.rec
			require.NotPanics(t, func() {
				m.SessionUp("tcp", true)
				m.SessionDown("tcp", true, nil)
				m.SessionFallback("UCX upgrade failed: x")
				m.Transfer(oob.TransferInfo{Path: oob.PathRDMA, Bytes: 1})
				m.TransferFallback(oob.PathRDMA, oob.PathStream, "x: y")
			})
			_, err := tc.rec.ObservePool("host", &fakePool{})
			require.ErrorContains(t, err, "not made by New")
		})
	}
}

func TestFallbackReasonClass(t *testing.T) {
	long := strings.Repeat("é", 40) // 80 bytes
	tests := []struct {
		name   string
		reason string
		want   string
	}{
		{name: "prefix", reason: "no host staging: devicebuf: pool exhausted", want: "no host staging"},
		{name: "no colon", reason: "client could not upgrade to UCX", want: "client could not upgrade to UCX"},
		{name: "spaces", reason: "  UCX upgrade failed : dial: refused", want: "UCX upgrade failed"},
		{name: "empty", reason: "", want: "_OTHER"},
		{name: "colon first", reason: ": what", want: "_OTHER"},
		{name: "long", reason: long, want: strings.Repeat("é", 32)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.rec.SessionFallback(tt.reason)
			require.Equal(t, map[string]int64{"reason=" + tt.want: 1},
				h.collect(t).sum(t, "gdrpc.session.fallbacks", "{fallback}", true))
		})
	}
}

func TestSessions(t *testing.T) {
	h := newHarness(t)
	m := h.rec
	m.SessionUp("ucx", true)
	m.SessionUp("ucx", true)
	m.SessionUp("tcp", false)
	m.SessionUp("tcp", false)
	m.SessionDown("ucx", true, transport.ErrSessionClosed)
	m.SessionDown("tcp", false, fmt.Errorf("%w: control stream ended: %w", transport.ErrPeerGone, errors.New("EOF")))
	m.SessionFallback("UCX upgrade failed: dial 10.0.0.7:4711: connection refused")
	m.SessionFallback("UCX upgrade failed: rdma: no device")

	r := h.collect(t)
	require.Equal(t, map[string]int64{
		"side=client,transport=ucx": 1,
		"side=server,transport=tcp": 1,
	}, r.sum(t, "gdrpc.session.active", "{session}", false))
	require.Equal(t, map[string]int64{
		"side=client,transport=ucx": 2,
		"side=server,transport=tcp": 2,
	}, r.sum(t, "gdrpc.session.opened", "{session}", true))
	require.Equal(t, map[string]int64{
		"outcome=closed,side=client,transport=ucx":    1,
		"outcome=peer_gone,side=server,transport=tcp": 1,
	}, r.sum(t, "gdrpc.session.closed", "{session}", true))
	require.Equal(t, map[string]int64{
		"reason=UCX upgrade failed": 2,
	}, r.sum(t, "gdrpc.session.fallbacks", "{fallback}", true))
}

func TestSessionCloseOutcome(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want string
	}{
		{name: "nil", err: nil, want: "closed"},
		{name: "closed", err: transport.ErrSessionClosed, want: "closed"},
		{name: "idle", err: fmt.Errorf("%w for %v", transport.ErrIdle, time.Minute), want: "idle"},
		{name: "keepalive", err: &transport.KeepAliveError{Interval: time.Second, Timeout: time.Second, Err: errors.New("ping timed out")}, want: "keepalive"},
		{name: "peer gone", err: transport.ErrPeerGone, want: "peer_gone"},
		{name: "other", err: errors.New("gdrpc: control message of 2097152 bytes (max 1048576) from peer"), want: "error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.rec.SessionUp("tcp", true)
			h.rec.SessionDown("tcp", true, tt.err)
			r := h.collect(t)
			require.Equal(t, map[string]int64{"outcome=" + tt.want + ",side=client,transport=tcp": 1},
				r.sum(t, "gdrpc.session.closed", "{session}", true))
			require.Equal(t, map[string]int64{"side=client,transport=tcp": 0},
				r.sum(t, "gdrpc.session.active", "{session}", false))
		})
	}
}

// fakePool reports the stats it holds.
type fakePool struct {
	mu    sync.Mutex
	stats devicebuf.PoolStats
}

func (p *fakePool) Stats() devicebuf.PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

func (p *fakePool) set(s devicebuf.PoolStats) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stats = s
}

func TestObservePool(t *testing.T) {
	h := newHarness(t)
	host := &fakePool{stats: devicebuf.PoolStats{
		Regions: 2, RegionBytes: 8 << 20, Registrations: 3, InUse: 5, BytesInUse: 640 << 10,
		Hits: 100, Misses: 3, Exhausted: 1, Waits: 2, Freed: 1,
	}}
	gpu := &fakePool{stats: devicebuf.PoolStats{Regions: 1, RegionBytes: 64 << 20, Registrations: 1, Misses: 1}}
	unregisterHost, err := h.rec.ObservePool("host", host)
	require.NoError(t, err)
	unregisterGPU, err := h.rec.ObservePool("cuda:0", gpu)
	require.NoError(t, err)

	r := h.collect(t)
	require.Equal(t, map[string]int64{"pool=host": 2, "pool=cuda:0": 1}, r.sum(t, "gdrpc.pool.region.count", "{region}", false))
	require.Equal(t, map[string]int64{"pool=host": 8 << 20, "pool=cuda:0": 64 << 20}, r.sum(t, "gdrpc.pool.region.usage", "By", false))
	require.Equal(t, map[string]int64{"pool=host": 5, "pool=cuda:0": 0}, r.sum(t, "gdrpc.pool.buffer.count", "{buffer}", false))
	require.Equal(t, map[string]int64{"pool=host": 640 << 10, "pool=cuda:0": 0}, r.sum(t, "gdrpc.pool.buffer.usage", "By", false))
	require.Equal(t, map[string]int64{"pool=host": 3, "pool=cuda:0": 1}, r.sum(t, "gdrpc.pool.registrations", "{registration}", true))
	require.Equal(t, map[string]int64{
		"pool=host,result=hit":         100,
		"pool=host,result=miss":        3,
		"pool=host,result=exhausted":   1,
		"pool=cuda:0,result=hit":       0,
		"pool=cuda:0,result=miss":      1,
		"pool=cuda:0,result=exhausted": 0,
	}, r.sum(t, "gdrpc.pool.allocations", "{allocation}", true))
	require.Equal(t, map[string]int64{"pool=host": 2, "pool=cuda:0": 0}, r.sum(t, "gdrpc.pool.waits", "{wait}", true))
	require.Equal(t, map[string]int64{"pool=host": 1, "pool=cuda:0": 0}, r.sum(t, "gdrpc.pool.region.freed", "{region}", true))

	// Each collection reads the pool again.
	host.set(devicebuf.PoolStats{Regions: 1, RegionBytes: 4 << 20, Hits: 150, Misses: 4})
	r = h.collect(t)
	require.Equal(t, map[string]int64{"pool=host": 4 << 20, "pool=cuda:0": 64 << 20}, r.sum(t, "gdrpc.pool.region.usage", "By", false))
	require.Equal(t, int64(150), r.sum(t, "gdrpc.pool.allocations", "{allocation}", true)["pool=host,result=hit"])

	_, err = h.rec.ObservePool("host", gpu)
	require.Error(t, err, "a name is observed once at a time")
	_, err = h.rec.ObservePool("", gpu)
	require.Error(t, err)
	_, err = h.rec.ObservePool("none", nil)
	require.Error(t, err)

	require.NoError(t, unregisterHost())
	require.NoError(t, unregisterHost(), "unregister is idempotent")
	r = h.collect(t)
	require.Equal(t, map[string]int64{"pool=cuda:0": 64 << 20}, r.sum(t, "gdrpc.pool.region.usage", "By", false))

	unregisterHost, err = h.rec.ObservePool("host", host)
	require.NoError(t, err, "an unregistered name may be observed again")
	require.NoError(t, unregisterHost())
	require.NoError(t, unregisterGPU())
	r = h.collect(t)
	require.Empty(t, r.sum(t, "gdrpc.pool.region.usage", "By", false))
}

func TestObserveDevicebufPool(t *testing.T) {
	h := newHarness(t)
	pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 8 << 20})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pool.Close()) })
	unregister, err := h.rec.ObservePool("host", pool)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unregister()) })

	b, err := pool.Alloc(100 << 10)
	require.NoError(t, err)
	b.Release()
	b, err = pool.Alloc(100 << 10)
	require.NoError(t, err)
	defer b.Release()

	r := h.collect(t)
	require.Equal(t, map[string]int64{
		"pool=host,result=hit":       1,
		"pool=host,result=miss":      1,
		"pool=host,result=exhausted": 0,
	}, r.sum(t, "gdrpc.pool.allocations", "{allocation}", true))
	require.Equal(t, map[string]int64{"pool=host": 1}, r.sum(t, "gdrpc.pool.buffer.count", "{buffer}", false))
	s := pool.Stats()
	require.Equal(t, map[string]int64{"pool=host": s.BytesInUse}, r.sum(t, "gdrpc.pool.buffer.usage", "By", false))
	require.Equal(t, map[string]int64{"pool=host": s.RegionBytes}, r.sum(t, "gdrpc.pool.region.usage", "By", false))
}

func TestConcurrent(t *testing.T) {
	const workers, rounds = 8, 480 // rounds: a multiple of the 8 reasons
	h := newHarness(t, gdrotel.WithMaxReasons(4))
	pool := &fakePool{stats: devicebuf.PoolStats{Regions: 1}}
	unregister, err := h.rec.ObservePool("host", pool)
	require.NoError(t, err)
	defer func() { require.NoError(t, unregister()) }()

	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			transfers, sessions := h.rec, h.rec
			for i := range rounds {
				kind := devicebuf.Kind(i % 2)
				transfers.Transfer(oob.TransferInfo{Path: oob.PathRDMA, Memory: kind, Pull: w%2 == 0, Bytes: 1 << 10, Elapsed: time.Millisecond})
				transfers.TransferFallback(oob.PathRDMA, oob.PathStream, fmt.Sprintf("reason %d: worker %d", i%8, w))
				sessions.SessionUp("ucx", w%2 == 0)
				sessions.SessionFallback(fmt.Sprintf("reason %d: round %d", i%8, i))
				sessions.SessionDown("ucx", w%2 == 0, nil)
			}
		})
	}
	// Collections run beside the recording.
	wg.Go(func() {
		for range 20 {
			h.collect(t)
		}
	})
	wg.Wait()

	r := h.collect(t)
	var transfers, bytes, fallbacks, sessionFallbacks int64
	for _, v := range r.sum(t, "gdrpc.transfers", "{transfer}", true) {
		transfers += v
	}
	for _, v := range r.sum(t, "gdrpc.transfer.io", "By", true) {
		bytes += v
	}
	fallbackPoints := r.sum(t, "gdrpc.transfer.fallbacks", "{fallback}", true)
	for _, v := range fallbackPoints {
		fallbacks += v
	}
	sessionFallbackPoints := r.sum(t, "gdrpc.session.fallbacks", "{fallback}", true)
	for _, v := range sessionFallbackPoints {
		sessionFallbacks += v
	}
	require.Equal(t, int64(workers*rounds), transfers)
	require.Equal(t, int64(workers*rounds<<10), bytes)
	require.Len(t, r.sum(t, "gdrpc.transfers", "{transfer}", true), 4, "2 directions x 2 memory kinds")
	require.Equal(t, int64(workers*rounds), fallbacks)
	require.Len(t, fallbackPoints, 5, "4 reasons kept and _OTHER")
	require.Equal(t, int64(workers*rounds/2), fallbackPoints["reason=_OTHER,took=stream,wanted=rdma"])
	require.Equal(t, int64(workers*rounds), sessionFallbacks)
	require.Len(t, sessionFallbackPoints, 5)
	require.Equal(t, map[string]int64{
		"side=client,transport=ucx": 0,
		"side=server,transport=ucx": 0,
	}, r.sum(t, "gdrpc.session.active", "{session}", false))
	require.Equal(t, map[string]int64{
		"outcome=closed,side=client,transport=ucx": workers / 2 * rounds,
		"outcome=closed,side=server,transport=ucx": workers / 2 * rounds,
	}, r.sum(t, "gdrpc.session.closed", "{session}", true))
	histogram := r.histogram(t, "gdrpc.transfer.duration", "s")
	var count uint64
	for _, dp := range histogram {
		count += dp.Count
	}
	require.Equal(t, uint64(workers*rounds), count)
}

func TestRecordingAllocatesNothing(t *testing.T) {
	h := newHarness(t)
	transfers, sessions := h.rec, h.rec
	info := oob.TransferInfo{Path: oob.PathRDMA, Memory: devicebuf.CUDA, Pull: true, Bytes: 64 << 20, Elapsed: time.Millisecond}
	reason := "register destination: ucp_mem_map failed"
	record := func() {
		transfers.Transfer(info)
		transfers.TransferFallback(oob.PathRDMA, oob.PathStream, reason)
		sessions.SessionUp("ucx", true)
		sessions.SessionDown("ucx", true, transport.ErrSessionClosed)
	}
	record() // makes the attribute sets
	require.Zero(t, testing.AllocsPerRun(100, record))
}

// TestNilMeterProviderTakesGlobal sets the global MeterProvider and leaves it
// set: no other test here uses it.
func TestNilMeterProviderTakesGlobal(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	otel.SetMeterProvider(provider)

	rec, err := gdrotel.New(nil)
	require.NoError(t, err)
	rec.SessionUp("tcp", false)
	r := (&harness{rec: rec, reader: reader}).collect(t)
	require.Equal(t, map[string]int64{"side=server,transport=tcp": 1}, r.sum(t, "gdrpc.session.opened", "{session}", true))
}
