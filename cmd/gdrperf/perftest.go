package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ucx_perftest prints bandwidth in MB/s where 1 MB is 2^20 bytes (UCS_MBYTE):
// the same unit as gdrperf's MiB/s.

// ucx_perftest runs only beside a gdrpc session that runs over UCX: it
// measures UCX's puts, on the transports UCX picks in this environment, as
// the session's endpoint does. Its environment is this process's, so that
// UCX_TLS and friends are the ones gdrpc sees.

// perftestTLS describes the UCX transports ucx_perftest is told to use.
func perftestTLS() string {
	if v, ok := os.LookupEnv("UCX_TLS"); ok {
		return v
	}
	return "UCX default"
}

// perftestSkipped says why ucx_perftest is not measured beside a gdrpc
// session over transport ("ucx", "tcp"; "" where no call made one), or ""
// when it is.
func perftestSkipped(transport string) string {
	switch transport {
	case "ucx":
		return ""
	case "tcp":
		return "ucx_perftest skipped: the gdrpc session runs over TCP (ucx_perftest measures UCX puts)"
	case "":
		return "ucx_perftest skipped: no gdrpc session was made to compare it with"
	}
	return "ucx_perftest skipped: the gdrpc session runs over " + transport + ", not UCX"
}

// freePort returns a TCP port that was free a moment ago on host.
func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// servePerftest keeps a ucx_perftest server listening on port until ctx ends:
// each server process serves one test and exits, so it is started again.
// Failures back off (bounded) and are reported through logf.
func servePerftest(ctx context.Context, bin string, port int, logf func(string, ...any)) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		cmd := exec.CommandContext(ctx, bin, "-p", strconv.Itoa(port))
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 2 * time.Second
		err := runTied(cmd)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			backoff = 100 * time.Millisecond
			continue
		}
		logf("ucx_perftest server on port %d: %v: %s", port, err, lastLines(out.String(), 3))
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// perftestResult is what one ucx_perftest client run measured.
type perftestResult struct {
	MiBs float64 // overall bandwidth
}

// runPerftest runs a ucx_perftest ucp_put_bw client of size-byte puts against
// the server at host:port and returns its overall bandwidth. memTypes is
// ucx_perftest's -m (source and destination memory, e.g. "cuda,cuda"); empty
// means host memory. A refused connection (the server between two tests) is
// retried until ctx ends.
func runPerftest(ctx context.Context, bin, host string, port, size, iters, warmup int, memTypes string) (perftestResult, error) {
	args := []string{host, "-p", strconv.Itoa(port), "-t", "ucp_put_bw",
		"-s", strconv.Itoa(size), "-n", strconv.Itoa(perftestIters(size, iters)), "-w", strconv.Itoa(warmup)}
	if memTypes != "" {
		args = append(args, "-m", memTypes)
	}
	if perftestTLS() == "tcp" {
		args = append(args, "-O", "1") // puts over UCX tcp need the target to progress between them
	}
	var last error
	for attempt := 0; ; attempt++ {
		cmd := exec.CommandContext(ctx, bin, args...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 2 * time.Second
		err := runTied(cmd)
		if err == nil {
			return parsePerftest(out.String())
		}
		last = fmt.Errorf("%s %s: %v: %s", bin, strings.Join(args, " "), err, lastLines(out.String(), 3))
		if ctx.Err() != nil || attempt >= 20 || !refused(out.String()) {
			return perftestResult{}, last
		}
		t := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return perftestResult{}, last
		case <-t.C:
		}
	}
}

// perftestIters is ucx_perftest's -n for size-byte puts: iters, or as many
// as move 64 MiB in all, whichever is more; fewer small puts take less time
// than its clock can tell and it reports "inf".
func perftestIters(size, iters int) int {
	return max(iters, (64<<20+size-1)/max(size, 1))
}

func refused(out string) bool {
	return strings.Contains(out, "refused") || strings.Contains(out, "connect(")
}

// parsePerftest reads the "Final:" line of ucx_perftest's table: iterations,
// latency 50%ile/average/overall, bandwidth average/overall, message rate
// average/overall.
func parsePerftest(out string) (perftestResult, error) {
	for line := range strings.Lines(out) {
		f := strings.Fields(line)
		if len(f) < 9 || f[0] != "Final:" {
			continue
		}
		bw, err := strconv.ParseFloat(f[6], 64)
		if err != nil {
			return perftestResult{}, fmt.Errorf("ucx_perftest: bandwidth %q: %w", f[6], err)
		}
		if math.IsInf(bw, 0) || math.IsNaN(bw) {
			// Runs too short for its clock print "inf".
			return perftestResult{}, fmt.Errorf("ucx_perftest: no finite bandwidth (%q): too few iterations for its clock", f[6])
		}
		return perftestResult{MiBs: bw}, nil
	}
	return perftestResult{}, errors.New("ucx_perftest printed no Final: line: " + lastLines(out, 3))
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
