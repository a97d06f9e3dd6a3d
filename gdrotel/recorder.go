package gdrotel

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// ScopeName is the instrumentation scope of the Recorder's meter.
const ScopeName = "github.com/gdrpc/gdrpc/gdrotel"

// DefaultMaxReasons is how many distinct reasons each fallback counter keeps
// apart when WithMaxReasons is not given.
const DefaultMaxReasons = 32

// otherValue is the value of an attribute whose real value is not kept apart:
// a fallback reason past the limit, an error of no known class. It is the
// value OpenTelemetry's semantic conventions use for error.type.
const otherValue = "_OTHER"

// durationBuckets are the bucket boundaries, in seconds, of
// gdrpc.transfer.duration: 10µs (a copy within one host) to 10s (a large
// payload over a slow link), at 1, 2.5 and 5 per decade.
var durationBuckets = []float64{
	0.00001, 0.000025, 0.00005,
	0.0001, 0.00025, 0.0005,
	0.001, 0.0025, 0.005,
	0.01, 0.025, 0.05,
	0.1, 0.25, 0.5,
	1, 2.5, 5,
	10,
}

// Option configures New.
type Option func(*options)

type options struct {
	maxReasons int
}

// WithMaxReasons bounds how many distinct reasons each fallback counter
// (gdrpc.transfer.fallbacks, gdrpc.session.fallbacks) records; reasons seen
// after that many record as "_OTHER". If zero, DefaultMaxReasons.
func WithMaxReasons(n int) Option {
	return func(o *options) { o.maxReasons = n }
}

// Recorder turns gdrpc's transfer, session and pool events into OpenTelemetry
// metrics. Its instruments are made once, by New; recording reuses attribute
// sets made on first use. A Recorder is safe for concurrent use. Make one
// with New: a nil *Recorder or a zero Recorder records nothing (so that one
// passed on after New failed cannot take a session down).
type Recorder struct {
	meter metric.Meter

	transferIO           metric.Int64Counter
	transferCount        metric.Int64Counter
	transferDuration     metric.Float64Histogram
	transferFallbacks    metric.Int64Counter
	transferOpts         optsCache[transferKey]
	transferFallbackOpts optsCache[transferFallbackKey]
	transferReasons      reasonSet

	sessionActive       metric.Int64UpDownCounter
	sessionOpened       metric.Int64Counter
	sessionClosed       metric.Int64Counter
	sessionFallbacks    metric.Int64Counter
	sessionOpts         optsCache[sessionKey]
	sessionClosedOpts   optsCache[sessionClosedKey]
	sessionFallbackOpts optsCache[string]
	sessionReasons      reasonSet

	poolRegionCount   metric.Int64ObservableUpDownCounter
	poolRegionUsage   metric.Int64ObservableUpDownCounter
	poolBufferCount   metric.Int64ObservableUpDownCounter
	poolBufferUsage   metric.Int64ObservableUpDownCounter
	poolRegistrations metric.Int64ObservableCounter
	poolAllocations   metric.Int64ObservableCounter
	poolWaits         metric.Int64ObservableCounter
	poolRegionsFreed  metric.Int64ObservableCounter

	poolsMu sync.Mutex
	pools   map[string]struct{} // names of the pools observed now
}

// New returns a Recorder whose instruments come from mp's meter for
// ScopeName. If mp is nil, the global MeterProvider (otel.GetMeterProvider).
func New(mp metric.MeterProvider, opts ...Option) (*Recorder, error) {
	o := options{maxReasons: DefaultMaxReasons}
	for _, opt := range opts {
		if opt != nil { // an optional option left unset
			opt(&o)
		}
	}
	if o.maxReasons <= 0 {
		o.maxReasons = DefaultMaxReasons
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(ScopeName)
	r := &Recorder{
		meter:                m,
		transferOpts:         newOptsCache(transferAttrs),
		transferFallbackOpts: newOptsCache(transferFallbackAttrs),
		transferReasons:      newReasonSet(o.maxReasons),
		sessionOpts:          newOptsCache(sessionAttrs),
		sessionClosedOpts:    newOptsCache(sessionClosedAttrs),
		sessionFallbackOpts:  newOptsCache(sessionFallbackAttrs),
		sessionReasons:       newReasonSet(o.maxReasons),
		pools:                make(map[string]struct{}),
	}

	var errs []error
	collect := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	var err error

	r.transferIO, err = m.Int64Counter("gdrpc.transfer.io",
		metric.WithUnit("By"),
		metric.WithDescription("Bytes of successful out-of-band transfers, by direction; a failed transfer counts none (its length is what the peer claimed)."))
	collect(err)
	r.transferCount, err = m.Int64Counter("gdrpc.transfers",
		metric.WithUnit("{transfer}"),
		metric.WithDescription("Finished out-of-band transfers."))
	collect(err)
	r.transferDuration, err = m.Float64Histogram("gdrpc.transfer.duration",
		metric.WithUnit("s"),
		metric.WithDescription("Duration of out-of-band transfers."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	collect(err)
	r.transferFallbacks, err = m.Int64Counter("gdrpc.transfer.fallbacks",
		metric.WithUnit("{fallback}"),
		metric.WithDescription("Transfers that did not take a better path, by the path wanted, the path taken and why."))
	collect(err)

	r.sessionActive, err = m.Int64UpDownCounter("gdrpc.session.active",
		metric.WithUnit("{session}"),
		metric.WithDescription("Sessions open now."))
	collect(err)
	r.sessionOpened, err = m.Int64Counter("gdrpc.session.opened",
		metric.WithUnit("{session}"),
		metric.WithDescription("Sessions opened."))
	collect(err)
	r.sessionClosed, err = m.Int64Counter("gdrpc.session.closed",
		metric.WithUnit("{session}"),
		metric.WithDescription("Sessions closed, by why they closed."))
	collect(err)
	r.sessionFallbacks, err = m.Int64Counter("gdrpc.session.fallbacks",
		metric.WithUnit("{fallback}"),
		metric.WithDescription("Sessions that stayed on TCP although the server offered UCX, by why."))
	collect(err)

	r.poolRegionCount, err = m.Int64ObservableUpDownCounter("gdrpc.pool.region.count",
		metric.WithUnit("{region}"),
		metric.WithDescription("Regions a buffer pool holds."))
	collect(err)
	r.poolRegionUsage, err = m.Int64ObservableUpDownCounter("gdrpc.pool.region.usage",
		metric.WithUnit("By"),
		metric.WithDescription("Bytes of the regions a buffer pool holds (registered memory)."))
	collect(err)
	r.poolBufferCount, err = m.Int64ObservableUpDownCounter("gdrpc.pool.buffer.count",
		metric.WithUnit("{buffer}"),
		metric.WithDescription("Buffers a pool handed out that are not yet returned."))
	collect(err)
	r.poolBufferUsage, err = m.Int64ObservableUpDownCounter("gdrpc.pool.buffer.usage",
		metric.WithUnit("By"),
		metric.WithDescription("Bytes of the blocks a pool handed out that are not yet returned."))
	collect(err)
	r.poolRegistrations, err = m.Int64ObservableCounter("gdrpc.pool.registrations",
		metric.WithUnit("{registration}"),
		metric.WithDescription("Memory registrations a pool made."))
	collect(err)
	r.poolAllocations, err = m.Int64ObservableCounter("gdrpc.pool.allocations",
		metric.WithUnit("{allocation}"),
		metric.WithDescription("Allocations from a pool, by result: hit (a block of a registered region), miss (a new registered region), exhausted (refused)."))
	collect(err)
	r.poolWaits, err = m.Int64ObservableCounter("gdrpc.pool.waits",
		metric.WithUnit("{wait}"),
		metric.WithDescription("Allocations that waited for a region of their size class being made."))
	collect(err)
	r.poolRegionsFreed, err = m.Int64ObservableCounter("gdrpc.pool.region.freed",
		metric.WithUnit("{region}"),
		metric.WithDescription("Regions a pool freed while open: idle too long, or room for another size class."))
	collect(err)

	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("gdrotel: create instruments: %w", err)
	}
	return r, nil
}

// measureOpts record one attribute set; they are made once per set so that
// recording allocates nothing.
type measureOpts struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

func newMeasureOpts(kv ...attribute.KeyValue) *measureOpts {
	set := metric.WithAttributeSet(attribute.NewSet(kv...))
	return &measureOpts{add: []metric.AddOption{set}, record: []metric.RecordOption{set}}
}

// optsCache holds the measureOpts of each key, made from attrs on the key's
// first use. Its keys come from bounded sets (paths, memory kinds, error
// classes, admitted reasons), so it stays small.
type optsCache[K comparable] struct {
	attrs func(K) []attribute.KeyValue

	mu    sync.RWMutex
	byKey map[K]*measureOpts
}

func newOptsCache[K comparable](attrs func(K) []attribute.KeyValue) optsCache[K] {
	return optsCache[K]{attrs: attrs, byKey: make(map[K]*measureOpts)}
}

// lookup returns k's measureOpts if they were made.
func (c *optsCache[K]) lookup(k K) (*measureOpts, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	o, ok := c.byKey[k]
	return o, ok
}

// get returns k's measureOpts, made now if they were not.
func (c *optsCache[K]) get(k K) *measureOpts {
	if o, ok := c.lookup(k); ok {
		return o
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if o, ok := c.byKey[k]; ok {
		return o
	}
	o := newMeasureOpts(c.attrs(k)...)
	c.byKey[k] = o
	return o
}

// off reports whether r was not made by New (nil, or the zero Recorder): it
// then has no instruments, and records nothing.
func (r *Recorder) off() bool { return r == nil || r.meter == nil }

// maxReasonLen bounds the length of a reason attribute, in bytes.
const maxReasonLen = 64

// reasonClass is the fixed part of a fallback reason: the text before its
// first colon, at most maxReasonLen bytes. gdrpc's reasons read
// "register destination: <the error>", so the class drops the error's text,
// which names addresses, sizes and tokens.
func reasonClass(reason string) string {
	if i := strings.IndexByte(reason, ':'); i >= 0 {
		reason = reason[:i]
	}
	// An exporter refuses a string that is not UTF-8 (OTLP's protobuf):
	// one such reason would fail every export.
	reason = strings.ToValidUTF8(strings.TrimSpace(reason), "\uFFFD")
	if len(reason) > maxReasonLen {
		n := maxReasonLen
		for n > 0 && !utf8.RuneStart(reason[n]) {
			n--
		}
		reason = reason[:n]
	}
	if reason == "" {
		return otherValue
	}
	return reason
}

// reasonSet admits the first max distinct reason classes of one counter;
// the others record as otherValue, so that a reason carrying variable text
// cannot grow the counter's attribute sets without bound.
type reasonSet struct {
	max int

	mu   sync.Mutex
	seen map[string]struct{}
}

func newReasonSet(max int) reasonSet {
	return reasonSet{max: max, seen: make(map[string]struct{})}
}

// admit returns class if it is, or now becomes, one of the kept classes, and
// otherValue if the set is full.
func (s *reasonSet) admit(class string) string {
	if class == otherValue {
		return class // no reason to keep apart: it takes no slot
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.seen[class]; ok {
		return class
	}
	if len(s.seen) >= s.max {
		return otherValue
	}
	class = strings.Clone(class) // class may point into a longer reason
	s.seen[class] = struct{}{}
	return class
}
