package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"regexp"
	"runtime/trace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// collector is the transport metrics hook: it keeps the transfers and
// fallbacks since it was last taken.
type collector struct {
	gdrpc.NopMetrics
	mu        sync.Mutex
	events    []oob.TransferInfo
	fallbacks []string
}

func (c *collector) Transfer(i gdrpc.TransferInfo) {
	c.mu.Lock()
	c.events = append(c.events, i)
	c.mu.Unlock()
}

func (c *collector) TransferFallback(wanted, took gdrpc.Path, reason string) {
	c.mu.Lock()
	c.fallbacks = append(c.fallbacks, fmt.Sprintf("%s -> %s: %s", wanted, took, reason))
	c.mu.Unlock()
}

func (c *collector) take() ([]oob.TransferInfo, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, f := c.events, c.fallbacks
	c.events, c.fallbacks = nil, nil
	return e, f
}

// result is one size's row; its JSON form is what -format=json prints.
type result struct {
	SizeBytes       int      `json:"size_bytes"`
	Size            string   `json:"size"`
	Op              string   `json:"op"`
	Mem             string   `json:"mem"`                 // where the sender's payload lives
	Recv            string   `json:"recv"`                // where the receiver's payload lands
	Transport       string   `json:"transport"`           // what the gdrpc session runs over: ucx or tcp
	UCXLanes        string   `json:"ucx_lanes,omitempty"` // the session endpoint's UCX lanes and their roles
	Path            string   `json:"path"`                // out-of-band path(s) the payloads took
	Iters           int      `json:"iters"`
	Inflight        int      `json:"inflight"`       // calls in flight at once; above 1 the rates are aggregate
	Hold            int      `json:"hold,omitempty"` // received payloads each calling goroutine kept (-hold)
	Conns           int      `json:"conns"`          // gdrpc client connections the calls spread over
	Sessions        int      `json:"sessions"`       // gdrpc sessions the calls went over (as gRPC reports each call's peer)
	GDRPCMiBs       *float64 `json:"gdrpc_mib_s"`    // size / the median call time; nil: gdrpc not measured
	CallMicros      *float64 `json:"call_us"`        // one call's time: size / the rate, times the calls in flight
	TransferMiBs    *float64 `json:"transfer_mib_s"` // size / the median time of the out-of-band transfer alone (metrics hook); nil: none timed
	GRPCTCPMiBs     *float64 `json:"grpc_tcp_mib_s"`
	VsGRPCTCP       *float64 `json:"gdrpc_vs_grpc_tcp"` // gdrpc MiB/s / grpc-tcp MiB/s
	UCXPerftestMiBs *float64 `json:"ucx_perftest_mib_s"`
	VsUCXPerftest   *float64 `json:"gdrpc_vs_ucx_perftest"` // gdrpc MiB/s / ucx_perftest MiB/s: the whole call against UCX's puts
	XferVsPerftest  *float64 `json:"xfer_vs_ucx_perftest"`  // transfer MiB/s / ucx_perftest MiB/s: the out-of-band transfer alone against UCX's puts
	UCXTLS          string   `json:"ucx_perftest_tls,omitempty"`
	DtoDMiBs        *float64 `json:"dtod_mib_s,omitempty"` // with -server-device another GPU: the peer copy between the two
	VsDtoD          *float64 `json:"gdrpc_vs_dtod,omitempty"`
	NaiveMiBs       *float64 `json:"naive_mib_s,omitempty"`
	VsNaive         *float64 `json:"gdrpc_vs_naive,omitempty"`
	D2HMiBs         *float64 `json:"d2h_mib_s,omitempty"`             // -mem cuda -recv host: device-to-host copy into registered host memory
	VsD2HPut        *float64 `json:"gdrpc_vs_min_d2h_put,omitempty"`  // against min(d2h, ucx_perftest): the staged path's ceiling
	RPCMicros       *float64 `json:"rpc_1kib_us,omitempty"`           // plain gRPC unary call with 1 KiB, median; with N in flight the mean call under load
	CopyMiBs        *float64 `json:"copy_mib_s,omitempty"`            // in-process copy of the payload, -mem to -recv memory
	VsRPCCopy       *float64 `json:"call_vs_rpc_plus_copy,omitempty"` // call time / (1 KiB RPC + copy), the call and the RPC with as many in flight, the copy alone
	Fallbacks       []string `json:"fallbacks,omitempty"`
	Notes           []string `json:"notes,omitempty"`
	Run             int      `json:"run,omitempty"` // with -runs above 1, which run measured the row

	mismatches []string // payloads that differed from the ones sent (in Notes too): they fail the run
}

// note records why a figure of the row is missing; a payload that differed
// from the one sent also fails the run.
func (r *result) note(what string, err error) {
	r.Notes = append(r.Notes, what+": "+err.Error())
	var m *mismatchError
	if errors.As(err, &m) {
		r.mismatches = append(r.mismatches, what+": "+err.Error())
	}
}

// mismatchError is a received payload that differs from the one sent: it
// fails the run, where a call that failed leaves only a note.
type mismatchError struct{ msg string }

func (e *mismatchError) Error() string { return e.msg }

// mismatch returns a mismatchError with the formatted message.
func mismatch(format string, a ...any) error {
	return &mismatchError{msg: fmt.Sprintf(format, a...)}
}

// ratio is a / b; nil where either is missing or not positive.
func ratio(a, b *float64) *float64 {
	if a == nil || b == nil || *b <= 0 || *a <= 0 {
		return nil
	}
	return finite(*a / *b)
}

// positive returns &v, or nil when v is 0 (not measured) or less.
func positive(v float64) *float64 {
	if v <= 0 {
		return nil
	}
	return finite(v)
}

// finite returns &v, or nil when v is not a finite number (JSON has none).
func finite(v float64) *float64 {
	if math.IsInf(v, 0) || math.IsNaN(v) {
		return nil
	}
	return &v
}

// bench is the client side of a run.
type bench struct {
	o       *options
	metrics *collector
	alloc   devicebuf.Allocator // where pushed payloads live
	cuda    devicebuf.Allocator // nil for -mem host

	gdrpc    tensorpb.TensorServiceClient // over a dialer.Pool of -conns connections
	plains   []*grpc.ClientConn           // the baselines' connections, as many as -conns
	host     string                       // the server's host, for ucx_perftest
	info     readyInfo
	perfBin  string
	perfNote string

	logf func(string, ...any)

	// drain, when set, runs after each goroutine of a batch made its calls
	// (and, with one goroutine, after each call), inside the timing: with
	// -stream-ordered, it waits for the copies the goroutine's stream was
	// ordered after.
	drain func(w int) error

	transport string // of the gdrpc session, once known
	lanes     string // UCX transports of the session's endpoint, once known
}

func runClient(ctx context.Context, o *options, stdout io.Writer, logf func(string, ...any)) error {
	alloc, cuda, err := o.allocators()
	if err != nil {
		return err
	}
	unregister, err := registerCodec(o, cuda)
	if err != nil {
		return err
	}
	defer unregister() // after the connections close
	m := &collector{}
	o.metrics = m

	var runs [][]*result // the runs that ended, each with its rows
	var errs []error
	for run := 1; run <= o.runs && ctx.Err() == nil; run++ {
		b := &bench{o: o, metrics: m, alloc: alloc, cuda: cuda, logf: logf}
		if o.runs > 1 && o.format == "table" {
			fmt.Fprintf(stdout, "# run %d of %d\n", run, o.runs) // a JSON row names its run in "run"
		}
		rs, err := b.run(ctx, stdout, run, run == o.runs)
		if ctx.Err() != nil {
			// Cut short: a run that measured every row ended all the same
			// (the signal came while it wound down).
			if len(rs) == len(o.sizes)*len(o.inflights) {
				runs = append(runs, rs)
			}
			break
		}
		if err != nil && o.runs > 1 {
			err = fmt.Errorf("run %d: %w", run, err)
		}
		if err != nil {
			errs = append(errs, err)
		}
		if !slices.ContainsFunc(rs, func(r *result) bool { return r.GDRPCMiBs != nil }) {
			// Nothing measured (no server, no connection): the next run
			// would fail the same way.
			break
		}
		runs = append(runs, rs)
	}
	if o.runs > 1 && len(runs) > 1 {
		// Also when cut short (a signal, a timeout around the tool): the
		// medians over the runs that ended.
		if err := writeSummary(stdout, o, runs); err != nil {
			errs = append(errs, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return errors.Join(errs...)
}

// run measures every size and count in flight once, with a server of its
// own (unless -connect names one) and new connections, writes the table,
// and, on the last run, times new connections (-connects).
//
// A server process of its own that ended before the run did, or ended by a
// signal or with an error, fails the run.
func (b *bench) run(ctx context.Context, stdout io.Writer, run int, last bool) (_ []*result, err error) {
	o := b.o
	var server *child
	if o.connect == "" {
		ch, info, startErr := startChild(ctx, o)
		if startErr != nil {
			return nil, startErr
		}
		server = ch
		defer func() {
			err = errors.Join(err, ch.stop())
		}()
		b.info, b.host = info, "127.0.0.1"
	} else {
		host, port, err := serverAddr("-connect", o.connect)
		if err != nil {
			return nil, err
		}
		b.info = readyInfo{GDRPC: o.connect, GRPC: net.JoinHostPort(host, strconv.Itoa(port+1)), PerftestPort: port + 2}
		b.host = host
	}
	b.perfBin, b.perfNote, err = perftestBinary(o.perftest)
	if err != nil {
		return nil, err
	}
	if b.info.PerftestPort == 0 && b.perfNote == "" {
		b.perfNote = "the server runs no ucx_perftest: " + b.info.PerftestNote
	}

	pool, err := dialGDRPC(o, b.info.GDRPC)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	b.gdrpc = tensorpb.NewTensorServiceClient(pool)
	for range o.conns {
		cc, err := dialPlain(b.info.GRPC)
		if err != nil {
			return nil, err
		}
		defer cc.Close()
		b.plains = append(b.plains, cc)
	}

	out := newReporter(stdout, o)
	var rs []*result
	var failed []string
	var errs []error
rows:
	for i, size := range o.sizes {
		for j, n := range o.inflights {
			o.inflight = n
			r := b.measure(ctx, size)
			if ctx.Err() != nil {
				// Cut short: the rows measured, under the table's header.
				return rs, errors.Join(ctx.Err(), out.flush())
			}
			if o.runs > 1 {
				r.Run = run
			}
			if i == 0 && j == 0 {
				out.header(b)
			}
			out.row(r)
			rs = append(rs, r)
			if r.GDRPCMiBs == nil {
				failed = append(failed, fmt.Sprintf("%s (%d in flight)", r.Size, n))
			}
			for _, m := range r.mismatches {
				errs = append(errs, fmt.Errorf("%s (%d in flight): %s", r.Size, n, m))
			}
			if server != nil && server.ended() {
				break rows // the rows left would fail: stop says how it ended
			}
		}
	}
	if err := out.flush(); err != nil {
		return rs, errors.Join(append(errs, err)...)
	}
	if len(failed) > 0 {
		errs = append(errs, fmt.Errorf("gdrpc not measured for %s (see the notes)", strings.Join(failed, ", ")))
	}
	if last && o.connects > 0 && (server == nil || !server.ended()) {
		r, err := b.measureConnects(ctx)
		if err == nil {
			err = writeConnects(stdout, o.format, r)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("-connects: %w", err))
		}
	}
	return rs, errors.Join(errs...)
}

// limits raises gRPC's message size limits on both clients.
var limits = grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg), grpc.MaxCallSendMsgSize(maxMsg))

// dialGDRPC makes the gdrpc client: a pool of -conns connections, each a
// session of its own, with the gdrpc dialer in o's transport mode and the gdr
// codec's options.
func dialGDRPC(o *options, addr string) (*dialer.Pool, error) {
	d := dialer.New(o.faceOptions()...)
	opts := d.DialOptions(insecure.NewCredentials())
	return dialer.NewPool("passthrough:///"+addr, o.conns, append(opts, limits)...)
}

// dialPlain makes the baseline client: ordinary gRPC over TCP, default codec
// and windows, message size limits raised.
func dialPlain(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()), limits)
}

// callCtx bounds one call; verified calls ask the server to checksum.
func (b *bench) callCtx(ctx context.Context, verify bool) (context.Context, context.CancelFunc) {
	if verify {
		ctx = metadata.AppendToOutgoingContext(ctx, verifyHeader, "1")
	}
	return context.WithTimeout(ctx, b.o.callLimit)
}

// measure runs every method for one size.
func (b *bench) measure(ctx context.Context, size int) *result {
	r := &result{SizeBytes: size, Size: formatSize(size), Op: b.o.op, Mem: b.o.mem, Recv: b.o.recv, Iters: b.o.iters, Inflight: b.o.inflight, Hold: b.o.hold, Conns: b.o.conns}
	pat := pattern(size)

	if err := b.measureGDRPC(ctx, size, pat, r); err != nil {
		r.note("gdrpc", err)
	}
	r.Transport, r.UCXLanes = b.transport, b.lanes
	if !b.o.baselines {
		r.Notes = append(r.Notes, "baselines not measured (-baselines=false)")
	} else {
		b.measureBaselines(ctx, size, pat, r)
	}
	r.VsGRPCTCP = ratio(r.GDRPCMiBs, r.GRPCTCPMiBs)
	r.VsUCXPerftest = ratio(r.GDRPCMiBs, r.UCXPerftestMiBs)
	r.XferVsPerftest = ratio(r.TransferMiBs, r.UCXPerftestMiBs)
	r.VsDtoD = ratio(r.GDRPCMiBs, r.DtoDMiBs)
	r.VsNaive = ratio(r.GDRPCMiBs, r.NaiveMiBs)
	r.CallMicros = callMicros(size, r)
	r.VsRPCCopy = callVsRPCCopy(size, r)
	if r.D2HMiBs != nil {
		ceiling := r.D2HMiBs
		if r.UCXPerftestMiBs != nil && *r.UCXPerftestMiBs < *ceiling {
			ceiling = r.UCXPerftestMiBs
		}
		r.VsD2HPut = ratio(r.GDRPCMiBs, ceiling)
	}
	return r
}

// measureBaselines fills in the baseline columns of r, whose Transport is
// the gdrpc session's.
func (b *bench) measureBaselines(ctx context.Context, size int, pat []byte, r *result) {
	note := r.note
	if v, err := b.measurePlain(ctx, size, pat); err != nil {
		note("grpc-tcp", err)
	} else {
		r.GRPCTCPMiBs = &v
	}
	if skipped := b.perftestSkipped(r.Transport); skipped != "" {
		r.Notes = append(r.Notes, skipped)
	} else {
		r.UCXTLS = perftestTLS()
		pctx, cancel := context.WithTimeout(ctx, b.o.callLimit)
		pr, err := runPerftest(pctx, b.perfBin, b.host, b.info.PerftestPort, size, b.o.iters, max(b.o.warmup, 1), b.o.perftestMem())
		cancel()
		if err != nil {
			note("ucx_perftest", err)
		} else {
			r.UCXPerftestMiBs = &pr.MiBs
		}
	}
	// Measured for every row, next to the row's other figures: a floor taken
	// once would set a later row against a reading of another moment.
	if v, err := b.timeCalls(ctx, 1<<10, b.plainMake(1<<10), nil, nil); err != nil {
		note("rpc 1KiB", err)
	} else {
		us := float64(b.o.inflight<<10) / (v * (1 << 20)) * 1e6
		r.RPCMicros = &us
	}
	if !(b.o.mem == "cuda" && b.o.recv == "cuda") { // there the dtod column is the copy
		if v, err := b.measureCopy(size); err != nil {
			note("copy", err)
		} else {
			r.CopyMiBs = &v
		}
	}
	if b.o.mem == "cuda" && b.o.recv == "host" {
		if v, err := b.measureD2H(size); err != nil {
			note("d2h", err)
		} else {
			r.D2HMiBs = &v
		}
	}
	if b.o.mem == "cuda" && b.o.recv == "cuda" {
		if v, err := b.measureDtoD(size); err != nil {
			note("dtod", err)
		} else {
			r.DtoDMiBs = &v
		}
		if v, err := b.measureNaive(ctx, size, pat); err != nil {
			note("naive", err)
		} else {
			r.NaiveMiBs = &v
		}
	}
}

// perftestSkipped says why ucx_perftest is not measured beside a gdrpc
// session over transport, or "" when it is: it is not there, or the session
// is not a UCX one (ucx_perftest measures UCX's puts).
func (b *bench) perftestSkipped(transport string) string {
	if b.perfBin == "" || b.info.PerftestPort == 0 {
		return b.perfNote
	}
	return perftestSkipped(transport)
}

// measureGDRPC times unary calls whose payload moves out-of-band and reads
// the paths and the transfer times from the metrics hook.
func (b *bench) measureGDRPC(ctx context.Context, size int, pat []byte, r *result) error {
	var src *devicebuf.Buffer
	if b.o.op == "push" {
		var err error
		if src, err = filled(b.alloc, size); err != nil {
			return err
		}
		defer src.Release()
	}
	crc := tensor.ChecksumBytes(pat)
	b.metrics.take()
	var sessions sync.Map           // the IDs of the sessions the calls went over
	var streams []*devicebuf.Stream // per goroutine, with -stream-ordered
	if b.o.ordered {
		for range b.o.inflight {
			s, err := devicebuf.NewStream(b.o.device)
			if err != nil {
				return err
			}
			defer s.Close()
			streams = append(streams, s)
		}
		b.drain = func(w int) error { return streams[w].Synchronize() }
		defer func() { b.drain = nil }()
	}
	held := make([][]*tensorpb.Tensor, b.o.inflight) // per goroutine, with -hold: the oldest first
	defer func() {
		for _, ts := range held {
			for _, t := range ts {
				gdrcodec.ReleaseAll(t)
			}
		}
	}()
	keep := func(w int, t *tensorpb.Tensor) {
		if b.o.hold == 0 {
			gdrcodec.ReleaseAll(t)
			return
		}
		if len(held[w]) == b.o.hold {
			gdrcodec.ReleaseAll(held[w][0])
			held[w] = slices.Delete(held[w], 0, 1)
		}
		held[w] = append(held[w], t)
	}
	// Pull: each call asks for the next variant of the payload in turn and
	// its payload is checked once its time is taken (followUp, in batch): the
	// first call's whole, the others' windows at its start, middle and end.
	// Its release follows the check, timed with the call.
	wins := make([][]window, variants)
	for v := range variants {
		want := pat
		if v > 0 {
			want = variantPattern(size, v)
		}
		wins[v] = windowsOf(want)
	}
	turn := make([]int, b.o.inflight) // per goroutine: its calls so far
	call := func(cctx context.Context, w int, first bool) (*followUp, error) {
		defer trace.StartRegion(cctx, "gdrperf.call").End()
		var p peer.Peer
		var err error
		var after *followUp
		if b.o.op == "pull" {
			v := turn[w] % variants
			turn[w]++
			if first {
				v = 0 // the one whose whole pattern is at hand
			}
			var t *tensorpb.Tensor
			t, err = b.gdrpc.Make(cctx, &tensorpb.Sized{Size: uint64(size), Seed: uint32(v)}, grpc.Peer(&p))
			if err == nil && streams != nil {
				err = waitOn(t, streams[w])
			}
			if err != nil {
				gdrcodec.ReleaseAll(t)
			} else {
				after = &followUp{
					check: func() error {
						var err error
						if first {
							err = checkTensor(t, pat)
						} else {
							err = checkWindows(t, size, wins[v])
						}
						if err != nil {
							return fmt.Errorf("payload variant %d: %w", v, err)
						}
						return nil
					},
					release: func() { keep(w, t) },
				}
			}
		} else {
			req := &tensorpb.Tensor{Name: "gdrperf", Shape: []int64{int64(size)}, Data: gdrcodec.New(src)}
			var sum *tensorpb.Summary
			sum, err = b.gdrpc.Digest(cctx, req, grpc.Peer(&p))
			gdrcodec.ReleaseAll(req)
			switch {
			case err != nil:
			case sum.GetBytes() != uint64(size):
				err = mismatch("the server received %d bytes, want %d", sum.GetBytes(), size)
			case first && sum.GetCrc32C() != crc:
				err = mismatch("the server's CRC-32C is %#x, want %#x", sum.GetCrc32C(), crc)
			}
		}
		if err == nil && first && b.transport == "" {
			b.noteSession(&p)
		}
		if s := transport.SessionFromPeer(&p); s != nil {
			sessions.LoadOrStore(s.ID(), true) // a read once the session is known
		}
		return after, err
	}
	// The warm-up's transfers are not counted; every fallback is reported.
	take := func() []oob.TransferInfo {
		events, fallbacks := b.metrics.take()
		for _, f := range fallbacks {
			if !slices.Contains(r.Fallbacks, f) {
				r.Fallbacks = append(r.Fallbacks, f)
			}
		}
		return events
	}
	rate, err := b.timeCalls(ctx, size, call, func() {
		switch {
		case b.o.op == "push" && b.o.trust && (b.o.reqSpace > 0 || b.o.reqLimit > 0):
			// The server advertises its space for requests once it pulled
			// one (the verified call's): the warm-up's requests and the
			// measured ones are to land there.
			if err := awaitSpaces(ctx, "the server advertised no space for requests", func(st oob.Stats) bool { return st.PeerSpaces > 0 }); err != nil {
				r.Notes = append(r.Notes, err.Error())
			}
		case b.o.op == "pull" && b.o.trust && b.o.space >= 0:
			// This client makes and clears its receive space after a pull
			// prompted it, off the call's path: the warm-up's responses and
			// the measured ones are to land there, not in a rendezvous's
			// destination meanwhile.
			if err := awaitSpaces(ctx, "the client's receive space was still being made", func(st oob.Stats) bool { return st.Making == 0 }); err != nil {
				r.Notes = append(r.Notes, err.Error())
			}
		}
	}, func() { take() })
	if err != nil {
		return err
	}
	events := take()
	if b.o.op == "push" {
		// The timed requests went unchecked (the server checksums a request
		// only when asked to, in the call's time): one more, checked after
		// them, takes their path.
		cctx, cancel := b.callCtx(ctx, true)
		_, err := call(cctx, 0, true)
		cancel()
		take()
		if err != nil {
			return fmt.Errorf("the checked call after the timed ones: %w", err)
		}
	}
	var xfers []time.Duration
	paths := map[string]bool{}
	seen := 0
	for _, e := range events {
		// pull: the client received (Pull); push: the client's side of the
		// server's pull (the owner wrote).
		if e.Pull != (b.o.op == "pull") {
			continue
		}
		seen++
		if e.Err != nil {
			continue
		}
		if e.Advertised {
			// Written into the receiver's space while the owner marshaled its
			// message. Pull: the server wrote, no transfer of the client's
			// to time; push: the client's own write, timed unless it was a
			// device copy queued and not waited for.
			paths[e.Route()+"@space"] = true
			if !e.Pull && !e.Queued {
				xfers = append(xfers, e.Elapsed)
			}
			continue
		}
		paths[e.Route()] = true
		xfers = append(xfers, e.Elapsed)
	}
	if seen < b.o.iters*b.o.inflight {
		paths["inline"] = true
	}
	r.Path = strings.Join(slices.Sorted(maps.Keys(paths)), "+")
	sessions.Range(func(any, any) bool { r.Sessions++; return true })
	r.GDRPCMiBs = positive(rate)
	r.TransferMiBs = positive(medianRate(size, xfers))
	return nil
}

// awaitSpaces waits until ready says the receive spaces are as the measured
// calls need them, for at most 10 s or until ctx ends; then it returns an
// error saying what was not.
func awaitSpaces(ctx context.Context, what string, ready func(oob.Stats) bool) error {
	const limit = 10 * time.Second
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for !ready(oob.ReadStats()) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s within %v: %w", what, limit, ctx.Err())
		case <-tick.C:
		}
	}
	return nil
}

// waitOn orders stream s after the copy that fills t's payload, if it is
// still on its way (a Pending buffer): as an application's kernels would
// queue behind it.
func waitOn(t *tensorpb.Tensor, s *devicebuf.Stream) error {
	buf, ok := gdrcodec.Buffer(t.GetData())
	if !ok {
		return errors.New("the response carries no payload buffer")
	}
	return buf.WaitOn(s)
}

// noteSession records what the gdrpc connection runs over.
func (b *bench) noteSession(p *peer.Peer) {
	s := transport.SessionFromPeer(p)
	if s == nil {
		b.transport = "not gdrpc"
		return
	}
	b.transport = s.Transport()
	if ep := s.Endpoint(); ep != nil {
		raw := ep.TransportInfo()
		b.lanes = ucxLanes(raw)
		if s.WideLane() {
			b.lanes += fmt.Sprintf("; a wide lane over tcp for transfers from %d MiB", transport.WideLaneMin>>20)
		}
		if b.o.verbose {
			b.logf("UCX endpoint of the gdrpc session:\n%s", raw)
		}
	}
}

// ucxLanes summarises ucp_ep_print_info's lane lines ("lane[0]:  8:posix/memory.0
// md[4] -> md[4]/posix/sysdev[255] rma_bw#0 am am_bw#0") as
// "posix/memory(rma_bw,am,am_bw) cma/memory(rma_bw)".
func ucxLanes(info string) string {
	var out []string
	for line := range strings.Lines(info) {
		if !strings.Contains(line, "lane[") {
			continue
		}
		tl := ""
		var roles []string
		for f := range strings.FieldsSeq(line) {
			if m := laneTL.FindStringSubmatch(f); m != nil && tl == "" {
				tl = m[1]
				continue
			}
			if m := laneRole.FindStringSubmatch(f); m != nil && tl != "" && !slices.Contains(roles, m[1]) {
				roles = append(roles, m[1])
			}
		}
		if tl != "" {
			out = append(out, tl+"("+strings.Join(roles, ",")+")")
		}
	}
	return strings.Join(out, " ")
}

var (
	laneTL   = regexp.MustCompile(`^\d+:([A-Za-z0-9_]+/[A-Za-z0-9_:\-]+?)(?:\.\d+)?$`)
	laneRole = regexp.MustCompile(`^(rma_bw|rma|amo|am_bw|am|tag|stream|ka|wireup|rkey_ptr)(?:#\d+)?$`)
)

// window is bytes of a payload's pattern at an offset.
type window struct {
	off  int
	want []byte
}

// windowLen is the length of each window checkWindows reads.
const windowLen = 4 << 10

// windowsOf returns the windows of p that checkWindows compares: its first,
// middle and last windowLen bytes (all of p when it is shorter than three).
func windowsOf(p []byte) []window {
	if len(p) <= 3*windowLen {
		return []window{{0, p}}
	}
	var ws []window
	for _, off := range []int{0, len(p)/2 - windowLen/2, len(p) - windowLen} {
		ws = append(ws, window{off, p[off : off+windowLen]})
	}
	return ws
}

// checkWindows compares the windows ws of a received payload of size bytes
// with the pattern's (device windows are copied to the host for it).
func checkWindows(t *tensorpb.Tensor, size int, ws []window) error {
	b, ok := gdrcodec.Buffer(t.GetData())
	if !ok {
		got, err := tensor.Bytes(t.GetData())
		if err != nil {
			return err
		}
		b = devicebuf.HostFromBytes(got)
		defer b.Release()
	}
	if b.Len() != size {
		return mismatch("received payload of %d bytes, want %d", b.Len(), size)
	}
	for _, w := range ws {
		got := make([]byte, len(w.want))
		dst := devicebuf.HostFromBytes(got)
		v, err := b.Slice(w.off, len(w.want))
		if err == nil {
			err = devicebuf.Copy(dst, v)
			v.Release()
		}
		dst.Release()
		if err != nil {
			return err
		}
		if !bytes.Equal(got, w.want) {
			return mismatch("received payload differs from the pattern in bytes %d-%d", w.off, w.off+len(w.want))
		}
	}
	return nil
}

// checkTensor compares a received payload with the pattern (device payloads
// are copied to the host for it).
func checkTensor(t *tensorpb.Tensor, pat []byte) error {
	got, err := tensor.Bytes(t.GetData())
	if err != nil {
		return err
	}
	if !bytes.Equal(got, pat) {
		return mismatch("received payload of %d bytes differs from the %d bytes sent", len(got), len(pat))
	}
	return nil
}

// measurePlain times the same call over plain gRPC on TCP.
// plainMake is a plain gRPC call of Make for size bytes, unchecked.
func (b *bench) plainMake(size int) callFunc {
	return func(cctx context.Context, w int, _ bool) (*followUp, error) {
		return nil, b.plainConn(w).Invoke(cctx, methodMake, wrapperspb.UInt64(uint64(size)), new(wrapperspb.BytesValue))
	}
}

// callMicros is one call's time in µs: the median call with one in flight,
// the mean call under load with several (each of the goroutines has a call
// in flight all the while, so a call takes inflight × size / rate). Nil when
// gdrpc was not measured.
func callMicros(size int, r *result) *float64 {
	if r.GDRPCMiBs == nil || *r.GDRPCMiBs <= 0 {
		return nil
	}
	return finite(float64(r.Inflight) * float64(size) / (1 << 20) / *r.GDRPCMiBs * 1e6)
}

// callVsRPCCopy is the call time over the floor one call could reach: a plain
// 1 KiB unary call plus an in-process copy of the payload (the dtod column's
// copy for GPU to GPU). With N calls in flight, a call under load over a
// plain 1 KiB call under the same load plus one copy. Nil when a part is
// missing.
func callVsRPCCopy(size int, r *result) *float64 {
	copyRate := r.CopyMiBs
	if copyRate == nil {
		copyRate = r.DtoDMiBs
	}
	call := callMicros(size, r)
	if r.RPCMicros == nil || copyRate == nil || *copyRate <= 0 || call == nil {
		return nil
	}
	floor := *r.RPCMicros + float64(size)/(1<<20) / *copyRate * 1e6
	return finite(*call / floor)
}

// measureCopy times an in-process copy of size bytes from the sender's kind
// of memory (-mem) into the receiver's (-recv).
func (b *bench) measureCopy(size int) (float64, error) {
	allocFor := func(mem string) (devicebuf.Allocator, error) {
		if mem == "cuda" {
			return b.cuda, nil
		}
		return b.o.hostAllocator()
	}
	sa, err := allocFor(b.o.mem)
	if err != nil {
		return 0, err
	}
	da, err := allocFor(b.o.recv)
	if err != nil {
		return 0, err
	}
	src, err := filled(sa, size)
	if err != nil {
		return 0, err
	}
	defer src.Release()
	dst, err := da.Alloc(size)
	if err != nil {
		return 0, err
	}
	defer dst.Release()
	return b.timeCopies(dst, src)
}

func (b *bench) measurePlain(ctx context.Context, size int, pat []byte) (float64, error) {
	crc := uint64(tensor.ChecksumBytes(pat))
	return b.timeCalls(ctx, size, func(cctx context.Context, w int, first bool) (*followUp, error) {
		defer trace.StartRegion(cctx, "gdrperf.grpc").End()
		if b.o.op == "pull" {
			out := new(wrapperspb.BytesValue)
			err := b.plainConn(w).Invoke(cctx, methodMake, wrapperspb.UInt64(uint64(size)), out)
			if err == nil && first && !bytes.Equal(out.GetValue(), pat) {
				err = mismatch("received payload of %d bytes differs from the %d bytes sent", len(out.GetValue()), len(pat))
			}
			return nil, err
		}
		return nil, b.pushPlain(cctx, w, methodPush, pat, first, crc)
	}, nil, nil)
}

// plainConn is the baselines' connection for worker w: the workers share
// the -conns connections as gdrpc's pool spreads calls over its own.
func (b *bench) plainConn(w int) *grpc.ClientConn { return b.plains[w%len(b.plains)] }

// pushPlain sends p in a plain gRPC bytes field to method on worker w's
// connection and, on the first call, checks the server's CRC-32C of what
// arrived.
func (b *bench) pushPlain(ctx context.Context, w int, method string, p []byte, first bool, crc uint64) error {
	out := new(wrapperspb.UInt64Value)
	err := b.plainConn(w).Invoke(ctx, method, wrapperspb.Bytes(p), out)
	if err == nil && first && out.GetValue() != crc {
		err = mismatch("the server's CRC-32C is %#x, want %#x", out.GetValue(), crc)
	}
	return err
}

// callFunc makes one call on worker w (0 ≤ w < -inflight). It may return
// what is left to do with the call's payload.
type callFunc func(ctx context.Context, w int, first bool) (*followUp, error)

// followUp is what a call leaves to do with its payload: check it once the
// call's time was taken, outside that time, then release it, inside (an
// application's release is part of its call). With -inflight N, where the
// batch's wall time is what counts, the goroutines check only their first
// verified call and their last, after the batch; the others are released
// unchecked as they end. With -check ends, one call at a time, only the
// verified call and the measured phase's last are checked (before their
// release, after their time was taken); the others are released unchecked.
// Either field may be nil.
type followUp struct {
	check   func() error
	release func()
}

// finish checks f's payload and releases it, returning how long the release
// took and the check's error.
func (f *followUp) finish() (time.Duration, error) {
	var err error
	if f.check != nil {
		err = f.check()
	}
	start := time.Now()
	if f.release != nil {
		f.release()
	}
	return time.Since(start), err
}

// timeCalls makes the verified call, the warm-up calls, then the measured
// ones, each bounded by callCtx. The verified call runs alone, before the
// others whatever -warmup is, so that what verifying costs (the server's
// checksum, the comparison, noting the session) stays out of the time
// measured. Then -warmup unverified calls: with -inflight N, on each of the
// N goroutines, so that every goroutine's destinations are warm. With
// -inflight 1 the measured phase is iters calls one after another, and the
// rate is size / the median call time. With -inflight N, N goroutines make
// iters calls each, back to back, and the rate is all their bytes over the
// wall time from the first start to the last end. The hooks, where not nil:
// ready runs after the verified call, before the warm-up, and waits for
// what the verified call set going and the measured calls need (a receive
// space), so that the warm-up's calls take the measured calls' path and
// its first-use costs; measuring runs between the warm-up and the measured
// phase.
func (b *bench) timeCalls(ctx context.Context, size int, call callFunc, ready, measuring func()) (float64, error) {
	if _, _, err := b.batch(ctx, call, 1, 1, true, false); err != nil {
		return 0, err
	}
	if ready != nil {
		ready()
	}
	if b.o.warmup > 0 {
		if _, _, err := b.batch(ctx, call, b.o.inflight, b.o.warmup, false, false); err != nil {
			return 0, err
		}
	}
	if measuring != nil {
		measuring()
	}
	calls, wall, err := b.batch(ctx, call, b.o.inflight, b.o.iters, false, true)
	if err != nil {
		return 0, err
	}
	if b.o.inflight == 1 {
		return medianRate(size, calls), nil
	}
	return mibPerSec(size*len(calls), wall), nil
}

// batch runs n calls on each of workers goroutines and returns each call's
// time and the wall time of the whole. With verify, worker 0's first call
// is verified. measured marks the measured phase: with -check ends, one
// call at a time, its last call is checked, and no warm-up call but the
// verified one (whose read-back would come just before the first measured
// call). The first failure stops the other goroutines' calls and is
// the error returned.
func (b *bench) batch(ctx context.Context, call callFunc, workers, n int, verify, measured bool) ([]time.Duration, time.Duration, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	times := make([][]time.Duration, workers)
	later := make([][]*followUp, workers) // -inflight N: the follow-ups run after the batch
	var first error
	var fail sync.Once
	failed := func(w, i int, err error) {
		fail.Do(func() {
			first = fmt.Errorf("call %d: %w", i, err)
			if workers > 1 {
				first = fmt.Errorf("goroutine %d, %w", w, first)
			}
			cancel()
		})
	}
	var wg sync.WaitGroup
	start := time.Now()
	for w := range workers {
		wg.Go(func() {
			for i := range n {
				verified := verify && w == 0 && i == 0
				cctx, ccancel := b.callCtx(ctx, verified)
				t0 := time.Now()
				after, err := call(cctx, w, verified)
				if err == nil && b.drain != nil && (workers == 1 || i == n-1) {
					err = b.drain(w)
				}
				d := time.Since(t0)
				ccancel()
				if after != nil {
					switch {
					case err != nil:
						after.finish() // released; the call's error is what counts
					case workers == 1:
						if b.o.check == "ends" && !verified && (i < n-1 || !measured) {
							after.check = nil
						}
						var took time.Duration
						took, err = after.finish()
						d += took
					case verified || i == n-1:
						later[w] = append(later[w], after)
					default:
						after.check = nil
						after.finish()
					}
				}
				if err != nil {
					failed(w, i, err)
					return
				}
				times[w] = append(times[w], d)
			}
		})
	}
	wg.Wait()
	wall := time.Since(start)
	for w, fs := range later {
		for _, f := range fs {
			if _, err := f.finish(); err != nil {
				failed(w, n-1, err)
			}
		}
	}
	return slices.Concat(times...), wall, first
}

// measureD2H times an in-process copy of size bytes from the GPU into
// registered host memory: the first half of the staged path.
func (b *bench) measureD2H(size int) (float64, error) {
	src, err := filled(b.cuda, size)
	if err != nil {
		return 0, err
	}
	defer src.Release()
	host, err := b.o.hostAllocator()
	if err != nil {
		return 0, err
	}
	dst, err := host.Alloc(size)
	if err != nil {
		return 0, err
	}
	defer dst.Release()
	return b.timeCopies(dst, src)
}

// timeCopies returns the rate of devicebuf.Copy(dst, src) at its median
// time over the measured iterations, after the warm-up ones. A copy shorter than the clock
// can time well is repeated within its iteration, and the iteration's time
// divided among them.
func (b *bench) timeCopies(dst, src *devicebuf.Buffer) (float64, error) {
	const atLeast = 20 * time.Microsecond
	var ds []time.Duration
	for i := range b.o.warmup + b.o.iters {
		start := time.Now()
		reps := 0
		for {
			if err := devicebuf.Copy(dst, src); err != nil {
				return 0, err
			}
			reps++
			if time.Since(start) >= atLeast {
				break
			}
		}
		if i >= b.o.warmup {
			ds = append(ds, time.Since(start)/time.Duration(reps))
		}
	}
	return medianRate(dst.Len(), ds), nil
}

// measureDtoD times an in-process device-to-device copy of size bytes: on
// one GPU, or with -server-device another, a peer copy in the direction the
// payload moves (pull: server's GPU to client's; push: the reverse).
func (b *bench) measureDtoD(size int) (float64, error) {
	srcAlloc, dstAlloc := b.cuda, b.cuda
	if b.o.srvDevice != b.o.device {
		peer, err := devicebuf.NewCUDAAllocator(b.o.srvDevice)
		if err != nil {
			return 0, fmt.Errorf("-server-device %d: %w", b.o.srvDevice, err)
		}
		if srcAlloc = peer; b.o.op == "push" {
			srcAlloc, dstAlloc = b.cuda, peer
		}
	}
	src, err := filled(srcAlloc, size)
	if err != nil {
		return 0, err
	}
	defer src.Release()
	dst, err := dstAlloc.Alloc(size)
	if err != nil {
		return 0, err
	}
	defer dst.Release()
	return b.timeCopies(dst, src)
}

// measureNaive times what a user does today with a GPU payload: device to
// host, plain gRPC bytes over TCP, host to device.
func (b *bench) measureNaive(ctx context.Context, size int, pat []byte) (float64, error) {
	devs := make([]*devicebuf.Buffer, b.o.inflight) // per worker; push: the source, pull: the destination
	defer func() {
		for _, d := range devs {
			if d != nil {
				d.Release()
			}
		}
	}()
	for w := range devs {
		var err error
		if devs[w], err = filled(b.cuda, size); err != nil {
			return 0, err
		}
	}
	crc := uint64(tensor.ChecksumBytes(pat))
	return b.timeCalls(ctx, size, func(cctx context.Context, w int, first bool) (*followUp, error) {
		dev := devs[w]
		if b.o.op == "pull" {
			out := new(wrapperspb.BytesValue)
			if err := b.plainConn(w).Invoke(cctx, methodMakeNaive, wrapperspb.UInt64(uint64(size)), out); err != nil {
				return nil, err
			}
			if err := copyIn(dev, out.GetValue()); err != nil || !first {
				return nil, err
			}
			return &followUp{check: func() error {
				back := make([]byte, size)
				if err := copyOut(back, dev); err != nil {
					return err
				}
				if !bytes.Equal(back, pat) {
					return mismatch("received payload differs from the one sent")
				}
				return nil
			}}, nil
		}
		host := make([]byte, size)
		if err := copyOut(host, dev); err != nil {
			return nil, err
		}
		return nil, b.pushPlain(cctx, w, methodPushNaive, host, first, crc)
	}, nil, nil)
}

func copyIn(dst *devicebuf.Buffer, p []byte) error {
	src := devicebuf.HostFromBytes(p)
	defer src.Release()
	return devicebuf.Copy(dst, src)
}

func copyOut(p []byte, src *devicebuf.Buffer) error {
	dst := devicebuf.HostFromBytes(p)
	defer dst.Release()
	return devicebuf.Copy(dst, src)
}
