package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/internal/leaktest"
	"github.com/gdrpc/gdrpc/internal/leaktest/oobleak"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		// This test binary was re-executed as the server of a same-host run.
		os.Exit(realMain(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	before := runtime.NumGoroutine()
	os.Exit(leaktest.Run(m, func() error { return oobleak.Settled(before) }))
}

func requireUCX(t *testing.T) {
	t.Helper()
	testenv.Need(t, "ucx", rdma.Available())
}

// gdrperf runs the tool in this process (the server re-executes this test
// binary) and returns its JSON results.
func gdrperf(t *testing.T, args ...string) []result {
	t.Helper()
	var out, errb bytes.Buffer
	code := realMain(append([]string{"-format", "json"}, args...), strings.NewReader(""), &out, &errb)
	require.Equal(t, 0, code, "gdrperf %s\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), out.String(), errb.String())
	var rs []result
	text := out.String()
	sc := bufio.NewScanner(&out)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r result
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), "line %q", sc.Text())
		rs = append(rs, r)
	}
	require.NoError(t, sc.Err(), "gdrperf's output:\n%s", text)
	// The keys the report promises, present even when a baseline is missing.
	for line := range strings.Lines(out.String()) {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m))
		for _, k := range []string{"size_bytes", "path", "gdrpc_mib_s", "grpc_tcp_mib_s", "ucx_perftest_mib_s", "gdrpc_vs_grpc_tcp", "gdrpc_vs_ucx_perftest", "xfer_vs_ucx_perftest", "transfer_mib_s"} {
			require.Contains(t, m, k)
		}
	}
	return rs
}

// poolsInUse counts the buffers handed out by the host pools the tool uses.
func poolsInUse() [2]int {
	n := [2]int{oob.HostPool(nil).Stats().InUse}
	if rdma.Available() == nil {
		if rc, err := rdma.Default(); err == nil {
			n[1] = oob.HostPool(rc).Stats().InUse
		}
	}
	return n
}

func TestEndToEnd(t *testing.T) {
	tests := []struct {
		name      string
		transport string
		op        string
		path      string // of the out-of-band size
		// orRendezvous: some calls of the out-of-band size may also take
		// the rendezvous (path "rdma"). A space's advertisement and its
		// SPACE-FREEs travel on the control lane beside the calls: on a
		// loaded machine a measured call may find no room in it yet.
		orRendezvous bool
		perftest     bool
		args         []string
	}{
		{name: "tcp/pull", transport: "tcp", op: "pull", path: "stream"},
		{name: "tcp/push", transport: "tcp", op: "push", path: "stream"},
		{name: "ucx/pull", transport: "ucx", op: "pull", path: "rdma", perftest: true},
		{name: "ucx/push", transport: "ucx", op: "push", path: "rdma"},
		{name: "ucx/stream only", transport: "ucx", op: "pull", path: "stream", args: []string{"-paths", "stream"}},
		{name: "tcp/push inflight", transport: "tcp", op: "push", path: "stream", args: []string{"-inflight", "3"}},
		// The threshold reaches the re-executed server, which sends inline.
		{name: "tcp/pull eager", transport: "tcp", op: "pull", path: "inline", args: []string{"-eager", "2MiB"}},
		{name: "ucx/pull inflight", transport: "ucx", op: "pull", path: "rdma", args: []string{"-inflight", "3"}},
		{name: "ucx/pull inflight conns", transport: "ucx", op: "pull", path: "rdma", args: []string{"-inflight", "3", "-conns", "2"}},
		// Each goroutine keeps its last payloads, released by the end (the
		// pools' check below).
		{name: "tcp/pull hold", transport: "tcp", op: "pull", path: "stream", args: []string{"-inflight", "2", "-hold", "2", "-iters", "4"}},
		// The server advertises space after the first request it pulled (in
		// the warm-up): the measured requests land there.
		{name: "ucx/push request space", transport: "ucx", op: "push", path: "rdma@space", orRendezvous: true, args: []string{"-trust-peers", "-request-space", "16MiB", "-warmup", "4"}},
		// Spaces that grow, from the Listener's option through the engine.
		{name: "ucx/push request space limit", transport: "ucx", op: "push", path: "rdma@space", orRendezvous: true, args: []string{"-trust-peers", "-request-space-limit", "16MiB", "-warmup", "4"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.transport == "ucx" {
				requireUCX(t)
			}
			perftest := "none"
			if tc.perftest {
				perftest = ""
			}
			base := poolsInUse()
			args := append([]string{"-sizes", "4KiB,1MiB", "-iters", "2", "-warmup", "1",
				"-transport", tc.transport, "-op", tc.op, "-perftest", perftest}, tc.args...)
			rs := gdrperf(t, args...)
			require.Len(t, rs, 2)
			for i, want := range []struct {
				size int
				path string
			}{{4 << 10, "inline"}, {1 << 20, tc.path}} {
				r := rs[i]
				require.Equal(t, want.size, r.SizeBytes)
				if tc.orRendezvous && want.size == 1<<20 {
					paths := strings.Split(r.Path, "+")
					require.Contains(t, paths, want.path, "notes: %v", r.Notes)
					require.Subset(t, []string{want.path, "rdma"}, paths, "notes: %v", r.Notes)
				} else {
					require.Equal(t, want.path, r.Path, "notes: %v", r.Notes)
				}
				require.Equal(t, tc.transport, r.Transport)
				require.Equal(t, tc.op, r.Op)
				require.Equal(t, inflight(tc.args), r.Inflight)
				require.Equal(t, argInt(tc.args, "-hold", 0), r.Hold)
				require.Equal(t, conns(tc.args), r.Sessions, "sessions the calls went over")
				require.Positive(t, val(r.GDRPCMiBs), "notes: %v", r.Notes)
				require.NotNil(t, r.GRPCTCPMiBs, "notes: %v", r.Notes)
				require.Positive(t, *r.GRPCTCPMiBs)
				require.NotNil(t, r.VsGRPCTCP)
				require.InDelta(t, *r.GDRPCMiBs / *r.GRPCTCPMiBs, *r.VsGRPCTCP, 1e-9)
				switch {
				case want.path == "inline":
				case strings.HasSuffix(want.path, "@space"):
					// the client's own write into the server's space, timed
					require.Equal(t, "push", tc.op)
					require.Positive(t, val(r.TransferMiBs))
				default:
					require.Positive(t, val(r.TransferMiBs))
				}
				require.Equal(t, "host", r.Recv)
				require.Nil(t, r.DtoDMiBs)
				require.Nil(t, r.D2HMiBs)
				require.Nil(t, r.NaiveMiBs)
				if !tc.perftest {
					require.Nil(t, r.UCXPerftestMiBs)
					require.Contains(t, strings.Join(r.Notes, "\n"), "ucx_perftest skipped")
					continue
				}
				if _, note, _ := perftestBinary(""); note != "" {
					require.Nil(t, r.UCXPerftestMiBs)
					require.Contains(t, strings.Join(r.Notes, "\n"), "not found")
					continue
				}
				require.NotNil(t, r.UCXPerftestMiBs, "notes: %v", r.Notes)
				require.Positive(t, *r.UCXPerftestMiBs)
				require.InDelta(t, *r.GDRPCMiBs / *r.UCXPerftestMiBs, *r.VsUCXPerftest, 1e-9)
				if r.TransferMiBs == nil {
					require.Nil(t, r.XferVsPerftest)
				} else {
					require.InDelta(t, *r.TransferMiBs / *r.UCXPerftestMiBs, *r.XferVsPerftest, 1e-9)
				}
			}
			require.Equal(t, base, poolsInUse(), "buffers not given back to the host pools")
		})
	}
}

// val is *v, or 0 for nil (a figure not measured).
func val(v *float64) float64 {
	if v == nil {
		return 0
	}
	return *v
}

// conns is the -conns value in args (1 if absent).
func conns(args []string) int { return argInt(args, "-conns", 1) }

// inflight is the -inflight value in args (1 if absent).
func inflight(args []string) int { return argInt(args, "-inflight", 1) }

// argInt is the value of flag in args (def if absent).
func argInt(args []string, flag string, def int) int {
	if i := slices.Index(args, flag); i >= 0 {
		n, _ := strconv.Atoi(args[i+1])
		return n
	}
	return def
}

func TestTable(t *testing.T) {
	// The re-executed server takes the environment's GOMAXPROCS; this
	// process keeps the one it started with.
	t.Setenv("GOMAXPROCS", "1")
	var out, errb bytes.Buffer
	code := realMain([]string{"-sizes", "256KiB", "-iters", "1", "-warmup", "0", "-transport", "tcp", "-perftest", "none"},
		strings.NewReader(""), &out, &errb)
	require.Equal(t, 0, code, errb.String())
	s := out.String()
	require.Contains(t, s, "gdrpc session over tcp")
	require.Contains(t, s, fmt.Sprintf(" gomaxprocs=%d (server 1) cpus=%s (server %[2]s);", runtime.GOMAXPROCS(0), allowedCPUs()))
	require.Regexp(t, `(?m)^\s*size\s+path\s+gdrpc MiB/s\s+call µs\s+xfer MiB/s\s+grpc-tcp MiB/s\s+x grpc\s+ucx_perftest MiB/s\s+x perftest\s+xfer/perftest\s+rpc 1KiB µs\s+call/\(rpc\+copy\)\s*$`, s)
	require.Regexp(t, `(?m)^\s*256KiB\s+stream\s+[0-9.,]+\s+[0-9.,]+\s+[0-9.,]+\s+[0-9.,]+\s+[0-9.]+x\s+-\s+-\s+-\s+[0-9.,]+\s+[0-9.]+x\s*$`, s)
	require.Contains(t, s, "# note: 256KiB: ucx_perftest skipped")
	// The ratios are defined above the columns.
	require.Contains(t, s, "\n# x grpc = gdrpc MiB/s / grpc-tcp MiB/s; x perftest = gdrpc MiB/s / ucx_perftest MiB/s (the whole call against UCX's puts alone); xfer/perftest = xfer MiB/s / ucx_perftest MiB/s (the out-of-band transfer alone against UCX's puts)\n")
}

// TestRuns: -runs measures everything again, each run with a server process
// and connections of its own, then gives each figure's median over the runs
// and its range: JSON objects marked summary after the runs' rows, or a table
// under the runs' tables. No server process is left, and the calls' buffers
// go back to the pools.
func TestRuns(t *testing.T) {
	before, base := childProcesses(t), poolsInUse()
	// 4 KiB travels inline; 256 KiB is pulled over the bulk lane, timed.
	args := []string{"-runs", "3", "-sizes", "4KiB,256KiB", "-iters", "2", "-warmup", "0", "-transport", "tcp", "-perftest", "none"}
	var out, errb bytes.Buffer
	code := realMain(append([]string{"-format", "json"}, args...), strings.NewReader(""), &out, &errb)
	require.Equal(t, 0, code, errb.String())
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 3*2+2, "two rows per run, then a summary per size")
	rows := make([]result, 6)
	for i := range rows {
		require.NoError(t, json.Unmarshal([]byte(lines[i]), &rows[i]))
		require.Equal(t, i/2+1, rows[i].Run, "row %d", i)
	}
	for j, line := range lines[6:] {
		var sum struct{ Summary *summaryRow }
		require.NoError(t, json.Unmarshal([]byte(line), &sum))
		s := sum.Summary
		require.NotNil(t, s, "a summary object after the rows")
		require.Equal(t, 3, s.Runs)
		require.Equal(t, 3, s.Asked)
		require.Equal(t, []int{4 << 10, 256 << 10}[j], s.SizeBytes)
		require.Equal(t, []string{[]string{"inline", "stream"}[j]}, s.Paths)
		var calls, vs, xfers []float64
		for run := range 3 {
			r := rows[2*run+j]
			require.Equal(t, s.SizeBytes, r.SizeBytes)
			require.NotNil(t, r.CallMicros)
			require.NotNil(t, r.VsRPCCopy)
			calls, vs = append(calls, *r.CallMicros), append(vs, *r.VsRPCCopy)
			if r.TransferMiBs != nil {
				xfers = append(xfers, *r.TransferMiBs)
			}
		}
		require.Equal(t, spread{Median: median(calls), Min: slices.Min(calls), Max: slices.Max(calls), Runs: 3}, *s.Call)
		require.Equal(t, spread{Median: median(vs), Min: slices.Min(vs), Max: slices.Max(vs), Runs: 3}, *s.VsRPCCopy)
		require.Nil(t, s.VsPerf, "no run measured it")
		if j == 0 {
			require.Nil(t, s.Transfer, "inline: no transfer")
		} else {
			require.Len(t, xfers, 3, "each run timed the pulls")
			require.Equal(t, spread{Median: median(xfers), Min: slices.Min(xfers), Max: slices.Max(xfers), Runs: 3}, *s.Transfer)
		}
	}

	out.Reset()
	code = realMain(args, strings.NewReader(""), &out, &errb)
	require.Equal(t, 0, code, errb.String())
	table := out.String()
	for run := 1; run <= 3; run++ {
		require.Regexp(t, fmt.Sprintf(`(?m)^# run %d of 3$`, run), table)
	}
	require.Equal(t, 3, strings.Count(table, "# gdrperf op=pull"), "each run's table has its header")
	_, summary, ok := strings.Cut(table, "# medians over 3 runs")
	require.True(t, ok)
	require.Regexp(t, `(?m)^\s*size\s+path\s+gdrpc MiB/s\s+call µs\s+xfer MiB/s\s+x grpc\s+ucx_perftest MiB/s\s+x perftest\s+xfer/perftest\s+rpc 1KiB µs\s+call/\(rpc\+copy\)\s*$`, summary)
	// A figure a run missed adds "(2 runs)".
	spreadCell := `[0-9.,]+ \([0-9.,]+-[0-9.,]+\)( \([12] runs?\))?`
	ratioCell := `[0-9.]+x \([0-9.]+x-[0-9.]+x\)( \([12] runs?\))?`
	require.Regexp(t, `(?m)^\s*4KiB\s+inline\s+[0-9.,]+\s+`+spreadCell+`\s+-\s+`+ratioCell+`\s+-\s+-\s+-\s+[0-9.,]+\s+`+ratioCell+`\s*$`, summary)
	require.Regexp(t, `(?m)^\s*256KiB\s+stream\s+[0-9.,]+\s+`+spreadCell+`\s+`+spreadCell+`\s+`+ratioCell+`\s+-\s+-\s+-\s+[0-9.,]+\s+`+ratioCell+`\s*$`, summary)
	require.Contains(t, table, "# medians over 3 runs;")
	require.Equal(t, before, childProcesses(t), "server processes left")
	require.Equal(t, base, poolsInUse(), "buffers not given back to the host pools")

	// A run that measured nothing (no server to reach) ends the series: the
	// others would fail the same way.
	out.Reset()
	errb.Reset()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	nobody := l.Addr().String() // a port nobody listens on any more
	require.NoError(t, l.Close())
	code = realMain([]string{"-runs", "3", "-connect", nobody, "-sizes", "4KiB", "-perftest", "none", "-warmup", "0", "-iters", "1"}, strings.NewReader(""), &out, &errb)
	require.Equal(t, 1, code)
	require.Equal(t, 1, strings.Count(errb.String(), "gdrpc not measured"), errb.String())
	require.NotContains(t, out.String(), "# run 2 of 3")
}

// A run of -runs cut short (a signal, a timeout around the tool) still
// gives the medians over the runs that ended, and says it was interrupted.
func TestRunsInterrupted(t *testing.T) {
	before := childProcesses(t)
	s := runInterrupted(t, []string{"-runs", "4", "-sizes", "4KiB", "-iters", "2", "-warmup", "0", "-transport", "tcp", "-perftest", "none"}, "# run 3 of 4")
	_, summary, ok := strings.Cut(s, "# medians over the 2 of 4 runs that ended;")
	require.True(t, ok, s)
	require.Regexp(t, `(?m)^\s*4KiB\s+inline\s+[0-9.,]+\s+[0-9.,]+ \([0-9.,]+-[0-9.,]+\)`, summary)
	require.NotContains(t, s, "# run 4 of 4")
	require.Equal(t, before, childProcesses(t), "server processes left")
}

// The summary of -runs, fed rows by hand: rows grouped by size and count in
// flight; each figure the median and range over the runs that measured it,
// a row gdrpc did not measure left out; ranges only where the runs differ.
func TestSummary(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	row := func(size, inflight int, mibs float64, call, vsGRPC, rpc float64) *result {
		r := &result{SizeBytes: size, Size: formatSize(size), Inflight: inflight, Path: "rdma", GDRPCMiBs: f(mibs),
			CallMicros: f(call), VsGRPCTCP: f(vsGRPC), RPCMicros: f(rpc), VsRPCCopy: f(call / (rpc + 10)), TransferMiBs: f(2 * mibs),
			UCXPerftestMiBs: f(4 * mibs)}
		r.VsUCXPerftest, r.XferVsPerftest = ratio(r.GDRPCMiBs, r.UCXPerftestMiBs), ratio(r.TransferMiBs, r.UCXPerftestMiBs)
		return r
	}
	unmeasured := &result{SizeBytes: 1 << 20, Size: "1MiB", Inflight: 4, Path: "", Notes: []string{"failed"}}
	runs := [][]*result{
		{row(1<<20, 1, 100, 50, 2, 30), row(1<<20, 4, 400, 60, 3, 40)},
		{row(1<<20, 1, 300, 70, 4, 30), unmeasured},
		{row(1<<20, 1, 200, 90, 3, 30), row(1<<20, 4, 400, 60, 5, 40)},
	}
	rows := summarize(runs, 4)
	require.Len(t, rows, 2, "one row per size and count in flight")
	one, four := rows[0], rows[1]
	require.Equal(t, []int{1, 4}, []int{one.Inflight, four.Inflight})
	require.Equal(t, 3, one.Runs)
	require.Equal(t, 4, one.Asked)
	require.Equal(t, spread{Median: 200, Min: 100, Max: 300, Runs: 3}, *one.GDRPCMiBs)
	require.Equal(t, spread{Median: 70, Min: 50, Max: 90, Runs: 3}, *one.Call)
	require.Equal(t, spread{Median: 400, Min: 200, Max: 600, Runs: 3}, *one.Transfer)
	require.Equal(t, spread{Median: 3, Min: 2, Max: 4, Runs: 3}, *one.VsGRPC)
	require.Equal(t, spread{Median: 30, Min: 30, Max: 30, Runs: 3}, *one.RPC)
	require.Equal(t, spread{Median: 400, Min: 400, Max: 400, Runs: 2}, *four.GDRPCMiBs, "the run that measured nothing is left out")
	require.Equal(t, spread{Median: 4, Min: 3, Max: 5, Runs: 2}, *four.VsGRPC)
	require.Equal(t, spread{Median: 800, Min: 400, Max: 1200, Runs: 3}, *one.Perftest)
	require.Equal(t, spread{Median: 0.25, Min: 0.25, Max: 0.25, Runs: 3}, *one.VsPerf)
	require.Equal(t, spread{Median: 0.5, Min: 0.5, Max: 0.5, Runs: 3}, *one.XferVsPerf)
	require.Equal(t, []string{"rdma"}, four.Paths)

	o := &options{runs: 4, inflights: []int{1, 4}, mem: "host", recv: "host", format: "table"}
	var out bytes.Buffer
	require.NoError(t, writeSummary(&out, o, runs))
	s := out.String()
	require.Contains(t, s, "# medians over the 3 of 4 runs that ended;")
	require.Regexp(t, `(?m)^\s*size\s+inflight\s+path\s+gdrpc MiB/s\s+call µs\s+xfer MiB/s\s+x grpc\s+ucx_perftest MiB/s\s+x perftest\s+xfer/perftest\s+rpc 1KiB µs\s+call/\(rpc\+copy\)\s*$`, s)
	require.Regexp(t, `(?m)^\s*1MiB\s+1\s+rdma\s+200\s+70 \(50-90\)\s+400 \(200-600\)\s+3\.00x \(2\.00x-4\.00x\)\s+800 \(400-1,200\)\s+0\.250x\s+0\.500x\s+30\s+[0-9.]+x \([0-9.]+x-[0-9.]+x\)\s*$`, s)
	require.Regexp(t, `(?m)^\s*1MiB\s+4\s+rdma\s+400 \(2 runs\)\s+60 \(2 runs\)\s+800 \(2 runs\)\s+4\.00x \(3\.00x-5\.00x\) \(2 runs\)\s+1,600 \(2 runs\)\s+0\.250x \(2 runs\)\s+0\.500x \(2 runs\)\s+40 \(2 runs\)\s+[0-9.]+x \(2 runs\)\s*$`, s, "equal figures print no range")

	// GPU to GPU: the GPU baselines' ratios follow, as in a run's table.
	for _, tc := range []struct {
		device int
		cols   string
	}{{0, `x dtod\s+x naive`}, {1, `x peer\s+x naive`}} {
		gpu := *o
		gpu.mem, gpu.recv, gpu.srvDevice = "cuda", "cuda", tc.device
		out.Reset()
		require.NoError(t, writeSummary(&out, &gpu, runs))
		require.Regexp(t, `(?m)call/\(rpc\+copy\)\s+`+tc.cols+`\s*$`, out.String())
		require.Regexp(t, `(?m)^\s*1MiB\s+1\s+rdma.*\s+-\s+-\s*$`, out.String(), "no run measured them")
	}

	o.format = "json"
	out.Reset()
	require.NoError(t, writeSummary(&out, o, runs))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 2)
	var got struct{ Summary summaryRow }
	require.NoError(t, json.Unmarshal([]byte(lines[0]), &got))
	require.Equal(t, one, got.Summary)
}

// cancelAt collects what is written and calls cancel once mark was written.
type cancelAt struct {
	bytes.Buffer
	mark   string
	cancel func()
}

func (c *cancelAt) Write(p []byte) (int, error) {
	n, err := c.Buffer.Write(p)
	if strings.Contains(c.String(), c.mark) {
		c.cancel()
	}
	return n, err
}

// runInterrupted runs the client with args (a server of its own started)
// and cancels it once its output has mark; it returns the output.
func runInterrupted(t *testing.T, args []string, mark string) string {
	t.Helper()
	o, err := parseFlags(args, io.Discard)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	out := &cancelAt{mark: mark, cancel: cancel}
	require.ErrorIs(t, runClient(ctx, o, out, t.Logf), context.Canceled)
	return out.String()
}

func TestCUDA(t *testing.T) {
	var out, errb bytes.Buffer
	// CUDA IPC and UCX sessions are for trusted peers only; without a receive
	// space every call takes the path it names.
	args := []string{"-sizes", "1MiB", "-iters", "2", "-warmup", "1", "-mem", "cuda", "-perftest", "none", "-trust-peers", "-receive-space", "0"}
	if err := devicebuf.CUDAAvailable(); err != nil {
		if testenv.Required("cuda") {
			t.Fatalf("CUDA required: %v", err)
		}
		// Without a GPU the tool says so and fails before it starts a server.
		code := realMain(args, strings.NewReader(""), &out, &errb)
		require.Equal(t, 1, code)
		require.Contains(t, errb.String(), "-mem/-recv cuda: GPU 0 is not usable")
		require.Empty(t, out.String())
		return
	}
	// GPU to GPU on one host: CUDA IPC (UCX's cuda_ipc lane where UCX moves
	// GPU memory: the default on one device), with the device-to-device copy
	// and the naive way beside it.
	oneDevice := "cuda-ipc"
	if rc, err := rdma.Default(); err == nil && rc.Info().HasMemoryType(rdma.MemoryCUDA) {
		oneDevice = "rdma/cuda"
	}
	rs := gdrperf(t, args...)
	require.Len(t, rs, 1)
	r := rs[0]
	require.Equal(t, oneDevice, r.Path, "notes: %v, fallbacks: %v", r.Notes, r.Fallbacks)
	require.Positive(t, val(r.GDRPCMiBs))
	require.NotNil(t, r.DtoDMiBs, "notes: %v", r.Notes)
	require.NotNil(t, r.NaiveMiBs, "notes: %v", r.Notes)
	require.NotNil(t, r.VsDtoD)
	require.NotNil(t, r.VsNaive)
	require.Nil(t, r.D2HMiBs)

	// Several calls in flight: each goroutine's destinations, one copy engine.
	rs = gdrperf(t, append(args, "-inflight", "3")...)
	require.Len(t, rs, 1)
	r = rs[0]
	require.Equal(t, 3, r.Inflight)
	require.Equal(t, oneDevice, r.Path, "notes: %v, fallbacks: %v", r.Notes, r.Fallbacks)
	require.Positive(t, val(r.GDRPCMiBs))
	require.NotNil(t, r.VsDtoD, "notes: %v", r.Notes)
	require.NotNil(t, r.VsNaive, "notes: %v", r.Notes)

	// Stream-ordered: the payloads land in the client's receive space and are
	// handed out before their copies end; each goroutine's stream catches up
	// before its last call is timed.
	// The space is advertised after the first pull, so the first measured
	// calls may still take the rendezvous.
	rs = gdrperf(t, append(args, "-receive-space", "64MiB", "-stream-ordered", "-inflight", "3", "-warmup", "3")...)
	require.Len(t, rs, 1)
	r = rs[0]
	require.Contains(t, strings.Split(r.Path, "+"), "cuda-ipc@space", "notes: %v, fallbacks: %v", r.Notes, r.Fallbacks)
	require.Positive(t, val(r.GDRPCMiBs))

	// A caller holding more payloads than the space has events: the
	// copies into the space go on (TestGPUEventsShared checks the bytes).
	rs = gdrperf(t, append(args, "-receive-space", "256MiB", "-hold", "40", "-iters", "45", "-warmup", "3")...)
	require.Len(t, rs, 1)
	r = rs[0]
	require.Equal(t, 40, r.Hold)
	require.Contains(t, strings.Split(r.Path, "+"), "cuda-ipc@space", "notes: %v, fallbacks: %v", r.Notes, r.Fallbacks)
	require.Positive(t, val(r.GDRPCMiBs))

	// Pushed into the server's receive space for requests.
	rs = gdrperf(t, append(args, "-op", "push", "-request-space", "64MiB", "-warmup", "4")...)
	require.Len(t, rs, 1)
	r = rs[0]
	require.Contains(t, strings.Split(r.Path, "+"), "cuda-ipc@space", "notes: %v, fallbacks: %v", r.Notes, r.Fallbacks)
	require.Positive(t, val(r.GDRPCMiBs))

	// Between two GPUs of one host: the server on GPU 1, cuda-ipc across
	// devices against an in-process peer copy, pulled and pushed.
	if n, err := devicebuf.DeviceCount(); err == nil && n >= 2 {
		for _, op := range []string{"pull", "push"} {
			rs = gdrperf(t, append(args, "-server-device", "1", "-op", op)...)
			require.Len(t, rs, 1)
			r = rs[0]
			require.Equal(t, "cuda-ipc", r.Path, "op %s notes: %v, fallbacks: %v", op, r.Notes, r.Fallbacks)
			require.NotNil(t, r.DtoDMiBs, "op %s notes: %v", op, r.Notes)
			require.NotNil(t, r.VsDtoD)
		}
	} else {
		t.Log("one GPU: the cross-device run is skipped")
	}

	// GPU to host memory: the staged path where UCX cannot register GPU
	// memory, pushed and pulled.
	requireUCX(t)
	rc, err := rdma.Default()
	require.NoError(t, err)
	for _, op := range []string{"pull", "push"} {
		rs = gdrperf(t, append(args, "-recv", "host", "-transport", "ucx", "-op", op)...)
		require.Len(t, rs, 1)
		r = rs[0]
		// The route is this side's: a client that pulls got puts into its
		// host memory, however the server staged them; a client that pushes
		// stages its GPU source, or has UCX read it.
		want := map[string]string{"pull": "rdma", "push": "staged"}[op]
		if op == "push" && rc.Info().HasMemoryType(rdma.MemoryCUDA) {
			want = "rdma/cuda"
		}
		require.Equal(t, want, r.Path, "notes: %v, fallbacks: %v", r.Notes, r.Fallbacks)
		require.NotNil(t, r.D2HMiBs, "notes: %v", r.Notes)
		require.NotNil(t, r.VsD2HPut)
		require.Nil(t, r.DtoDMiBs)
	}
}

func TestFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		err  string
	}{
		{name: "sizes", args: []string{"-sizes", "1MiB,0"}, err: "positive"},
		{name: "transport", args: []string{"-transport", "rdma"}, err: "-transport"},
		{name: "mem", args: []string{"-mem", "gpu"}, err: "-mem"},
		{name: "op", args: []string{"-op", "get"}, err: "-op"},
		{name: "recv", args: []string{"-recv", "gpu"}, err: "-recv"},
		{name: "paths", args: []string{"-paths", "rdma,ipc"}, err: "-paths"},
		{name: "eager", args: []string{"-eager", "lots"}, err: "-eager"},
		{name: "format", args: []string{"-format", "csv"}, err: "-format"},
		{name: "iters", args: []string{"-iters", "0"}, err: "-iters"},
		{name: "connects", args: []string{"-connects", "-1"}, err: "-connects"},
		{name: "runs", args: []string{"-runs", "0"}, err: "-runs"},
		{name: "inflight", args: []string{"-inflight", "0"}, err: "-inflight"},
		{name: "inflight list", args: []string{"-inflight", "1,x"}, err: "-inflight"},
		{name: "inflight twice", args: []string{"-inflight", "4,1,4"}, err: "twice"},
		{name: "conns", args: []string{"-inflight", "2", "-conns", "3"}, err: "-conns"},
		{name: "conns over the list", args: []string{"-inflight", "1,2", "-conns", "3"}, err: "-conns"},
		{name: "request space twice", args: []string{"-request-space", "8MiB", "-request-space-limit", "1GiB"}, err: "exclude"},
		{name: "both ends", args: []string{"-server", ":1", "-connect", "h:1"}, err: "exclude"},
		{name: "extra", args: []string{"x"}, err: "unexpected"},
		{name: "stream-ordered host", args: []string{"-stream-ordered"}, err: "-recv cuda"},
		{name: "stream-ordered push", args: []string{"-stream-ordered", "-mem", "cuda", "-op", "push"}, err: "-op pull"},
		{name: "hold", args: []string{"-hold", "-1"}, err: "-hold"},
		{name: "hold push", args: []string{"-hold", "4", "-op", "push"}, err: "-op pull"},
		{name: "check", args: []string{"-check", "some"}, err: "-check"},
		{name: "check push", args: []string{"-check", "ends", "-op", "push"}, err: "-op pull"},
		{name: "sizes twice", args: []string{"-sizes", "1MiB,4KiB,1024KiB"}, err: "size 1MiB given twice"},
		// A -connect client finds plain gRPC on PORT+1 and ucx_perftest on PORT+2.
		{name: "server port 0", args: []string{"-server", "127.0.0.1:0"}, err: "want HOST:PORT with a port from 1 to 65533"},
		{name: "server no port", args: []string{"-server", "127.0.0.1"}, err: "want HOST:PORT"},
		{name: "server port too high", args: []string{"-server", ":65534"}, err: "want HOST:PORT"},
		{name: "connect port 0", args: []string{"-connect", "h:0"}, err: "-connect \"h:0\": want HOST:PORT"},
		{name: "connect no port", args: []string{"-connect", "h"}, err: "want HOST:PORT"},
		// For the server this process starts only.
		{name: "server-cpuprofile connect", args: []string{"-connect", "h:1", "-server-cpuprofile", "f"}, err: "-server-cpuprofile and -server-trace"},
		{name: "server-trace connect", args: []string{"-connect", "h:1", "-server-trace", "f"}, err: "-server-cpuprofile and -server-trace"},
		{name: "server-cpuprofile server", args: []string{"-server", "h:1", "-server-cpuprofile", "f"}, err: "-server-cpuprofile and -server-trace"},
		{name: "perftest missing", args: []string{"-perftest", "/nonexistent/ucx_perftest"}, err: `-perftest "/nonexistent/ucx_perftest"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var errb bytes.Buffer
			_, err := parseFlags(tc.args, &errb)
			require.ErrorContains(t, err, tc.err)
		})
	}
	o, err := parseFlags(nil, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, []int{1 << 20, 16 << 20, 64 << 20}, o.sizes)
	require.Equal(t, "pull", o.op)
	require.Equal(t, "host", o.recv, "-recv follows -mem")
	require.Zero(t, o.pathMask, "every path")
	o, err = parseFlags([]string{"-paths", "rdma"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, oob.PathRDMA|oob.PathStream, o.pathMask)
	o, err = parseFlags([]string{"-mem", "cuda"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "cuda", o.recv)
	require.Equal(t, "every", o.check)
	o, err = parseFlags([]string{"-check", "ends"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "ends", o.check)
	// The re-executed server listens on any port, and says which.
	_, err = parseFlags([]string{"-child", "-server", "127.0.0.1:0"}, &bytes.Buffer{})
	require.NoError(t, err)
	_, err = parseFlags([]string{"-server", "127.0.0.1:7000", "-busy", "1"}, &bytes.Buffer{})
	require.NoError(t, err)
	// The perftest binary named is there: its path is taken; "" is looked up
	// in PATH when needed, a note where it is not there.
	if bin, err := exec.LookPath("ls"); err == nil {
		o, err = parseFlags([]string{"-perftest", bin}, &bytes.Buffer{})
		require.NoError(t, err)
		require.Equal(t, bin, o.perftest)
	}
	t.Setenv("PATH", t.TempDir())
	_, err = parseFlags([]string{"-perftest", ""}, &bytes.Buffer{})
	require.NoError(t, err)
	bin, note, err := perftestBinary("")
	require.NoError(t, err)
	require.Empty(t, bin)
	require.Contains(t, note, "ucx_perftest not found")
	var out, errb bytes.Buffer
	require.Equal(t, 2, realMain([]string{"-perftest", "/nonexistent/ucx_perftest"}, strings.NewReader(""), &out, &errb))
	require.Contains(t, errb.String(), `gdrperf: -perftest "/nonexistent/ucx_perftest": `)
}

func TestSizes(t *testing.T) {
	tests := []struct {
		in   string
		want int
		err  bool
	}{
		{in: "4096", want: 4096},
		{in: "1KiB", want: 1 << 10},
		{in: "64MiB", want: 64 << 20},
		{in: "64mib", want: 64 << 20},
		{in: "2G", want: 2 << 30},
		{in: "17B", want: 17},
		{in: " 3 MiB", want: 3 << 20},
		{in: "0", err: true},
		{in: "-1MiB", err: true},
		{in: "1.5MiB", err: true},
		{in: "MiB", err: true},
		{in: "65GiB", err: true},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			n, err := parseSize(tc.in)
			if tc.err {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, n)
		})
	}
	got, err := parseSizes("1MiB, 16MiB,,64MiB")
	require.NoError(t, err)
	require.Equal(t, []int{1 << 20, 16 << 20, 64 << 20}, got)
	_, err = parseSizes(",")
	require.Error(t, err)
	// A size is a row: given twice, however written, it is refused.
	_, err = parseSizes("1MiB,1024KiB")
	require.ErrorContains(t, err, "size 1MiB given twice")
	for _, n := range []int{17, 4 << 10, 64 << 20, 1 << 30, 1<<20 + 1} {
		back, err := parseSize(formatSize(n))
		require.NoError(t, err)
		require.Equal(t, n, back)
	}
}

func TestMedian(t *testing.T) {
	require.Equal(t, 0.0, median(nil))
	require.Equal(t, 3.0, median([]float64{5, 3, 1}))
	require.Equal(t, 2.5, median([]float64{4, 1, 3, 2}))
	require.InDelta(t, 64.0, medianRate(64<<20, []time.Duration{time.Second, 2 * time.Second, 500 * time.Millisecond}), 1e-9)
	// An even count: the size over the middle two times' mean (2 s), not the
	// middle two rates' mean (the harmonic mean of their times).
	require.InDelta(t, 0.5, medianRate(1<<20, []time.Duration{3 * time.Second, time.Second}), 1e-12)
	require.InDelta(t, 0.5, medianRate(1<<20, []time.Duration{4 * time.Second, time.Second, 3 * time.Second, 500 * time.Millisecond}), 1e-12)
	require.Zero(t, medianRate(1<<20, nil))
	require.Equal(t, "1,234,568", commas(1234567.8))
	require.Equal(t, "999", commas(999))
	for v, want := range map[float64]string{12.84: "12.8", 5: "5", 0.123456: "0.123", 99.96: "100", 1234.4: "1,234"} {
		require.Equal(t, want, num(&v), "%v", v)
	}
	// Ratios: whole from 10, else three significant digits, tiny ones too.
	for v, want := range map[float64]string{12.6: "13x", 10: "10x", 3: "3.00x", 1.234: "1.23x", 0.5: "0.500x", 0.0456: "0.0456x", 0.00123456: "0.00123x", 1.5e-7: "0.000000150x"} {
		require.Equal(t, want, rat(&v), "%v", v)
	}
	require.Equal(t, "-", rat(nil))
}

// Output of ucx_perftest 1.13 (ucp_put_bw, 64 MiB, 20 iterations).
const perftestOutput = `+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                    20  25903.885 28879.249 28879.249     2216.12    2216.12          35          35
`

func TestParsePerftest(t *testing.T) {
	r, err := parsePerftest(perftestOutput)
	require.NoError(t, err)
	require.Equal(t, 2216.12, r.MiBs)
	_, err = parsePerftest("Waiting for connection...\n")
	require.ErrorContains(t, err, "no Final")
	_, err = parsePerftest("Final: 20 1 2 3 4 x 6 7\n")
	require.Error(t, err)
	// A run too short for ucx_perftest's clock: JSON has no infinity.
	_, err = parsePerftest("Final: 2 0.0 0.0 0.0 inf inf inf inf\n")
	require.ErrorContains(t, err, "no finite bandwidth")
}

// ucp_ep_print_info of a gdrpc session's endpoint (UCX 1.13, loopback).
const epInfo = `#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]: cm rdmacm
#                 lane[1]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] am am_bw#0 keepalive
#                 lane[2]:  4:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255]
#                 lane[3]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] rma_bw#0 wireup
#
#             stream_send: 0..<egr/short>..93..<egr/bcopy>..(inf)
`

func TestUCXLanes(t *testing.T) {
	require.Equal(t, "sysv/memory(am,am_bw) posix/memory() tcp/lo(rma_bw,wireup)", ucxLanes(epInfo))
	require.Equal(t, "", ucxLanes(""))
}

func TestNoServer(t *testing.T) {
	port, err := freePort("127.0.0.1") // nothing listens there
	require.NoError(t, err)
	var out, errb bytes.Buffer
	code := realMain([]string{"-connect", fmt.Sprintf("127.0.0.1:%d", port), "-sizes", "1MiB", "-iters", "1", "-warmup", "0",
		"-transport", "tcp", "-perftest", "none", "-call-timeout", "5s"}, strings.NewReader(""), &out, &errb)
	require.Equal(t, 1, code, "stdout:\n%s", out.String())
	require.Contains(t, errb.String(), "gdrpc not measured for 1MiB")
	require.Contains(t, out.String(), "# note: 1MiB: gdrpc: call 0:")
	require.Contains(t, out.String(), "# note: 1MiB: grpc-tcp: call 0:")
}

// fakePerftest is a stand-in for ucx_perftest: as a server ("-p PORT") it
// listens on PORT until a client connects; as a client it connects, and
// prints a Final line whose bandwidth encodes the message size it was given.
// Where $FAKE_PERFTEST_LOG names a file, each run appends a line to it: its
// role (server once it listens, client), its process ID and its UCX_TLS.
const fakePerftest = `#!/usr/bin/env python3
import os, socket, sys
args = sys.argv[1:]
port = int(args[args.index("-p") + 1])
def log(role):
    if os.environ.get("FAKE_PERFTEST_LOG"):
        with open(os.environ["FAKE_PERFTEST_LOG"], "a") as f:
            f.write("%s %d UCX_TLS=%s\n" % (role, os.getpid(), os.environ.get("UCX_TLS", "")))
if args[0] == "-p":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen(1); log("server"); c, _ = s.accept(); c.recv(1); sys.exit(0)
assert args[args.index("-t") + 1] == "ucp_put_bw", args
size, iters = int(args[args.index("-s") + 1]), int(args[args.index("-n") + 1])
log("client")
c = socket.create_connection((args[0], port)); c.send(b"x")
print("Final: %d 1.0 2.0 3.0 %.2f %.2f 7 8" % (iters, size / 1024.0, size / 1024.0))
`

// fakePerftestBin writes fakePerftest to a file and returns its path, and
// the log its runs write (FAKE_PERFTEST_LOG, set for the test).
func fakePerftestBin(t *testing.T) (bin, log string) {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skipf("no python3 for the fake ucx_perftest: %v", err)
	}
	dir := t.TempDir()
	bin, log = filepath.Join(dir, "ucx_perftest"), filepath.Join(dir, "runs.log")
	require.NoError(t, os.WriteFile(bin, []byte(fakePerftest), 0o755))
	t.Setenv("FAKE_PERFTEST_LOG", log)
	return bin, log
}

// perftestRuns returns the lines of the fake ucx_perftest's log whose role
// is role ("server", "client"), each split in its fields.
func perftestRuns(t *testing.T, log, role string) [][]string {
	t.Helper()
	b, err := os.ReadFile(log)
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	var runs [][]string
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) == 3 && f[0] == role {
			runs = append(runs, f)
		}
	}
	return runs
}

// ucx_perftest is measured beside a gdrpc session over UCX, in the
// environment gdrpc sees, and skipped with a note beside one over TCP
// (-transport tcp, or auto without -trust-peers): it measures UCX's puts.
func TestPerftestColumn(t *testing.T) {
	bin, log := fakePerftestBin(t)
	for _, mode := range []string{"tcp", "auto"} {
		t.Run("session over tcp/"+mode, func(t *testing.T) {
			rs := gdrperf(t, "-sizes", "3MiB", "-iters", "3", "-warmup", "0", "-transport", mode, "-perftest", bin)
			require.Len(t, rs, 1)
			r := rs[0]
			require.Equal(t, "tcp", r.Transport)
			require.Nil(t, r.UCXPerftestMiBs, "notes: %v", r.Notes)
			require.Nil(t, r.VsUCXPerftest)
			require.Nil(t, r.XferVsPerftest)
			require.Empty(t, r.UCXTLS)
			require.Contains(t, r.Notes, "ucx_perftest skipped: the gdrpc session runs over TCP (ucx_perftest measures UCX puts)")
			require.Empty(t, perftestRuns(t, log, "client"), "ucx_perftest ran beside a TCP session")
		})
	}
	var out, errb bytes.Buffer
	code := realMain([]string{"-sizes", "3MiB", "-iters", "1", "-warmup", "0", "-transport", "tcp", "-perftest", bin}, strings.NewReader(""), &out, &errb)
	require.Equal(t, 0, code, errb.String())
	require.Contains(t, out.String(), "\n# ucx_perftest: ucx_perftest skipped: the gdrpc session runs over TCP (ucx_perftest measures UCX puts)\n")

	t.Run("session over ucx", func(t *testing.T) {
		requireUCX(t)
		const size = 3 << 20
		rs := gdrperf(t, "-sizes", "3MiB", "-iters", "3", "-warmup", "0", "-transport", "ucx", "-perftest", bin)
		require.Len(t, rs, 1)
		r := rs[0]
		require.Equal(t, "ucx", r.Transport)
		require.NotNil(t, r.UCXPerftestMiBs, "notes: %v", r.Notes)
		require.Equal(t, float64(size)/1024, *r.UCXPerftestMiBs, "the size reached ucx_perftest")
		require.Equal(t, perftestTLS(), r.UCXTLS)
		require.InDelta(t, *r.GDRPCMiBs/(float64(size)/1024), *r.VsUCXPerftest, 1e-9)
		require.NotNil(t, r.TransferMiBs, "notes: %v", r.Notes)
		require.NotNil(t, r.XferVsPerftest)
		require.InDelta(t, *r.TransferMiBs/(float64(size)/1024), *r.XferVsPerftest, 1e-9)
		clients := perftestRuns(t, log, "client")
		require.Len(t, clients, 1)
		require.Equal(t, "UCX_TLS="+os.Getenv("UCX_TLS"), clients[0][2], "ucx_perftest runs in the environment gdrpc sees")
	})
}

// -inflight takes a list: each size gets a row per value, in the order
// given, the single call with the RPC floor beside the aggregate rows, and
// each row's call time is what its rate and calls in flight make.
func TestInflightList(t *testing.T) {
	rs := gdrperf(t, "-transport", "tcp", "-sizes", "4KiB,256KiB", "-iters", "3", "-warmup", "1", "-perftest", "none", "-inflight", "3,1")
	require.Len(t, rs, 4)
	for i, want := range []struct{ size, inflight int }{{4 << 10, 3}, {4 << 10, 1}, {256 << 10, 3}, {256 << 10, 1}} {
		r := rs[i]
		require.Equal(t, want.size, r.SizeBytes, "row %d", i)
		require.Equal(t, want.inflight, r.Inflight, "row %d", i)
		require.Positive(t, val(r.GDRPCMiBs), "row %d: notes: %v", i, r.Notes)
		require.NotNil(t, r.CallMicros, "row %d", i)
		require.InDelta(t, float64(want.inflight*want.size)/(1<<20) / *r.GDRPCMiBs * 1e6, *r.CallMicros, 1e-6)
		require.NotNil(t, r.RPCMicros, "row %d: the 1 KiB RPC with as many in flight", i)
		require.Positive(t, *r.RPCMicros, "row %d", i)
		require.NotNil(t, r.VsRPCCopy, "row %d", i)
	}
	var out, errb bytes.Buffer
	code := realMain([]string{"-sizes", "256KiB", "-iters", "2", "-warmup", "0", "-transport", "tcp", "-perftest", "none", "-inflight", "1,2"},
		strings.NewReader(""), &out, &errb)
	require.Equal(t, 0, code, "stderr: %s", errb.String())
	var rows []string
	for line := range strings.Lines(out.String()) {
		if f := strings.Fields(line); len(f) > 2 && f[0] == "256KiB" {
			rows = append(rows, f[1])
		}
	}
	require.Equal(t, []string{"1", "2"}, rows, "the table's inflight column:\n%s", out.String())
	require.Contains(t, out.String(), "call µs")
}

func TestCallVsRPCCopy(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	// 64 MiB: a 100 µs RPC and a copy at 64 MiB/ms (1 ms) make a floor of
	// 1.1 ms; a call at 32 MiB/ms (2 ms) is 1.82x that.
	r := &result{GDRPCMiBs: f(32 * 1000), RPCMicros: f(100), CopyMiBs: f(64 * 1000), Inflight: 1}
	require.InDelta(t, 2.0/1.1, *callVsRPCCopy(64<<20, r), 1e-9)
	// GPU to GPU: the dtod copy stands in for the copy.
	r = &result{GDRPCMiBs: f(32 * 1000), RPCMicros: f(100), DtoDMiBs: f(64 * 1000), Inflight: 1}
	require.InDelta(t, 2.0/1.1, *callVsRPCCopy(64<<20, r), 1e-9)
	// Four in flight: a call under load takes 4 x 64 MiB at 32 MiB/ms (8 ms),
	// over a plain call under the same load plus one copy.
	r.Inflight = 4
	require.InDelta(t, 8.0/1.1, *callVsRPCCopy(64<<20, r), 1e-9)
	// A missing part: no ratio.
	require.Nil(t, callVsRPCCopy(64<<20, &result{GDRPCMiBs: f(1), Inflight: 1}))
	require.Nil(t, callVsRPCCopy(64<<20, &result{RPCMicros: f(100), DtoDMiBs: f(1), Inflight: 1}))
}

// -busy runs the busy processes for the whole run and stops them at its end:
// the run reports its rows, and no busy process outlives it.
func TestBusy(t *testing.T) {
	before := childProcesses(t)
	res := gdrperf(t, "-transport", "tcp", "-sizes", "1KiB", "-iters", "3", "-warmup", "1", "-perftest", "none", "-busy", "2")
	require.Len(t, res, 1)
	require.Positive(t, val(res[0].GDRPCMiBs))
	require.Equal(t, before, childProcesses(t), "busy processes left")
}

// childProcesses counts this process's children.
func childProcesses(t *testing.T) int {
	t.Helper()
	return len(childPIDs(t, os.Getpid()))
}

// childPIDs returns the IDs of the processes whose parent is ppid.
func childPIDs(t *testing.T, ppid int) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	require.NoError(t, err)
	parent := strconv.Itoa(ppid)
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: the fields after the command's closing parenthesis.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 1 && f[1] == parent {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestConnects: -connects times new connections after the table, each way:
// a line under the table, or a JSON object after the rows; the gdrpc
// connections run over the session the transport asks for, and the buffers
// of their calls go back to the pools.
func TestConnects(t *testing.T) {
	for _, transport := range []string{"tcp", "ucx"} {
		t.Run(transport, func(t *testing.T) {
			if transport == "ucx" {
				requireUCX(t)
			}
			base := poolsInUse()
			args := []string{"-sizes", "4KiB", "-iters", "1", "-warmup", "0", "-transport", transport, "-perftest", "none", "-connects", "3"}
			var out, errb bytes.Buffer
			code := realMain(append([]string{"-format", "json"}, args...), strings.NewReader(""), &out, &errb)
			require.Equal(t, 0, code, errb.String())
			lines := strings.Split(strings.TrimSpace(out.String()), "\n")
			require.Len(t, lines, 2, "a row, then the connections' object")
			var r connectsResult
			require.NoError(t, json.Unmarshal([]byte(lines[1]), &r))
			require.Equal(t, 3, r.Connects)
			require.Equal(t, transport, r.Transport)
			require.Positive(t, r.GDRPCMs)
			require.GreaterOrEqual(t, r.GDRPCP90Ms, r.GDRPCMs)
			require.Positive(t, r.GRPCMs)
			require.GreaterOrEqual(t, r.GRPCP90Ms, r.GRPCMs)
			require.NotNil(t, r.XGRPC)
			require.InDelta(t, r.GDRPCMs/r.GRPCMs, *r.XGRPC, 1e-9)

			out.Reset()
			code = realMain(args, strings.NewReader(""), &out, &errb)
			require.Equal(t, 0, code, errb.String())
			require.Regexp(t, `(?m)^# first call on a new connection \(-connects 3, alternating; 1 KiB Make\): gdrpc [0-9.]+ ms median, p90 [0-9.]+ \(session over `+transport+`\), plain gRPC over TCP [0-9.]+ ms, p90 [0-9.]+: [0-9.]+x plain gRPC's time$`, out.String())
			require.Equal(t, base, poolsInUse(), "buffers not given back to the host pools")
		})
	}
}
