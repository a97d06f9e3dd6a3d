package gdrotel

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/gdrpc/gdrpc/devicebuf"
)

// Attribute keys of the pool instruments.
const (
	keyPool   attribute.Key = "pool"   // the name given to ObservePool
	keyResult attribute.Key = "result" // of gdrpc.pool.allocations: "hit", "miss" or "exhausted"
)

// Pool is what ObservePool reads: a *devicebuf.Pool (gdrpc.HostMemory
// returns the one received payloads and staging buffers come from), or
// anything else that counts the same way.
type Pool interface {
	Stats() devicebuf.PoolStats
}

// ObservePool reports p's counters, read at each collection, under the
// attribute pool=name: gdrpc.pool.region.count and .usage, gdrpc.pool.buffer.count
// and .usage, gdrpc.pool.registrations, gdrpc.pool.allocations (result=hit: a
// block of a registered region, the registration cache's hits; miss: a new
// registered region; exhausted: refused), gdrpc.pool.waits and
// gdrpc.pool.region.freed.
//
// Each name is observed by one pool at a time. unregister stops the
// observation and frees the name; calls after the first return nil.
func (r *Recorder) ObservePool(name string, p Pool) (unregister func() error, err error) {
	if name == "" || p == nil || reflect.ValueOf(p).Kind() == reflect.Pointer && reflect.ValueOf(p).IsNil() {
		// A nil *devicebuf.Pool in p would fail in the collector's
		// goroutine, far from here, and take the process down.
		return nil, errors.New("gdrotel: observe pool: a name and a pool are required")
	}
	if r.off() {
		return nil, errors.New("gdrotel: observe pool: the Recorder was not made by New")
	}
	r.poolsMu.Lock()
	defer r.poolsMu.Unlock()
	if _, ok := r.pools[name]; ok {
		return nil, fmt.Errorf("gdrotel: observe pool: pool %q is already observed", name)
	}

	set := metric.WithAttributeSet(attribute.NewSet(keyPool.String(name)))
	allocation := func(result string) metric.ObserveOption {
		return metric.WithAttributeSet(attribute.NewSet(keyPool.String(name), keyResult.String(result)))
	}
	hit, miss, exhausted := allocation("hit"), allocation("miss"), allocation("exhausted")
	observe := func(_ context.Context, o metric.Observer) error {
		s := p.Stats()
		o.ObserveInt64(r.poolRegionCount, int64(s.Regions), set)
		o.ObserveInt64(r.poolRegionUsage, s.RegionBytes, set)
		o.ObserveInt64(r.poolBufferCount, int64(s.InUse), set)
		o.ObserveInt64(r.poolBufferUsage, s.BytesInUse, set)
		o.ObserveInt64(r.poolRegistrations, s.Registrations, set)
		o.ObserveInt64(r.poolAllocations, s.Hits, hit)
		o.ObserveInt64(r.poolAllocations, s.Misses, miss)
		o.ObserveInt64(r.poolAllocations, s.Exhausted, exhausted)
		o.ObserveInt64(r.poolWaits, s.Waits, set)
		o.ObserveInt64(r.poolRegionsFreed, s.Freed, set)
		return nil
	}
	reg, err := r.meter.RegisterCallback(observe,
		r.poolRegionCount, r.poolRegionUsage, r.poolBufferCount, r.poolBufferUsage,
		r.poolRegistrations, r.poolAllocations, r.poolWaits, r.poolRegionsFreed)
	if err != nil {
		return nil, fmt.Errorf("gdrotel: observe pool %q: %w", name, err)
	}
	r.pools[name] = struct{}{}

	var once sync.Once
	return func() error {
		var err error
		once.Do(func() {
			err = reg.Unregister()
			r.poolsMu.Lock()
			delete(r.pools, name)
			r.poolsMu.Unlock()
		})
		return err
	}, nil
}
