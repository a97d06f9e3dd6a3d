package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// reporter prints results as a table or as JSON lines.
type reporter struct {
	o   *options
	w   io.Writer
	tw  *tabwriter.Writer
	enc *json.Encoder

	notes []string // printed under the table
	err   error    // the first row that could not be written
}

func newReporter(w io.Writer, o *options) *reporter {
	r := &reporter{o: o, w: w}
	if o.format == "json" {
		r.enc = json.NewEncoder(w)
	} else {
		r.tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	}
	return r
}

func (r *reporter) header(b *bench) {
	if r.enc != nil {
		return
	}
	o := r.o
	session := b.transport
	if b.lanes != "" {
		session += " (" + b.lanes + ")"
	}
	// A call's time depends on GOMAXPROCS and on the cores a process may
	// run on where idle cores are slow to wake (README, Performance): a run
	// names both processes'.
	procs := strconv.Itoa(runtime.GOMAXPROCS(0))
	if b.info.Procs > 0 {
		procs += fmt.Sprintf(" (server %d)", b.info.Procs)
	}
	cpus := ""
	if c := allowedCPUs(); c != "" {
		cpus = " cpus=" + c
		if b.info.CPUs != "" {
			cpus += " (server " + b.info.CPUs + ")"
		}
	}
	hold := ""
	if o.hold > 0 {
		hold = fmt.Sprintf(" hold=%d", o.hold)
	}
	fmt.Fprintf(r.w, "# gdrperf op=%s mem=%s recv=%s transport=%s paths=%s iters=%d warmup=%d inflight=%s conns=%d%s gomaxprocs=%s%s; gdrpc session over %s\n",
		o.op, o.mem, o.recv, o.transport, o.paths, o.iters, o.warmup, counts(o.inflights), o.conns, hold, procs, cpus, session)
	what := "client calls Make, pulls the server's payload"
	if o.op == "push" {
		what = "client calls Digest, the server pulls the client's payload"
	}
	rate := "size / call time, median"
	switch {
	case len(o.inflights) > 1:
		rate = fmt.Sprintf("with 1 in flight, size / call time, median; with N in flight, aggregate: N goroutines make %d calls each, all bytes / wall time", o.iters)
	case o.inflights[0] > 1:
		rate = fmt.Sprintf("aggregate: %d goroutines make %d calls each, all bytes / wall time", o.inflights[0], o.iters)
	}
	fmt.Fprintf(r.w, "# gdrpc: unary call, payload out-of-band (%s); MiB/s = %s; call µs = one call's time (in flight N: N x size / rate, the mean call under load); xfer = the out-of-band transfer alone, median (op push into a request space: the client's write into it)\n", what, rate)
	fmt.Fprintf(r.w, "# grpc-tcp: plain gRPC-Go over TCP, bytes field, default codec and windows, message limits raised; same calls\n")
	if skipped := b.perftestSkipped(b.transport); skipped == "" {
		mem := o.perftestMem()
		if mem == "" {
			mem = "host,host"
		}
		fmt.Fprintf(r.w, "# ucx_perftest: ucp_put_bw, UCX_TLS=%s, memory %s, overall bandwidth of -n %d puts, or as many as move 64 MiB (beside a gdrpc session over UCX only)\n", perftestTLS(), mem, o.iters)
	} else {
		fmt.Fprintf(r.w, "# ucx_perftest: %s\n", skipped)
	}
	fmt.Fprintf(r.w, "# x grpc = gdrpc MiB/s / grpc-tcp MiB/s; x perftest = gdrpc MiB/s / ucx_perftest MiB/s (the whole call against UCX's puts alone); xfer/perftest = xfer MiB/s / ucx_perftest MiB/s (the out-of-band transfer alone against UCX's puts)\n")
	cols := []string{"size", "path", "gdrpc MiB/s", "call µs", "xfer MiB/s", "grpc-tcp MiB/s", "x grpc", "ucx_perftest MiB/s", "x perftest", "xfer/perftest"}
	if len(o.inflights) > 1 {
		cols = slices.Insert(cols, 1, "inflight")
	}
	fmt.Fprintf(r.w, "# call/(rpc+copy): gdrpc call time / (plain gRPC unary call of 1 KiB + in-process copy of the payload, %s to %s memory; GPU to GPU: the dtod copy): 1.00x is one RPC plus one copy; with N in flight, the call µs column over a plain 1 KiB call under the same load plus one copy\n", o.mem, o.recv)
	cols = append(cols, "rpc 1KiB µs", "call/(rpc+copy)")
	switch o.gpuBaseline() {
	case "d2h":
		fmt.Fprintf(r.w, "# d2h: in-process GPU to registered host memory copy; x min: gdrpc / min(d2h, ucx_perftest), the staged path's ceiling\n")
	case "peer":
		fmt.Fprintf(r.w, "# server on GPU %d, client on GPU %d; peer: in-process copy between them (cuMemcpyPeer) in the payload's direction\n", o.srvDevice, o.device)
		fmt.Fprintf(r.w, "# naive: device to host, plain gRPC bytes over TCP, host to device\n")
	case "dtod":
		fmt.Fprintf(r.w, "# dtod: in-process device-to-device copy, one after another; naive: device to host, plain gRPC bytes over TCP, host to device, same calls\n")
	}
	cols = append(cols, gpuColumns[o.gpuBaseline()]...)
	fmt.Fprintln(r.tw, strings.Join(cols, "\t")+"\t")
}

// gpuBaseline names the GPU baselines a run sets gdrpc against, by where its
// payloads live and land: "d2h" (GPU to host memory: the staged path's
// ceiling), "peer" (GPU to another GPU), "dtod" (GPU to GPU on one device),
// or "" (host memory, none).
func (o *options) gpuBaseline() string {
	switch {
	case o.mem != "cuda":
		return ""
	case o.recv == "host":
		return "d2h"
	case o.srvDevice != o.device:
		return "peer"
	}
	return "dtod"
}

// gpuColumns are the columns of each GPU baseline, rate and ratio in turn.
var gpuColumns = map[string][]string{
	"d2h":  {"d2h MiB/s", "x min(d2h,put)"},
	"peer": {"peer MiB/s", "x peer", "naive MiB/s", "x naive"},
	"dtod": {"dtod MiB/s", "x dtod", "naive MiB/s", "x naive"},
}

// num prints a rate: whole numbers with thousands separators, and three
// significant digits below 100 (small payloads, where the rate stands for the
// call's latency).
func num(v *float64) string {
	switch {
	case v == nil:
		return "-"
	case *v < 100:
		return strconv.FormatFloat(*v, 'g', 3, 64)
	}
	return commas(*v)
}

// rat prints a ratio: whole numbers from 10, else three significant digits
// (0.00123x, not 0.00x).
func rat(v *float64) string {
	switch {
	case v == nil:
		return "-"
	case *v >= 10:
		return fmt.Sprintf("%.0fx", *v)
	case *v >= 1 || *v <= 0 || math.IsNaN(*v):
		return fmt.Sprintf("%.2fx", *v)
	}
	digits := 2 - int(math.Floor(math.Log10(*v))) // after the point, for three significant ones
	return strconv.FormatFloat(*v, 'f', digits, 64) + "x"
}

// commas prints v rounded, with thousands separators.
func commas(v float64) string {
	s := fmt.Sprintf("%.0f", v)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func (r *reporter) row(res *result) {
	if r.enc != nil {
		if err := r.enc.Encode(res); err != nil && r.err == nil {
			r.err = fmt.Errorf("row %s: %w", res.Size, err)
		}
		return
	}
	path := res.Path
	if path == "" {
		path = "-"
	}
	cols := []string{res.Size, path, num(res.GDRPCMiBs), num(res.CallMicros), num(res.TransferMiBs), num(res.GRPCTCPMiBs), rat(res.VsGRPCTCP),
		num(res.UCXPerftestMiBs), rat(res.VsUCXPerftest), rat(res.XferVsPerftest)}
	if len(r.o.inflights) > 1 {
		cols = slices.Insert(cols, 1, strconv.Itoa(res.Inflight))
	}
	cols = append(cols, num(res.RPCMicros), rat(res.VsRPCCopy))
	switch r.o.gpuBaseline() {
	case "d2h":
		cols = append(cols, num(res.D2HMiBs), rat(res.VsD2HPut))
	case "peer", "dtod":
		cols = append(cols, num(res.DtoDMiBs), rat(res.VsDtoD), num(res.NaiveMiBs), rat(res.VsNaive))
	}
	fmt.Fprintln(r.tw, strings.Join(cols, "\t")+"\t")
	for _, n := range res.Notes {
		r.notes = append(r.notes, res.Size+": "+n)
	}
	for _, f := range res.Fallbacks {
		r.notes = append(r.notes, res.Size+": fallback "+f)
	}
}

// counts prints a list of whole numbers as -inflight takes it.
func counts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func (r *reporter) flush() error {
	if r.err != nil {
		return r.err
	}
	if r.tw == nil {
		return nil
	}
	if err := r.tw.Flush(); err != nil {
		return err
	}
	for _, n := range r.notes {
		fmt.Fprintln(r.w, "# note:", n)
	}
	return nil
}

// spread is a figure over the runs that measured it: the median and the
// range.
type spread struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	Runs   int     `json:"runs"`
}

// spreadOf returns the spread of the figures f finds in rs; nil where no
// run measured it.
func spreadOf(rs []*result, f func(*result) *float64) *spread {
	var xs []float64
	for _, r := range rs {
		if v := f(r); v != nil {
			xs = append(xs, *v)
		}
	}
	if len(xs) == 0 {
		return nil
	}
	return &spread{Median: median(xs), Min: slices.Min(xs), Max: slices.Max(xs), Runs: len(xs)}
}

// summaryRow is one size's figures, at one count in flight, over the runs
// of -runs: each figure's median and range over the runs that measured it.
type summaryRow struct {
	SizeBytes int      `json:"size_bytes"`
	Size      string   `json:"size"`
	Inflight  int      `json:"inflight"`
	Runs      int      `json:"runs"`  // the runs that ended, this row's or not
	Asked     int      `json:"asked"` // -runs
	Paths     []string `json:"paths"` // the paths the runs' payloads took, each once
	// The figures of a run's row (nil where no run measured one).
	GDRPCMiBs  *spread `json:"gdrpc_mib_s"`
	Call       *spread `json:"call_us"`
	Transfer   *spread `json:"transfer_mib_s"`
	VsGRPC     *spread `json:"gdrpc_vs_grpc_tcp"`
	Perftest   *spread `json:"ucx_perftest_mib_s"`
	VsPerf     *spread `json:"gdrpc_vs_ucx_perftest"`
	XferVsPerf *spread `json:"xfer_vs_ucx_perftest"`
	RPC        *spread `json:"rpc_1kib_us"`
	VsRPCCopy  *spread `json:"call_vs_rpc_plus_copy"`
	VsD2HPut   *spread `json:"gdrpc_vs_min_d2h_put,omitempty"`
	VsDtoD     *spread `json:"gdrpc_vs_dtod,omitempty"` // against the peer copy with -server-device another GPU
	VsNaive    *spread `json:"gdrpc_vs_naive,omitempty"`
}

// summarize groups the rows of runs by size and count in flight, in the
// order the runs measured them, out of the rows gdrpc measured: a size no
// run measured keeps its row, with no figures.
func summarize(runs [][]*result, asked int) []summaryRow {
	type key struct{ size, inflight int }
	var order []key
	rows := map[key][]*result{}
	for _, rs := range runs {
		for _, r := range rs {
			k := key{r.SizeBytes, r.Inflight}
			if _, ok := rows[k]; !ok {
				order = append(order, k)
				rows[k] = nil
			}
			if r.GDRPCMiBs != nil {
				rows[k] = append(rows[k], r)
			}
		}
	}
	out := make([]summaryRow, 0, len(order))
	for _, k := range order {
		rs := rows[k]
		s := summaryRow{SizeBytes: k.size, Size: formatSize(k.size), Inflight: k.inflight, Runs: len(runs), Asked: asked, Paths: []string{}}
		for _, r := range rs {
			if !slices.Contains(s.Paths, r.Path) {
				s.Paths = append(s.Paths, r.Path)
			}
		}
		s.GDRPCMiBs = spreadOf(rs, func(r *result) *float64 { return r.GDRPCMiBs })
		s.Call = spreadOf(rs, func(r *result) *float64 { return r.CallMicros })
		// nil where no transfer was timed: the payload was inline or landed in space
		s.Transfer = spreadOf(rs, func(r *result) *float64 { return r.TransferMiBs })
		s.VsGRPC = spreadOf(rs, func(r *result) *float64 { return r.VsGRPCTCP })
		s.Perftest = spreadOf(rs, func(r *result) *float64 { return r.UCXPerftestMiBs })
		s.VsPerf = spreadOf(rs, func(r *result) *float64 { return r.VsUCXPerftest })
		s.XferVsPerf = spreadOf(rs, func(r *result) *float64 { return r.XferVsPerftest })
		s.RPC = spreadOf(rs, func(r *result) *float64 { return r.RPCMicros })
		s.VsRPCCopy = spreadOf(rs, func(r *result) *float64 { return r.VsRPCCopy })
		s.VsD2HPut = spreadOf(rs, func(r *result) *float64 { return r.VsD2HPut })
		s.VsDtoD = spreadOf(rs, func(r *result) *float64 { return r.VsDtoD })
		s.VsNaive = spreadOf(rs, func(r *result) *float64 { return r.VsNaive })
		out = append(out, s)
	}
	return out
}

// writeSummary writes, after the runs' tables, the medians over the runs
// that ended (runs): as a table, or as JSON objects {"summary": ...}, whose
// shape differs from a run's rows.
func writeSummary(w io.Writer, o *options, runs [][]*result) error {
	rows := summarize(runs, o.runs)
	if o.format == "json" {
		enc := json.NewEncoder(w)
		for _, s := range rows {
			if err := enc.Encode(struct {
				Summary summaryRow `json:"summary"`
			}{s}); err != nil {
				return err
			}
		}
		return nil
	}
	over := fmt.Sprintf("%d runs", len(runs))
	if len(runs) < o.runs {
		over = fmt.Sprintf("the %d of %d runs that ended", len(runs), o.runs)
	}
	fmt.Fprintf(w, "# medians over %s; call µs, xfer, ucx_perftest and the ratios with their range, (min-max); (k runs): fewer runs measured the figure\n", over)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	cols := []string{"size", "path", "gdrpc MiB/s", "call µs", "xfer MiB/s", "x grpc", "ucx_perftest MiB/s", "x perftest", "xfer/perftest", "rpc 1KiB µs", "call/(rpc+copy)"}
	if len(o.inflights) > 1 {
		cols = slices.Insert(cols, 1, "inflight")
	}
	gpu := o.gpuBaseline()
	for i, c := range gpuColumns[gpu] {
		if i%2 == 1 { // the ratios, not the baselines' rates
			cols = append(cols, c)
		}
	}
	fmt.Fprintln(tw, strings.Join(cols, "\t")+"\t")
	all := len(runs)
	for _, s := range rows {
		path := strings.Join(s.Paths, ",")
		if path == "" {
			path = "-"
		}
		cells := []string{s.Size, path, s.GDRPCMiBs.cell(num, false, all), s.Call.cell(num, true, all), s.Transfer.cell(num, true, all),
			s.VsGRPC.cell(rat, true, all), s.Perftest.cell(num, true, all), s.VsPerf.cell(rat, true, all), s.XferVsPerf.cell(rat, true, all),
			s.RPC.cell(num, false, all), s.VsRPCCopy.cell(rat, true, all)}
		if len(o.inflights) > 1 {
			cells = slices.Insert(cells, 1, strconv.Itoa(s.Inflight))
		}
		switch gpu {
		case "d2h":
			cells = append(cells, s.VsD2HPut.cell(rat, true, all))
		case "peer", "dtod":
			cells = append(cells, s.VsDtoD.cell(rat, true, all), s.VsNaive.cell(rat, true, all))
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	return tw.Flush()
}

// cell prints a spread for the summary table: the median, with the range
// where withRange is and the runs' figures differ, and how many runs
// measured it where fewer than all (of the runs that ended) did.
func (s *spread) cell(format func(*float64) string, withRange bool, all int) string {
	if s == nil {
		return "-"
	}
	c := format(&s.Median)
	if withRange && s.Runs > 1 && s.Min < s.Max {
		c += " (" + format(&s.Min) + "-" + format(&s.Max) + ")"
	}
	switch {
	case s.Runs == 1 && all > 1:
		c += " (1 run)"
	case s.Runs < all:
		c += fmt.Sprintf(" (%d runs)", s.Runs)
	}
	return c
}
