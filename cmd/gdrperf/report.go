package main

import (
	"encoding/json"
	"fmt"
	"io"
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
	fmt.Fprintf(r.w, "# gdrperf op=%s mem=%s recv=%s transport=%s paths=%s iters=%d warmup=%d inflight=%s conns=%d gomaxprocs=%s%s; gdrpc session over %s\n",
		o.op, o.mem, o.recv, o.transport, o.paths, o.iters, o.warmup, counts(o.inflights), o.conns, procs, cpus, session)
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
	if b.perfBin != "" && b.info.PerftestPort != 0 {
		mem := o.perftestMem()
		if mem == "" {
			mem = "host,host"
		}
		fmt.Fprintf(r.w, "# ucx_perftest: ucp_put_bw, UCX_TLS=%s, memory %s, overall bandwidth of -n %d puts, or as many as move 64 MiB\n", perftestTLS(o.transport), mem, o.iters)
	} else {
		fmt.Fprintf(r.w, "# ucx_perftest: %s\n", b.perfNote)
	}
	cols := []string{"size", "path", "gdrpc MiB/s", "call µs", "xfer MiB/s", "grpc-tcp MiB/s", "x grpc", "ucx_perftest MiB/s", "x perftest"}
	if len(o.inflights) > 1 {
		cols = slices.Insert(cols, 1, "inflight")
	}
	fmt.Fprintf(r.w, "# call/(rpc+copy): gdrpc call time / (plain gRPC unary call of 1 KiB + in-process copy of the payload, %s to %s memory; GPU to GPU: the dtod copy): 1.00x is one RPC plus one copy; with N in flight, the call µs column over a plain 1 KiB call under the same load plus one copy\n", o.mem, o.recv)
	cols = append(cols, "rpc 1KiB µs", "call/(rpc+copy)")
	if o.mem == "cuda" && o.recv == "host" {
		fmt.Fprintf(r.w, "# d2h: in-process GPU to registered host memory copy; x min: gdrpc / min(d2h, ucx_perftest), the staged path's ceiling\n")
		cols = append(cols, "d2h MiB/s", "x min(d2h,put)")
	}
	if o.mem == "cuda" && o.recv == "cuda" {
		if o.srvDevice != o.device {
			fmt.Fprintf(r.w, "# server on GPU %d, client on GPU %d; peer: in-process copy between them (cuMemcpyPeer) in the payload's direction\n", o.srvDevice, o.device)
			fmt.Fprintf(r.w, "# naive: device to host, plain gRPC bytes over TCP, host to device\n")
			cols = append(cols, "peer MiB/s", "x peer", "naive MiB/s", "x naive")
		} else {
			fmt.Fprintf(r.w, "# dtod: in-process device-to-device copy, one after another; naive: device to host, plain gRPC bytes over TCP, host to device, same calls\n")
			cols = append(cols, "dtod MiB/s", "x dtod", "naive MiB/s", "x naive")
		}
	}
	fmt.Fprintln(r.tw, strings.Join(cols, "\t")+"\t")
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

func rat(v *float64) string {
	if v == nil {
		return "-"
	}
	if *v >= 10 {
		return fmt.Sprintf("%.0fx", *v)
	}
	return fmt.Sprintf("%.2fx", *v)
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
	g, x := &res.GDRPCMiBs, &res.TransferMiBs
	if res.GDRPCMiBs == 0 {
		g = nil
	}
	if res.TransferMiBs == 0 {
		x = nil
	}
	cols := []string{res.Size, path, num(g), num(res.CallMicros), num(x), num(res.GRPCTCPMiBs), rat(res.VsGRPCTCP), num(res.UCXPerftestMiBs), rat(res.VsUCXPerftest)}
	if len(r.o.inflights) > 1 {
		cols = slices.Insert(cols, 1, strconv.Itoa(res.Inflight))
	}
	cols = append(cols, num(res.RPCMicros), rat(res.VsRPCCopy))
	if r.o.mem == "cuda" && r.o.recv == "host" {
		cols = append(cols, num(res.D2HMiBs), rat(res.VsD2HPut))
	}
	if r.o.mem == "cuda" && r.o.recv == "cuda" {
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
