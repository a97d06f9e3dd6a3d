package rdma

import (
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// MemoryType says where memory lives.
type MemoryType int

const (
	// MemoryHost is ordinary CPU memory.
	MemoryHost MemoryType = iota
	// MemoryCUDA is CUDA device memory; the CPU never touches it.
	MemoryCUDA
)

func (t MemoryType) String() string {
	switch t {
	case MemoryHost:
		return "host"
	case MemoryCUDA:
		return "cuda"
	}
	return "MemoryType(" + strconv.Itoa(int(t)) + ")"
}

// Option configures a Context.
type Option func(*options)

type options struct {
	config    map[string]string // UCX config keys without the UCX_ prefix
	order     []string
	logger    *slog.Logger
	pollTime  time.Duration
	pollSet   bool
	direct    bool // see WithDirectCopies
	directSet bool
}

func (o *options) set(key, value string) {
	if o.config == nil {
		o.config = map[string]string{}
	}
	if _, ok := o.config[key]; !ok {
		o.order = append(o.order, key)
	}
	o.config[key] = value
}

func (o *options) unset(key string) {
	delete(o.config, key)
	o.order = slices.DeleteFunc(o.order, func(k string) bool { return k == key })
}

func buildOptions(opts []Option) *options {
	o := &options{}
	for _, opt := range opts {
		opt(o)
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
	if !o.directSet {
		var bad string
		if o.direct, bad = directFromEnv(); bad != "" {
			o.logger.Warn("ignoring a bad "+DirectEnv, "value", bad, "default", true)
		}
	}
	if !o.pollSet {
		o.pollTime = DefaultPollTime
		if v, ok := os.LookupEnv(PollEnv); ok {
			if d, err := time.ParseDuration(v); err == nil && d >= 0 {
				o.pollTime = d
			} else {
				o.logger.Warn("ignoring a bad "+PollEnv, "value", v, "default", DefaultPollTime)
			}
		}
	}
	return o
}

// PollEnv names the environment variable that sets the poll time of contexts
// made without WithPollTime (a Go duration; 0 parks at once).
const PollEnv = "GDRPC_RDMA_POLL"

// DefaultPollTime is how long a worker's driver polls after the last work,
// whoever did it, before it parks on the worker's event fd. Waking a parked
// driver costs an OS thread wake-up (50-300 µs on virtual machines), and so
// does every goroutine hand-off after it while the process is idle; a reply
// that arrives while the driver polls reaches its reader on the driver's P,
// without any. Replies to an RPC, an out-of-band request or a transfer often
// come a few hundred microseconds after the last message: polling for 1 ms
// catches them, at the cost of one core busy (yielding to other goroutines)
// for at most that long after traffic stops.
const DefaultPollTime = time.Millisecond

// WithPollTime sets how long the context's workers poll after the last work
// before they park (see DefaultPollTime); 0 or less parks at once. If not
// given, the environment variable GDRPC_RDMA_POLL, or DefaultPollTime.
func WithPollTime(d time.Duration) Option {
	return func(o *options) { o.pollTime, o.pollSet = max(d, 0), true }
}

// DirectEnv names the environment variable that turns direct copies off
// (false) for contexts made without WithDirectCopies.
const DirectEnv = "GDRPC_RDMA_DIRECT"

// WithDirectCopies sets whether puts and gets with a key of host memory in a
// shared-memory segment on this host (memory the peer allocated with
// Context.Alloc) are copies this process makes itself into the segment UCX
// attached when it unpacked the key, off the worker, instead of UCX
// operations. UCX picks a tcp lane for puts and gets between two processes of
// one host when its connections have peer error handling: a copy into the
// segment moves the same bytes at memory speed. If not given, the environment
// variable GDRPC_RDMA_DIRECT, or true.
func WithDirectCopies(on bool) Option {
	return func(o *options) { o.direct, o.directSet = on, true }
}

// DirectCopiesDefault reports whether contexts made without WithDirectCopies
// make direct copies: GDRPC_RDMA_DIRECT, or true when unset or unparsable.
func DirectCopiesDefault() bool {
	on, _ := directFromEnv()
	return on
}

// directFromEnv reads GDRPC_RDMA_DIRECT: its value, true when unset, and
// the text it holds when that is no boolean (then true).
func directFromEnv() (on bool, bad string) {
	v, ok := os.LookupEnv(DirectEnv)
	if !ok {
		return true, ""
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return true, v
	}
	return b, ""
}

// WithTransports sets UCX_TLS (for example "tcp", or "posix,sysv,cma,tcp" for
// shared memory: connection setup through a listener needs tcp in the list)
// unless the environment already sets UCX_TLS. If not given, UCX picks.
func WithTransports(tls string) Option {
	return func(o *options) { o.set("TLS", tls) }
}

// WithConfig sets any UCX configuration key (without the UCX_ prefix) unless the
// environment already sets it.
func WithConfig(key, value string) Option {
	return func(o *options) { o.set(key, value) }
}

// WithLogger sets the logger. If nil or not given, nothing is logged.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.logger = l
		}
	}
}

// CUDA makes a device's CUDA context current around the UCX calls that may
// touch CUDA memory: UCX needs one on the calling thread, and without it takes
// a device pointer for host memory. devicebuf.CUDAThreadContexts implements it.
type CUDA interface {
	// ThreadContext returns device dev's context (a CUcontext) and two C
	// function pointers: push, `int push(void *ctx)`, makes ctx current on
	// the calling thread, keeping the context it replaces, and returns 0 on
	// success; pop, `void pop(void)`, restores that context.
	ThreadContext(dev int) (ctx, push, pop uintptr, err error)
}

// Info is what a Context can do.
type Info struct {
	Version     string       // UCX version of the loaded library, e.g. "1.13.1"
	Transports  []string     // transports/devices UCX can use here, "tl/device" (best effort)
	MemoryTypes []MemoryType // memory types UCX can register (MemoryCUDA only with a CUDA-enabled UCX)
}

// AtLeast reports whether the UCX version is major.minor or later; an
// unreadable version is not.
func (i Info) AtLeast(major, minor int) bool {
	parts := strings.SplitN(i.Version, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > major || ma == major && mi >= minor
}

// HasMemoryType reports whether t is among the registrable memory types.
func (i Info) HasMemoryType(t MemoryType) bool {
	for _, m := range i.MemoryTypes {
		if m == t {
			return true
		}
	}
	return false
}

// Counters counts live objects of this package, for leak checks in tests.
type Counters struct {
	Contexts   int64
	Workers    int64
	Endpoints  int64
	Listeners  int64
	Memories   int64 // memory maps (Alloc, Map and the per-call pins of PutBytes)
	RemoteKeys int64
}

// Zero reports whether nothing is alive.
func (c Counters) Zero() bool { return c == Counters{} }

var live struct {
	contexts, workers, endpoints, listeners, memories, rkeys atomic.Int64
}

// Stats returns the number of live contexts, workers, endpoints, listeners,
// memory maps and remote keys. The Default context and its worker count while
// they exist.
func Stats() Counters {
	return Counters{
		Contexts:   live.contexts.Load(),
		Workers:    live.workers.Load(),
		Endpoints:  live.endpoints.Load(),
		Listeners:  live.listeners.Load(),
		Memories:   live.memories.Load(),
		RemoteKeys: live.rkeys.Load(),
	}
}

// Addr is the address of a UCX listener or endpoint. Network() is "ucx".
type Addr struct {
	IP   net.IP
	Port int
	Zone string
}

// Network returns "ucx".
func (a *Addr) Network() string { return "ucx" }

func (a *Addr) String() string {
	if a == nil {
		return "<nil>"
	}
	return (&net.TCPAddr{IP: a.IP, Port: a.Port, Zone: a.Zone}).String()
}

// mayUseMM reports whether a UCX_TLS value may select the mm transports
// (posix, sysv); UCX warns about configuration no transport used.
func mayUseMM(tls string) bool {
	tls = strings.TrimSpace(strings.ToLower(tls))
	if tls == "" || strings.HasPrefix(tls, "^") {
		return true
	}
	for t := range strings.SplitSeq(tls, ",") {
		switch strings.TrimSpace(t) {
		case "all", "sm", "shm", "mm", "posix", "sysv":
			return true
		}
	}
	return false
}

// hasIBDevices reports whether the host has InfiniBand/RoCE devices, for which
// UCX loads its InfiniBand memory domain.
func hasIBDevices() bool {
	entries, err := os.ReadDir("/sys/class/infiniband")
	return err == nil && len(entries) > 0
}
