package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/exp/trace"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "gdrtrace:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("gdrtrace", flag.ContinueOnError)
	region := fs.String("region", "gdrperf.call", "the trace region that marks one call in the first trace")
	skip := fs.Int("skip", 0, "calls to leave out at the start (warm-up)")
	top := fs.Int("top", 12, "rows per table")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: gdrtrace [flags] CLIENT.trace [SERVER.trace]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() < 1 || fs.NArg() > 2 {
		fs.Usage()
		return errors.New("want one or two trace files")
	}
	if *skip < 0 || *top < 0 {
		return fmt.Errorf("-skip %d, -top %d: neither may be negative", *skip, *top)
	}
	traces := make([]*events, 0, fs.NArg())
	for _, p := range fs.Args() {
		ev, err := readFile(p, *region)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		traces = append(traces, ev)
	}
	calls := traces[0].calls
	if len(calls) <= *skip {
		return fmt.Errorf("%s: %d calls in region %q, none left after -skip %d", fs.Arg(0), len(calls), *region, *skip)
	}
	report(out, calls[*skip:], traces, fs.Args(), *top)
	return nil
}

func readFile(path, region string) (*events, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return read(f, region)
}

// events is what one trace holds for the breakdown: the calls (regions of
// the given type, with the calling goroutine's states inside them), every
// hand-off (a goroutine made runnable by another), every yield (a running
// goroutine put back in a run queue), every P started (an idle P given a
// thread: a thread woken to run goroutines), every cgo call and every other
// region (gdrpc marks its own steps: gdrpc.marshal, gdrpc.unmarshal, a GPU
// copy's queueing, a rendezvous's wait).
type events struct {
	calls    []*call
	handoffs []handoff
	yields   []handoff // by: where it yielded; reason: why
	starts   []trace.Time
	cgo      []cgoCall
	regions  []cgoCall // fn: "region " and the region's type; at: its start
}

// call is one region: when, and how long its goroutine spent in each state.
type call struct {
	start, end trace.Time
	states     map[string]time.Duration
}

// handoff: goroutine `by` (at `where`) made a goroutine that waited for
// `reason` runnable; the goroutine ran again at `ran` (0: not in the trace).
type handoff struct {
	at     trace.Time
	by     string
	reason string
	ran    trace.Time
}

// cgoCall is a call into C or a syscall (or, in events.regions, a region):
// when it began, what it was and how long it took.
type cgoCall struct {
	at   trace.Time
	fn   string
	took time.Duration
}

// read parses one execution trace. The timestamps of traces taken on one
// host at the same time are comparable, so a second process's events are
// placed in the first one's calls by time.
func read(r io.Reader, region string) (*events, error) {
	tr, err := trace.NewReader(r)
	if err != nil {
		return nil, err
	}
	ev := &events{}
	open := map[trace.GoID]*call{}       // regions under way, by goroutine
	state := map[trace.GoID]string{}     // each goroutine's state, named for the breakdown
	since := map[trace.GoID]trace.Time{} // since when
	inCgo := map[trace.GoID]cgoCall{}    // cgo calls under way
	woken := map[trace.GoID]int{}        // goroutines made runnable by another: the hand-off's index
	type regionKey struct {
		g   trace.GoID
		typ string
	}
	regions := map[regionKey][]trace.Time{} // other regions under way: their starts, innermost last
	settle := func(g trace.GoID, now trace.Time) {
		if c := open[g]; c != nil && state[g] != "" {
			c.states[state[g]] += time.Duration(now - max(since[g], c.start))
		}
	}
	for {
		e, err := tr.ReadEvent()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		switch e.Kind() {
		case trace.EventRegionBegin:
			if e.Region().Type == region {
				open[e.Goroutine()] = &call{start: e.Time(), states: map[string]time.Duration{}}
			} else {
				k := regionKey{e.Goroutine(), e.Region().Type}
				regions[k] = append(regions[k], e.Time())
			}
		case trace.EventRegionEnd:
			g := e.Goroutine()
			if c := open[g]; c != nil && e.Region().Type == region {
				settle(g, e.Time())
				c.end = e.Time()
				ev.calls = append(ev.calls, c)
				delete(open, g)
			}
			// A region begun before the trace did ends unmatched: it
			// has no start to measure from. (The calls' own regions
			// never have one here.)
			if k := (regionKey{g, e.Region().Type}); len(regions[k]) > 0 {
				n := len(regions[k]) - 1
				start := regions[k][n]
				regions[k] = regions[k][:n]
				ev.regions = append(ev.regions, cgoCall{at: start, fn: "region " + k.typ, took: time.Duration(e.Time() - start)})
			}
		case trace.EventStateTransition:
			st := e.StateTransition()
			if st.Resource.Kind == trace.ResourceProc {
				if from, to := st.Proc(); from == trace.ProcIdle && to == trace.ProcRunning {
					ev.starts = append(ev.starts, e.Time())
				}
				continue
			}
			if st.Resource.Kind != trace.ResourceGoroutine {
				continue
			}
			g := st.Resource.Goroutine()
			from, to := st.Goroutine()
			settle(g, e.Time())
			name := to.String()
			switch to {
			case trace.GoWaiting:
				name = "waiting: " + st.Reason + " in " + frames(e.Stack(), 2)
			case trace.GoSyscall:
				fn := frames(e.Stack(), 1)
				name = "in C or a syscall: " + fn
				inCgo[g] = cgoCall{at: e.Time(), fn: fn}
			}
			if from == trace.GoSyscall {
				if c, ok := inCgo[g]; ok {
					c.took = time.Duration(e.Time() - c.at)
					ev.cgo = append(ev.cgo, c)
					delete(inCgo, g)
				}
			}
			if from == trace.GoRunning && to == trace.GoRunnable {
				ev.yields = append(ev.yields, handoff{at: e.Time(), by: frames(st.Stack, 2), reason: st.Reason})
			}
			if from == trace.GoWaiting && to == trace.GoRunnable {
				reason := strings.TrimPrefix(state[g], "waiting: ")
				if reason == "" {
					reason = "? (waiting since before the trace began)"
				}
				woken[g] = len(ev.handoffs)
				ev.handoffs = append(ev.handoffs, handoff{at: e.Time(), by: frames(e.Stack(), 2), reason: reason})
			}
			if i, ok := woken[g]; ok && to == trace.GoRunning {
				ev.handoffs[i].ran = e.Time()
				delete(woken, g)
			}
			state[g], since[g] = name, e.Time()
		}
	}
	return ev, nil
}

// frames names the innermost n frames of st, innermost first, without
// package paths.
func frames(st trace.Stack, n int) string {
	var fs []string
	for f := range st.Frames() {
		fn := f.Func
		if i := strings.LastIndex(fn, "/"); i >= 0 {
			fn = fn[i+1:]
		}
		fs = append(fs, fn)
		if len(fs) == n {
			break
		}
	}
	if len(fs) == 0 {
		return "?"
	}
	return strings.Join(fs, " < ")
}

// within returns, per call, the range of indexes of the sorted times (at)
// that fall inside it.
func within(calls []*call, n int, at func(i int) trace.Time) [][2]int {
	out := make([][2]int, len(calls))
	for i, c := range calls {
		first := func(t trace.Time) int { return sort.Search(n, func(j int) bool { return at(j) >= t }) }
		out[i] = [2]int{first(c.start), first(c.end + 1)}
	}
	return out
}

func median[T int | time.Duration](d []T) T {
	if len(d) == 0 {
		return 0
	}
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

func mean(d []int) float64 {
	if len(d) == 0 {
		return 0
	}
	sum := 0
	for _, x := range d {
		sum += x
	}
	return float64(sum) / float64(len(d))
}

func us(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Microsecond)) }

type row struct {
	key  string
	perc float64 // per call
	med  time.Duration
	n    int
}

func report(out io.Writer, calls []*call, traces []*events, names []string, top int) {
	var durs []time.Duration
	for _, c := range calls {
		durs = append(durs, time.Duration(c.end-c.start))
	}
	slices.Sort(durs)
	fmt.Fprintf(out, "%d calls: median %s µs, p10 %s, p90 %s\n", len(calls), us(durs[len(durs)/2]), us(durs[len(durs)/10]), us(durs[len(durs)*9/10]))

	// The calling goroutine's time by state, per call.
	total := map[string]time.Duration{}
	for _, c := range calls {
		for k, v := range c.states {
			total[k] += v
		}
	}
	var rows []row
	for k, v := range total {
		rows = append(rows, row{key: k, perc: float64(v) / float64(len(calls))})
	}
	table(out, "\nthe calling goroutine, µs per call (mean)", []string{"µs", "state"}, rows, top, func(r row) []string {
		return []string{fmt.Sprintf("%.1f", r.perc/1e3), r.key}
	})

	for i, ev := range traces {
		slices.SortFunc(ev.handoffs, func(a, b handoff) int { return int(a.at - b.at) })
		slices.SortFunc(ev.cgo, func(a, b cgoCall) int { return int(a.at - b.at) })
		slices.SortFunc(ev.regions, func(a, b cgoCall) int { return int(a.at - b.at) })
		hs := within(calls, len(ev.handoffs), func(j int) trace.Time { return ev.handoffs[j].at })
		var per []int // hand-offs per call
		kinds := map[string]int{}
		for _, h := range hs {
			per = append(per, h[1]-h[0])
			for _, x := range ev.handoffs[h[0]:h[1]] {
				kinds[x.by+" -> "+x.reason]++
			}
		}
		fmt.Fprintf(out, "\n%s: %d hand-offs per call (median; a goroutine made runnable by another, during the call)\n", names[i], median(per))
		rows = rows[:0]
		for k, n := range kinds {
			rows = append(rows, row{key: k, perc: float64(n) / float64(len(calls))})
		}
		table(out, "", []string{"per call", "made runnable by -> what it waited for"}, rows, top, func(r row) []string {
			return []string{fmt.Sprintf("%.2f", r.perc), r.key}
		})

		slices.Sort(ev.starts)
		ss := within(calls, len(ev.starts), func(j int) trace.Time { return ev.starts[j] })
		per = per[:0]
		for _, s := range ss {
			per = append(per, s[1]-s[0])
		}
		fmt.Fprintf(out, "\n%s: %d Ps started per call (median; %.2f mean: an idle P given a thread, which a host may charge a wake-up of an idle core for)\n", names[i], median(per), mean(per))

		slices.SortFunc(ev.yields, func(a, b handoff) int { return int(a.at - b.at) })
		ys := within(calls, len(ev.yields), func(j int) trace.Time { return ev.yields[j].at })
		clear(kinds)
		for _, y := range ys {
			for _, x := range ev.yields[y[0]:y[1]] {
				kinds[x.reason+" in "+x.by]++
			}
		}
		rows = rows[:0]
		for k, n := range kinds {
			rows = append(rows, row{key: k, perc: float64(n) / float64(len(calls))})
		}
		table(out, fmt.Sprintf("\n%s: yields during the calls (a running goroutine put back in a run queue: it yielded, or was preempted)", names[i]), []string{"per call", "why, where"}, rows, top, func(r row) []string {
			return []string{fmt.Sprintf("%.2f", r.perc), r.key}
		})

		rows = spans(calls, ev.cgo)
		table(out, fmt.Sprintf("\n%s: calls into C and syscalls during the calls", names[i]), []string{"µs per call", "median µs", "count", "function"}, rows, top, func(r row) []string {
			return []string{fmt.Sprintf("%.1f", r.perc/1e3), us(r.med), fmt.Sprint(r.n), r.key}
		})
		if rows = spans(calls, ev.regions); len(rows) > 0 {
			table(out, fmt.Sprintf("\n%s: regions begun during the calls (gdrpc's own steps among them; a region inside another counts in both)", names[i]), []string{"µs per call", "median µs", "count", "region"}, rows, top, func(r row) []string {
				return []string{fmt.Sprintf("%.1f", r.perc/1e3), us(r.med), fmt.Sprint(r.n), strings.TrimPrefix(r.key, "region ")}
			})
		}
	}

	fmt.Fprintln(out, "\na call's timeline: when each hand-off, call into C and region happens in a call, and when the goroutine made runnable ran, the call into C returned or the region ended (medians, µs from the call's start, over the calls that have it; rows in a third of the calls or more)")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "at\tuntil\tof calls\twhat")
	for _, m := range timeline(calls, traces, names, 1.0/3) {
		until := "-"
		if m.until >= 0 {
			until = us(m.until)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.0f%%\t%s\n", us(m.at), until, 100*m.share, m.what)
	}
	tw.Flush()
}

// spans sums, per function (or region), the spans of xs (sorted by start)
// that begin inside the calls: time per call, median and count.
func spans(calls []*call, xs []cgoCall) []row {
	cs := within(calls, len(xs), func(j int) trace.Time { return xs[j].at })
	byFn := map[string][]time.Duration{}
	for _, c := range cs {
		for _, x := range xs[c[0]:c[1]] {
			byFn[x.fn] = append(byFn[x.fn], x.took)
		}
	}
	var rows []row
	for fn, d := range byFn {
		var sum time.Duration
		for _, x := range d {
			sum += x
		}
		rows = append(rows, row{key: fn, perc: float64(sum) / float64(len(calls)), med: median(d), n: len(d)})
	}
	return rows
}

// mark is one row of a call's timeline: a kind of event (or its 2nd, 3rd or
// last time in a call), when it happened (the median over the calls that
// had it, from the call's start) and in what share of the calls.
type mark struct {
	what  string
	at    time.Duration
	until time.Duration // median: when the goroutine made runnable ran, when the call into C returned; -1: never in the trace
	share float64
}

// timeline lines up the calls' events of every trace: for each hand-off
// (by whom, of what) and each call into C, when it happened in a call, as a
// median over the calls, each kind named after its trace; a kind's second
// and third times in a call are rows of their own ("(2nd)"), and so is its
// last, over the calls that had it more than once, where some call had it
// more than three times ("(last)": a poll's end). Rows seen in fewer than
// minShare of the calls are left out; the call's end is a row too. It
// assumes one call at a time: the events of calls that overlap mix.
func timeline(calls []*call, traces []*events, names []string, minShare float64) []mark {
	at := map[string][]time.Duration{}
	until := map[string][]time.Duration{}
	many := map[string]bool{} // kinds some call had more than three times
	for i, ev := range traces {
		slices.SortFunc(ev.handoffs, func(a, b handoff) int { return int(a.at - b.at) })
		slices.SortFunc(ev.cgo, func(a, b cgoCall) int { return int(a.at - b.at) })
		slices.SortFunc(ev.regions, func(a, b cgoCall) int { return int(a.at - b.at) })
		hs := within(calls, len(ev.handoffs), func(j int) trace.Time { return ev.handoffs[j].at })
		cs := within(calls, len(ev.cgo), func(j int) trace.Time { return ev.cgo[j].at })
		rs := within(calls, len(ev.regions), func(j int) trace.Time { return ev.regions[j].at })
		for k, c := range calls {
			seen := map[string]int{}
			last := map[string]span{}
			add := func(what string, t, end trace.Time) {
				at[what] = append(at[what], time.Duration(t-c.start))
				if end >= t {
					until[what] = append(until[what], time.Duration(end-c.start))
				}
			}
			note := func(what string, t, end trace.Time) {
				seen[what]++
				n := seen[what]
				switch {
				case n == 1:
					add(what, t, end)
				case n <= 3:
					add(what+fmt.Sprintf(" (%s)", ordinal(n)), t, end)
				default:
					many[what] = true
				}
				if n > 1 {
					last[what] = span{t, end}
				}
			}
			for _, h := range ev.handoffs[hs[k][0]:hs[k][1]] {
				note(names[i]+": "+h.by+" -> "+h.reason, h.at, h.ran)
			}
			for _, x := range ev.cgo[cs[k][0]:cs[k][1]] {
				note(names[i]+": in C or a syscall: "+x.fn, x.at, x.at+trace.Time(x.took))
			}
			for _, x := range ev.regions[rs[k][0]:rs[k][1]] {
				note(names[i]+": "+x.fn, x.at, x.at+trace.Time(x.took))
			}
			for what, l := range last {
				add(what+" (last)", l.start, l.end)
			}
		}
	}
	for what := range at {
		if k, ok := strings.CutSuffix(what, " (last)"); ok && !many[k] {
			delete(at, what) // its 2nd or 3rd row says it
		}
	}
	var marks []mark
	for what, d := range at {
		share := float64(len(d)) / float64(len(calls))
		if share >= minShare {
			m := mark{what: what, at: median(d), until: -1, share: share}
			if u := until[what]; len(u) > 0 {
				m.until = median(u)
			}
			marks = append(marks, m)
		}
	}
	var durs []time.Duration
	for _, c := range calls {
		durs = append(durs, time.Duration(c.end-c.start))
	}
	end := median(durs)
	marks = append(marks, mark{what: "the call ends", at: end, until: end, share: 1})
	slices.SortFunc(marks, func(a, b mark) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		return strings.Compare(a.what, b.what)
	})
	return marks
}

// span is when an event began and ended.
type span struct{ start, end trace.Time }

// ordinal spells n (2 or more) as 2nd, 3rd, 4th, ...
func ordinal(n int) string {
	switch {
	case n%100/10 == 1:
		return fmt.Sprintf("%dth", n)
	case n%10 == 2:
		return fmt.Sprintf("%dnd", n)
	case n%10 == 3:
		return fmt.Sprintf("%drd", n)
	case n%10 == 1:
		return fmt.Sprintf("%dst", n)
	}
	return fmt.Sprintf("%dth", n)
}

// table prints the top rows by perc, largest first.
func table(out io.Writer, title string, head []string, rows []row, top int, cells func(row) []string) {
	slices.SortFunc(rows, func(a, b row) int {
		switch {
		case a.perc > b.perc:
			return -1
		case a.perc < b.perc:
			return 1
		}
		return strings.Compare(a.key, b.key)
	})
	if title != "" {
		fmt.Fprintln(out, title)
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, r := range rows[:min(top, len(rows))] {
		fmt.Fprintln(tw, strings.Join(cells(r), "\t"))
	}
	tw.Flush()
}
