package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/trace"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	xtrace "golang.org/x/exp/trace"
)

// traced runs n calls, each a region in which the caller hands a request to
// a server goroutine and waits for its reply (two hand-offs), under the
// execution tracer, and returns the trace. The server marks each reply with
// a region of its own, "test.serve".
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
			r := trace.StartRegion(context.Background(), "test.serve")
			resp <- v + 1
			r.End()
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
	// Each goroutine made runnable is seen running again afterwards (the
	// last hand-off of the trace may not be).
	ran := 0
	for _, h := range ev.handoffs {
		if h.ran != 0 {
			require.GreaterOrEqual(t, h.ran, h.at)
			ran++
		}
	}
	require.GreaterOrEqual(t, ran, len(ev.handoffs)-1, "hand-offs whose goroutine ran afterwards")
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
	require.Contains(t, s, "a call's timeline")
	require.Regexp(t, `\n[0-9.]+\s+[0-9.]+\s+100%\s+the call ends\n`, s)
	// The server's region, one per call, in each trace's table and on
	// the timeline (both traces are one file here, under one name: 200%
	// of the calls); the calls' own region is neither.
	require.Equal(t, 2, strings.Count(s, "regions begun during the calls"), s)
	require.Regexp(t, `\n[0-9.]+\s+[0-9.]+\s+25\s+test\.serve\n`, s)
	require.Regexp(t, `\n[0-9.]+\s+[0-9.]+\s+200%\s+\S+c\.trace: region test\.serve\n`, s)
	require.NotContains(t, s, "region gdrperf.call")
}

// A region's span is from its begin to its end on the same goroutine, the
// innermost open one of its type ending first; one that ends without a
// begin in the trace (begun under an earlier trace) is left out.
func TestRegionSpans(t *testing.T) {
	ctx := context.Background()
	var first, buf bytes.Buffer
	require.NoError(t, trace.Start(&first))
	early := trace.StartRegion(ctx, "test.early") // its begin goes in the first trace
	trace.Stop()
	require.NoError(t, trace.Start(&buf))
	early.End() // its end in the second
	call := trace.StartRegion(ctx, "gdrperf.call")
	outer := trace.StartRegion(ctx, "test.step")
	// Apart in time, so that the two begins cannot share a timestamp.
	time.Sleep(time.Millisecond)
	inner := trace.StartRegion(ctx, "test.step")
	inner.End()
	outer.End()
	call.End()
	trace.Stop()
	ev, err := read(&buf, "gdrperf.call")
	require.NoError(t, err)
	require.Len(t, ev.calls, 1)
	var steps []cgoCall
	for _, r := range ev.regions {
		require.NotEqual(t, "region test.early", r.fn)
		require.NotEqual(t, "region gdrperf.call", r.fn)
		if r.fn == "region test.step" {
			steps = append(steps, r)
		}
	}
	require.Len(t, steps, 2)
	// In the order they ended: the inner one first, begun after the outer
	// one and ended before it.
	require.Greater(t, steps[0].at, steps[1].at, "the first to end began first")
	require.LessOrEqual(t, steps[0].at+xtrace.Time(steps[0].took), steps[1].at+xtrace.Time(steps[1].took))
	require.GreaterOrEqual(t, steps[1].took, time.Millisecond)
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

// The timeline places each kind of event at its median time from the calls'
// starts, a kind's second, third and last times in a call on rows of their
// own, with the share of the calls that had it, and leaves out rows too few
// calls had.
func TestTimeline(t *testing.T) {
	us := func(n int) xtrace.Time { return xtrace.Time(n * 1000) }
	var calls []*call
	for i := range 4 {
		calls = append(calls, &call{start: us(1000 * i), end: us(1000*i + 100 + i)})
	}
	client := &events{}
	server := &events{}
	for i, c := range calls {
		// Every call: the server is woken 10+i µs in and runs 3 µs later;
		// the client calls into C at 20 µs for 5 µs, and again at 30 (its
		// last: no "(last)" row, as no call had it more than three times);
		// it polls from 60 µs, every µs, 2+2i times (2, 4, 6, 8: the
		// "(last)" row takes the calls that polled twice too).
		server.handoffs = append(server.handoffs, handoff{at: c.start + us(10+i), by: "reader", reason: "request", ran: c.start + us(13+i)})
		client.cgo = append(client.cgo,
			cgoCall{at: c.start + us(20), fn: "send", took: 5 * time.Microsecond},
			cgoCall{at: c.start + us(30), fn: "send", took: 5 * time.Microsecond})
		for j := range 2 + 2*i {
			client.cgo = append(client.cgo, cgoCall{at: c.start + us(60+j), fn: "poll", took: 500 * time.Nanosecond})
		}
		if i == 0 {
			// Only one call of four: below a third, left out.
			client.handoffs = append(client.handoffs, handoff{at: c.start + us(40), by: "rare", reason: "x"})
		}
		if i < 2 {
			// Half the calls; never ran again within the trace.
			server.handoffs = append(server.handoffs, handoff{at: c.start + us(50), by: "half", reason: "y"})
		}
	}
	// A hand-off outside every call is no call's.
	server.handoffs = append(server.handoffs, handoff{at: us(500), by: "between", reason: "calls"})
	marks := timeline(calls, []*events{client, server}, []string{"c", "s"}, 1.0/3)
	var got []string
	for _, m := range marks {
		got = append(got, fmt.Sprintf("%v %v %.2f %s", m.at, m.until, m.share, m.what))
	}
	require.Equal(t, []string{
		"12µs 15µs 1.00 s: reader -> request",
		"20µs 25µs 1.00 c: in C or a syscall: send",
		"30µs 35µs 1.00 c: in C or a syscall: send (2nd)",
		"50µs -1ns 0.50 s: half -> y",
		"60µs 60.5µs 1.00 c: in C or a syscall: poll",
		"61µs 61.5µs 1.00 c: in C or a syscall: poll (2nd)",
		"62µs 62.5µs 0.75 c: in C or a syscall: poll (3rd)",
		"65µs 65.5µs 1.00 c: in C or a syscall: poll (last)",
		"102µs 102µs 1.00 the call ends",
	}, got)
}

func TestOrdinal(t *testing.T) {
	for n, want := range map[int]string{2: "2nd", 3: "3rd", 4: "4th", 11: "11th", 12: "12th", 13: "13th", 21: "21st", 22: "22nd", 101: "101st", 111: "111th"} {
		require.Equal(t, want, ordinal(n), "%d", n)
	}
}
