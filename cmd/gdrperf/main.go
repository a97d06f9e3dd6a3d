package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
)

// options are gdrperf's flags.
type options struct {
	sizes     []int
	iters     int
	warmup    int
	conns     int           // gdrpc connections the calls spread over
	inflight  int           // calls in flight at once in the measured phase of the row being measured
	inflights []int         // -inflight: the values a row is measured at, per size
	transport string        // auto, ucx, tcp
	space     int           // -receive-space: 0 the default, -1 none
	reqSpace  int           // -request-space: 0 none
	reqLimit  int           // -request-space-limit: 0 none (spaces for requests that grow)
	busy      int           // CPU-bound processes beside the run (-busy)
	connects  int           // -connects: new connections to time, each way
	runs      int           // -runs: whole measurements, each with a server and connections of its own
	spin      bool          // this process is one of them
	metrics   gdrpc.Metrics // transfer events of the client's dialer (nil: none)
	mem       string        // host, cuda: where the sender's payload lives
	recv      string        // host, cuda: where the receiver's payload lands ("" at parse: as mem)
	op        string        // pull, push
	format    string        // table, json
	device    int
	srvDevice int    // the server's CUDA ordinal (-server-device; -1 at parse: as device)
	server    string // run only the server, listening here
	connect   string // run only the client, against this server
	perftest  string // ucx_perftest binary; "" looks it up, "none" skips
	paths     string // the -paths flag, as given (passed to the child)
	eager     int    // -eager: the codec's inline threshold on both ends; 0 keeps the codec's thresholds
	trust     bool   // the -trust-peers flag (passed to the child)
	ordered   bool   // -stream-ordered: take Pending GPU payloads, order a stream after them
	hold      int    // -hold: received payloads each goroutine keeps before releasing the oldest
	check     string // -check: every, or ends (the verified first call and the last measured one)
	pathMask  oob.Path
	callLimit time.Duration
	verbose   bool
	baselines bool // measure the baselines too (off: gdrpc alone, for profiling)
	child     bool // the server half of a same-host run (stdin EOF ends it)

	cpuprofile       string
	serverCPUProfile string
	trace            string
	serverTrace      string
}

// readyFD is the descriptor on which a child server announces its addresses
// (one JSON line): its stdout may carry UCX's log lines.
const readyFD = 3

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("gdrperf", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sizes := fs.String("sizes", "1MiB,16MiB,64MiB", "payload sizes, comma-separated (B, KiB, MiB, GiB)")
	fs.IntVar(&o.iters, "iters", 10, "measured calls per size and method (the median is reported)")
	fs.IntVar(&o.warmup, "warmup", 10, "unverified calls per size and method before measuring, after the verified call that always comes first")
	fs.IntVar(&o.conns, "conns", 1, "gdrpc client connections the calls spread over (a dialer.Pool: each call goes over the connection with the fewest in flight; each connection is a session of its own)")
	inflight := fs.String("inflight", "1", "calls in flight at once, or a comma list (a row per value and size, e.g. 1,4,8): above 1, that many goroutines make -iters calls each and the rates are aggregate throughput (bytes over wall time) instead of medians per call")
	fs.IntVar(&o.connects, "connects", 0, "after the table, time this many new connections each way, alternating: a new ClientConn up to its first call's response (a 1 KiB Make), gdrpc (the session's setup included) against plain gRPC over TCP; medians and p90")
	fs.IntVar(&o.runs, "runs", 1, "measure everything this many times, each run with a server process (unless -connect) and connections of its own, then print the medians over the runs with their ranges: where a run's threads land changes its figures, so compare medians of several runs (-connects times new connections to the last run's server only; -server-cpuprofile and -server-trace keep the last run's server; -server ignores it)")
	fs.IntVar(&o.busy, "busy", 0, "run this many CPU-bound processes (each spins one core) beside client and server for the whole run (with -server or -connect, beside this end only): calls under contention, as in a service sharing its cores")
	fs.BoolVar(&o.spin, "spin", false, "spin on one core until stdin closes (the processes -busy starts)")
	fs.StringVar(&o.transport, "transport", "auto", "gdrpc transport: auto, ucx or tcp")
	fs.StringVar(&o.mem, "mem", "host", "where the sender's payload lives: host, or cuda (GPU -device); give the same on both ends")
	fs.StringVar(&o.recv, "recv", "", "where received payloads land: host or cuda; if empty, as -mem (-mem cuda -recv host measures the staged path)")
	fs.StringVar(&o.op, "op", "pull", "pull: the client calls Make and pulls the server's payload; push: the client calls Digest and the server pulls the client's")
	fs.StringVar(&o.format, "format", "table", "output: table, or json (one object per size)")
	fs.IntVar(&o.device, "device", 0, "CUDA device ordinal for -mem cuda")
	fs.IntVar(&o.srvDevice, "server-device", -1, "CUDA device ordinal of the re-executed server (-1: as -device); another GPU than -device measures cuda-ipc between GPUs against an in-process peer copy")
	fs.StringVar(&o.server, "server", "", "run only the server, listening on HOST:PORT, PORT given (plain gRPC on PORT+1, ucx_perftest on PORT+2)")
	fs.StringVar(&o.connect, "connect", "", "run only the client, against a gdrperf -server at HOST:PORT")
	fs.StringVar(&o.perftest, "perftest", "", `ucx_perftest binary ("" looks it up in PATH, and skips the column if it is not there; "none" skips it); measured only beside a gdrpc session over UCX`)
	fs.StringVar(&o.paths, "paths", "all", "out-of-band paths transfers may take: all, or a comma list of cuda-ipc, rdma (covers staged), stream (always allowed); give the same on both ends")
	eager := fs.String("eager", "", `payloads under this size travel inline in the message, over any session (gdrcodec.WithEagerThreshold, both ends); "" keeps the codec's default: 64 KiB, 128 KiB for host payloads over a TCP session`)
	space := fs.String("receive-space", "", `receive space the client advertises to a trusted server (gdrpc.WithReceiveSpace): a size, or 0 for none; "" keeps the default`)
	reqLimit := fs.String("request-space-limit", "0", "receive space for requests' payloads that grows with them, within this size per session (gdrpc.WithReceiveSpaceLimit on the listener; instead of -request-space), 0 for none; passed as -request-space is")
	reqSpace := fs.String("request-space", "0", "receive space the server advertises to a trusted client for its requests' payloads (gdrpc.WithReceiveSpace on the listener), a size or 0 for none; the re-executed server gets it, and across hosts give it to -server (op push)")
	fs.DurationVar(&o.callLimit, "call-timeout", time.Minute, "bound of each measured call")
	fs.BoolVar(&o.ordered, "stream-ordered", false, "client: take payloads that land in GPU receive space before their copy ends (gdrpc.WithStreamOrdered) and order a stream of the calling goroutine after each; a goroutine's calls end after its stream has caught up, so with -inflight 1 every call includes its copy (needs -recv cuda, -op pull)")
	fs.StringVar(&o.check, "check", "every", "op pull, one call at a time: every, each call's payload is read back once its time is taken, before the next call (on a GPU both processes share, this reading puts the client's GPU context between the server's copies); ends, only the verified first call and the last measured one are read back (with -inflight N each goroutine's first verified and last call are, whatever -check says)")
	fs.IntVar(&o.hold, "hold", 0, "client, op pull: each calling goroutine keeps its last N received payloads, releasing the oldest as the next arrives, as a caller holding a window of tensors does (each holds a range of a receive space meanwhile: N+1 per goroutine while the next arrives)")
	fs.BoolVar(&o.trust, "trust-peers", false, "gdrpc.WithTrustPeers on both ends: UCX sessions (auto mode), their RDMA and CUDA IPC paths and receive spaces; without it sessions run over TCP and payloads take the stream path")
	fs.BoolVar(&o.baselines, "baselines", true, "measure the baselines (plain gRPC, ucx_perftest, dtod, naive); false measures gdrpc alone, e.g. for -cpuprofile")
	fs.BoolVar(&o.verbose, "v", false, "log the UCX lanes of the gdrpc session")
	fs.BoolVar(&o.child, "child", false, "internal: server half of a same-host run")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write this process's CPU profile to the file")
	fs.StringVar(&o.serverCPUProfile, "server-cpuprofile", "", "write the re-executed server's CPU profile to the file (not with -server or -connect: give -cpuprofile to gdrperf -server)")
	fs.StringVar(&o.trace, "trace", "", "write this process's execution trace to the file (go tool trace: where calls wait; gdrtrace breaks a call down, its regions gdrperf.call for gdrpc's calls, gdrperf.grpc for plain gRPC's)")
	fs.StringVar(&o.serverTrace, "server-trace", "", "write the re-executed server's execution trace to the file (not with -server or -connect: give -trace to gdrperf -server)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.recv == "" {
		o.recv = o.mem
	}
	if o.srvDevice < 0 {
		o.srvDevice = o.device
	}
	var err error
	if *eager != "" {
		if o.eager, err = parseSize(*eager); err != nil {
			return nil, fmt.Errorf("-eager: %w", err)
		}
	}
	if o.pathMask, err = parsePaths(o.paths); err != nil {
		return nil, err
	}
	if *space != "" {
		if *space == "0" {
			o.space = -1
		} else if o.space, err = parseSize(*space); err != nil {
			return nil, fmt.Errorf("-receive-space: %w", err)
		}
	}
	if *reqSpace != "0" {
		if o.reqSpace, err = parseSize(*reqSpace); err != nil {
			return nil, fmt.Errorf("-request-space: %w", err)
		}
	}
	if *reqLimit != "0" {
		if o.reqLimit, err = parseSize(*reqLimit); err != nil {
			return nil, fmt.Errorf("-request-space-limit: %w", err)
		}
	}
	if o.sizes, err = parseSizes(*sizes); err != nil {
		return nil, err
	}
	if o.inflights, err = parseCounts(*inflight); err != nil {
		return nil, fmt.Errorf("-inflight: %w", err)
	}
	o.inflight = slices.Max(o.inflights)
	check := func(name, v string, allowed ...string) error {
		for _, a := range allowed {
			if v == a {
				return nil
			}
		}
		return fmt.Errorf("-%s %q: want one of %s", name, v, strings.Join(allowed, ", "))
	}
	for _, c := range []error{
		check("transport", o.transport, "auto", "ucx", "tcp"),
		check("mem", o.mem, "host", "cuda"),
		check("recv", o.recv, "", "host", "cuda"),
		check("op", o.op, "pull", "push"),
		check("format", o.format, "table", "json"),
		check("check", o.check, "every", "ends"),
	} {
		if c != nil {
			return nil, c
		}
	}
	switch {
	case o.iters < 1:
		return nil, fmt.Errorf("-iters %d: want at least 1", o.iters)
	case o.warmup < 0:
		return nil, fmt.Errorf("-warmup %d: want 0 or more", o.warmup)
	case o.connects < 0:
		return nil, fmt.Errorf("-connects %d: want 0 or more", o.connects)
	case o.runs < 1:
		return nil, fmt.Errorf("-runs %d: want at least 1", o.runs)
	case o.conns < 1 || o.conns > o.inflight:
		return nil, fmt.Errorf("-conns %d: want 1 to the largest -inflight (%d)", o.conns, o.inflight)
	case o.reqSpace > 0 && o.reqLimit > 0:
		return nil, errors.New("-request-space and -request-space-limit exclude each other")
	case o.server != "" && o.connect != "":
		return nil, errors.New("-server and -connect exclude each other")
	case o.callLimit <= 0:
		return nil, fmt.Errorf("-call-timeout %v: want a positive duration", o.callLimit)
	case o.ordered && (o.recv != "cuda" || o.op != "pull"):
		return nil, errors.New("-stream-ordered needs -recv cuda (or -mem cuda) and -op pull")
	case o.check != "every" && o.op != "pull":
		return nil, fmt.Errorf("-check %s: with -op pull (the server checksums pushed requests)", o.check)
	case o.hold < 0 || o.hold > 0 && o.op != "pull":
		return nil, fmt.Errorf("-hold %d: want 0 or more, with -op pull", o.hold)
	case (o.serverCPUProfile != "" || o.serverTrace != "") && (o.server != "" || o.connect != ""):
		return nil, errors.New("-server-cpuprofile and -server-trace are for the server this process starts: with -server or -connect, give -cpuprofile or -trace to the gdrperf -server")
	}
	if o.server != "" && !o.child {
		if _, _, err := serverAddr("-server", o.server); err != nil {
			return nil, err
		}
	}
	if o.connect != "" {
		if _, _, err := serverAddr("-connect", o.connect); err != nil {
			return nil, err
		}
	}
	if o.perftest != "" && o.perftest != "none" {
		if _, _, err := perftestBinary(o.perftest); err != nil {
			return nil, err
		}
	}
	return o, nil
}

// serverAddr splits addr, the -server or -connect flag's HOST:PORT, whose
// PORT a -connect client finds plain gRPC and ucx_perftest next to.
func serverAddr(flag, addr string) (host string, port int, err error) {
	host, ps, err := net.SplitHostPort(addr)
	if err == nil {
		port, err = strconv.Atoi(ps)
	}
	if err != nil || port < 1 || port > 65533 {
		return "", 0, fmt.Errorf("%s %q: want HOST:PORT with a port from 1 to 65533 (plain gRPC listens on PORT+1 and ucx_perftest on PORT+2, where gdrperf -connect looks for them)", flag, addr)
	}
	return host, port, nil
}

// parseCounts reads a comma list of whole numbers of at least 1, in the
// order given, without repeats.
func parseCounts(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		n, err := strconv.Atoi(f)
		switch {
		case err != nil:
			return nil, fmt.Errorf("%q: not a whole number", f)
		case n < 1:
			return nil, fmt.Errorf("%d: want at least 1", n)
		case slices.Contains(out, n):
			return nil, fmt.Errorf("%d given twice", n)
		}
		out = append(out, n)
	}
	return out, nil
}

// parsePaths reads -paths: "all" (or "") allows every path (the mask is
// zero: the transport's default); else the named paths, the stream path
// always among them.
func parsePaths(s string) (oob.Path, error) {
	if s == "" || s == "all" {
		return 0, nil
	}
	mask := oob.PathStream
	for f := range strings.SplitSeq(s, ",") {
		switch strings.TrimSpace(f) {
		case "cuda-ipc":
			mask |= oob.PathCUDAIPC
		case "rdma":
			mask |= oob.PathRDMA
		case "stream":
		default:
			return 0, fmt.Errorf("-paths %q: want all, or a comma list of cuda-ipc, rdma, stream", s)
		}
	}
	return mask, nil
}

// transferConfig is the out-of-band engine's configuration for this run.
// perftestMem is ucx_perftest's -m for this run: the payload's and the
// destination's memory types, or "" when both are host memory.
func (o *options) perftestMem() string {
	if o.mem == "host" && o.recv == "host" {
		return ""
	}
	return o.mem + "," + o.recv
}

// faceOptions returns the options of the dialer of this run.
func (o *options) faceOptions() []gdrpc.Option {
	opts := []gdrpc.Option{gdrpc.WithTransport(gdrpc.Mode(o.transport)), gdrpc.WithTransferTimeout(o.callLimit), gdrpc.WithPaths(o.pathMask)}
	if o.trust {
		opts = append(opts, gdrpc.WithTrustPeers())
	}
	if o.metrics != nil {
		opts = append(opts, gdrpc.WithMetrics(o.metrics))
	}
	if o.space != 0 {
		opts = append(opts, gdrpc.WithReceiveSpace(o.space))
	}
	if o.ordered {
		opts = append(opts, gdrpc.WithStreamOrdered())
	}
	return opts
}

// listenerOptions returns the options of the listener of this run: the
// dialer's, but with the server's receive space for requests (none by
// default) instead of the client's.
func (o *options) listenerOptions() []gdrpc.Option {
	c := *o
	c.space, c.ordered = -1, false
	if o.reqSpace > 0 {
		c.space = o.reqSpace
	}
	opts := c.faceOptions()
	if o.reqLimit > 0 {
		opts = append(opts, gdrpc.WithReceiveSpaceLimit(o.reqLimit))
	}
	return opts
}

// allocators returns where this process's payloads live and, when -mem or
// -recv is cuda, the GPU allocator (nil otherwise).
func (o *options) allocators() (payload, cuda devicebuf.Allocator, err error) {
	if o.mem == "cuda" || o.recv == "cuda" {
		if cuda, err = devicebuf.NewCUDAAllocator(o.device); err != nil {
			return nil, nil, fmt.Errorf("-mem/-recv cuda: GPU %d is not usable: %w", o.device, err)
		}
	}
	if o.mem == "cuda" {
		return cuda, cuda, nil
	}
	payload, err = o.hostAllocator()
	return payload, cuda, err
}

// hostAllocator is the host memory a gdrpc user sends from: the pool of
// UCX-allocated memory, registered once (plain host memory without UCX).
func (o *options) hostAllocator() (devicebuf.Allocator, error) {
	if o.transport == "tcp" {
		return oob.HostPool(nil), nil
	}
	return oob.DefaultHostPool(), nil
}

// registerCodec registers the gdr codec. With -recv cuda received payloads
// land in a pool of GPU memory (blocks are reused, so the sender's CUDA IPC
// mapping of them can be too); else in gdrpc's registered host pool. The
// returned function, called once every received payload was released, frees
// the pool and restores the default allocator.
func registerCodec(o *options, cuda devicebuf.Allocator) (func(), error) {
	var copts []gdrcodec.Option
	if o.eager > 0 {
		copts = append(copts, gdrcodec.WithEagerThreshold(o.eager))
	}
	if o.recv != "cuda" {
		gdrcodec.Register(copts...)
		return func() {}, nil
	}
	pool, err := devicebuf.NewPayloadPool(cuda, 32<<30)
	if err != nil {
		return nil, err
	}
	gdrcodec.Register(append(copts, gdrcodec.WithReceiveAllocator(pool))...)
	return func() {
		gdrcodec.Register()
		pool.Close()
	}, nil
}

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// realMain runs gdrperf and returns its exit status.
func realMain(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "gdrperf:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			fmt.Fprintln(stderr, "gdrperf:", err)
			return 1
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(stderr, "gdrperf:", err)
			return 1
		}
		defer func() {
			pprof.StopCPUProfile()
			f.Close()
		}()
	}
	if o.trace != "" {
		f, err := os.Create(o.trace)
		if err != nil {
			fmt.Fprintln(stderr, "gdrperf:", err)
			return 1
		}
		if err := trace.Start(f); err != nil {
			fmt.Fprintln(stderr, "gdrperf:", err)
			return 1
		}
		defer func() {
			trace.Stop()
			f.Close()
		}()
	}
	logf := func(format string, a ...any) { fmt.Fprintf(stderr, "gdrperf: "+format+"\n", a...) }
	if o.spin {
		spin(stdin)
		return 0
	}
	if o.busy > 0 {
		stopBusy, err := startBusy(o.busy)
		if err != nil {
			fmt.Fprintln(stderr, "gdrperf:", err)
			return 1
		}
		defer stopBusy()
	}
	if o.server != "" {
		err = runServer(ctx, o, stdin, stdout, logf)
	} else {
		err = runClient(ctx, o, stdout, logf)
	}
	if err != nil {
		fmt.Fprintln(stderr, "gdrperf:", err)
		return 1
	}
	return 0
}

// runServer serves until ctx ends or, for a child, until its stdin closes
// (the parent exited or is done).
func runServer(ctx context.Context, o *options, stdin io.Reader, stdout io.Writer, logf func(string, ...any)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if o.child {
		go func() {
			_, _ = io.Copy(io.Discard, stdin)
			cancel()
		}()
	}
	return serve(ctx, o, func(info readyInfo) {
		if o.child {
			f := os.NewFile(readyFD, "ready")
			b, _ := json.Marshal(info)
			_, _ = f.Write(append(b, '\n'))
			f.Close() // not inherited by the ucx_perftest servers started later
			return
		}
		fmt.Fprintf(stdout, "gdrperf server: gdrpc on %s, plain gRPC on %s", info.GDRPC, info.GRPC)
		if info.PerftestPort != 0 {
			fmt.Fprintf(stdout, ", ucx_perftest on port %d", info.PerftestPort)
		}
		if info.PerftestNote != "" {
			fmt.Fprintf(stdout, " (%s)", info.PerftestNote)
		}
		fmt.Fprintf(stdout, "; GOMAXPROCS %d", info.Procs)
		if info.CPUs != "" {
			fmt.Fprintf(stdout, ", CPUs %s", info.CPUs)
		}
		fmt.Fprintln(stdout)
	}, logf)
}

// childEnv is set in the environment of the re-executed server, so a test
// binary can tell that it is the child.
const childEnv = "GDRPERF_CHILD"

// child is the re-executed server process.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	exited chan struct{} // closed once the process ended and was waited for
	err    error         // cmd.Wait's, set before exited is closed
}

// startChild re-executes this program as the server on 127.0.0.1 and waits
// (bounded) for it to announce its addresses.
func startChild(ctx context.Context, o *options) (*child, readyInfo, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, readyInfo{}, fmt.Errorf("find this program to run the server: %w", err)
	}
	args := []string{"-child", "-server", "127.0.0.1:0", "-transport", o.transport, "-mem", o.mem, "-recv", o.recv,
		"-device", strconv.Itoa(o.srvDevice), "-perftest", o.perftest, "-paths", o.paths,
		"-call-timeout", o.callLimit.String(), "-trust-peers=" + strconv.FormatBool(o.trust), "-request-space", strconv.Itoa(o.reqSpace),
		"-request-space-limit", strconv.Itoa(o.reqLimit)}
	if o.eager > 0 {
		args = append(args, "-eager", strconv.Itoa(o.eager))
	}
	if o.serverCPUProfile != "" {
		args = append(args, "-cpuprofile", o.serverCPUProfile)
	}
	if o.serverTrace != "" {
		args = append(args, "-trace", o.serverTrace)
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr // the server's (and UCX's) messages
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, readyInfo{}, err
	}
	rr, rw, err := os.Pipe()
	if err != nil {
		return nil, readyInfo{}, err
	}
	defer rr.Close()
	cmd.ExtraFiles = []*os.File{rw} // readyFD in the child
	err = cmd.Start()
	rw.Close()
	if err != nil {
		return nil, readyInfo{}, fmt.Errorf("start the server: %w", err)
	}
	c := &child{cmd: cmd, stdin: stdin, exited: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.exited)
	}()
	lines := make(chan string, 1)
	go func() {
		// Ends at the server's first line, or when it exits or rr is closed.
		l, _ := bufio.NewReader(rr).ReadString('\n')
		lines <- l
	}()
	t := time.NewTimer(30 * time.Second)
	defer t.Stop()
	var info readyInfo
	select {
	case l := <-lines:
		if l == "" {
			err = errors.New("the server exited before it was ready")
		} else {
			err = json.Unmarshal([]byte(l), &info)
		}
	case <-t.C:
		err = errors.New("the server did not get ready within 30s")
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		c.stop()
		return nil, readyInfo{}, err
	}
	return c, info, nil
}

// ended reports whether the server process ended (without waiting).
func (c *child) ended() bool {
	select {
	case <-c.exited:
		return true
	default:
		return false
	}
}

// stop asks the server to exit (closing its stdin), waits up to 10 s, then
// kills it. It returns an error where the server ended before it was asked
// to, ended by a signal or with an error, or had to be killed.
func (c *child) stop() error {
	early := c.ended()
	c.stdin.Close()
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-c.exited:
	case <-t.C:
		_ = c.cmd.Process.Kill()
		<-c.exited
		return fmt.Errorf("the server process did not exit within 10s of being asked to; killed: %v", c.err)
	}
	switch {
	case c.err != nil:
		return fmt.Errorf("the server process failed (%v); its messages, if any, are above", c.err)
	case early:
		return errors.New("the server process exited before the run ended; its messages, if any, are above")
	}
	return nil
}

// spin keeps one core busy until stdin closes (the parent is done or gone).
func spin(stdin io.Reader) {
	runtime.GOMAXPROCS(1)
	var done atomic.Bool
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		done.Store(true)
	}()
	for n := 0; !done.Load(); n++ {
		if n%(1<<20) == 0 {
			runtime.Gosched() // let the stdin reader run
		}
	}
}

// startBusy starts n processes that spin one core each (gdrperf -spin) and
// returns the function that stops them.
func startBusy(n int) (func(), error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var cmds []*exec.Cmd
	var stdins []io.Closer
	stop := func() {
		for _, c := range stdins {
			_ = c.Close()
		}
		for _, c := range cmds {
			_ = c.Wait()
		}
	}
	for range n {
		c := exec.Command(exe, "-spin")
		c.Env = append(os.Environ(), childEnv+"=1")
		in, err := c.StdinPipe()
		if err != nil {
			stop()
			return nil, err
		}
		if err := c.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("start a busy process: %w", err)
		}
		cmds, stdins = append(cmds, c), append(stdins, in)
	}
	return stop, nil
}
