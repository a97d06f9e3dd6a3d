package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"runtime"
	"runtime/trace"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	xtrace "golang.org/x/exp/trace"
)

// traced runs n calls, each a region in which the caller hands a request to
// a server goroutine and waits for its reply (two hand-offs), under the
// execution tracer, and returns the trace.
func traced(t *testing.T, n int) []byte { return tracedYielding(t, n, false) }

// tracedYielding is traced with, when yield is set, the caller yielding its
// P once in each call.
func tracedYielding(t *testing.T, n int, yield bool) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, trace.Start(&buf))
	req, resp := make(chan int), make(chan int)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for v := range req {
			resp <- v + 1
		}
	}()
	for i := range n {
		r := trace.StartRegion(context.Background(), "gdrperf.call")
		req <- i
		got := <-resp
		if yield {
			runtime.Gosched()
		}
		r.End()
		require.Equal(t, i+1, got)
	}
	close(req)
	<-done
	trace.Stop()
	return buf.Bytes()
}

func TestRead(t *testing.T) {
	ev, err := read(bytes.NewReader(traced(t, 40)), "gdrperf.call")
	require.NoError(t, err)
	require.Len(t, ev.calls, 40)
	for _, c := range ev.calls {
		require.Greater(t, c.end, c.start)
		require.Contains(t, c.states, "Running")
	}
	hs := within(ev.calls, len(ev.handoffs), func(i int) xtrace.Time { return ev.handoffs[i].at })
	var per []int
	pair := 0 // hand-offs between the caller and the server goroutine
	for _, h := range hs {
		per = append(per, h[1]-h[0])
		for _, x := range ev.handoffs[h[0]:h[1]] {
			// Each channel operation wakes whichever of the two waited
			// for it first: either may make the other runnable.
			caller := strings.HasSuffix(x.by, "gdrtrace.tracedYielding") && strings.HasSuffix(x.reason, "gdrtrace.tracedYielding.func1")
			server := strings.HasSuffix(x.by, "gdrtrace.tracedYielding.func1") && strings.HasSuffix(x.reason, "gdrtrace.tracedYielding")
			if caller || server {
				pair++
			}
		}
	}
	require.Equal(t, 2, median(per), "hand-offs per call")
	require.GreaterOrEqual(t, pair, 76, "hand-offs between the caller and the server goroutine in 40 calls of two each")
}

// Each yield inside a call is counted, with its reason and place.
func TestYields(t *testing.T) {
	ev, err := read(bytes.NewReader(tracedYielding(t, 20, true)), "gdrperf.call")
	require.NoError(t, err)
	ys := within(ev.calls, len(ev.yields), func(i int) xtrace.Time { return ev.yields[i].at })
	for i, y := range ys {
		n := 0
		for _, x := range ev.yields[y[0]:y[1]] {
			if x.reason == "runtime.Gosched" && strings.Contains(x.by, "gdrtrace.tracedYielding") {
				n++
			}
		}
		require.Equal(t, 1, n, "call %d", i)
	}
	var out bytes.Buffer
	dir := t.TempDir()
	p := filepath.Join(dir, "c.trace")
	require.NoError(t, os.WriteFile(p, tracedYielding(t, 20, true), 0o644))
	require.NoError(t, run([]string{p}, &out))
	require.Regexp(t, `1\.00\s+runtime\.Gosched in runtime\.Gosched < gdrtrace\.tracedYielding`, out.String())
}

func TestReport(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.trace")
	require.NoError(t, os.WriteFile(p, traced(t, 30), 0o644))
	var out bytes.Buffer
	require.NoError(t, run([]string{"-skip", "5", p, p}, &out))
	s := out.String()
	require.Contains(t, s, "25 calls: median")
	require.Contains(t, s, "waiting: chan ")
	require.Equal(t, 2, strings.Count(s, "2 hand-offs per call"), s)
	require.Equal(t, 2, strings.Count(s, "Ps started per call"), s)
	require.Equal(t, 2, strings.Count(s, "yields during the calls"), s)
}

func TestRunErrors(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.trace")
	require.NoError(t, os.WriteFile(p, traced(t, 3), 0o644))
	junk := filepath.Join(dir, "junk")
	require.NoError(t, os.WriteFile(junk, []byte("not a trace"), 0o644))
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{name: "no files", args: nil, want: "want one or two trace files"},
		{name: "three files", args: []string{p, p, p}, want: "want one or two trace files"},
		{name: "missing", args: []string{filepath.Join(dir, "none")}, want: "no such file"},
		{name: "not a trace", args: []string{junk}, want: junk},
		{name: "all skipped", args: []string{"-skip", "3", p}, want: "3 calls in region \"gdrperf.call\", none left after -skip 3"},
		{name: "other region", args: []string{"-region", "other", p}, want: "0 calls in region \"other\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(tc.args, &out)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}
