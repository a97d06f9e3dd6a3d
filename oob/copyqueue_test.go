package oob

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/internal/leaktest"
)

// copyQueueRig is a copy queue on the fake GPU and a mapping (a
// destination) of ranges of rangeLen bytes, one per copy.
type copyQueueRig struct {
	t       *testing.T
	g       *devicebuftest.GPU
	gpu     devicebuf.Allocator
	mapping *devicebuf.Buffer
	q       *copyQueue
	closed  sync.Once
}

const rangeLen = 4096 + 3

func newCopyQueueRig(t *testing.T, ranges int) *copyQueueRig {
	g := devicebuftest.Install(t, 1)
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	mapping, err := gpu.Alloc(ranges * rangeLen)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, mapping.Release()) })
	q, err := newCopyQueue(0)
	require.NoError(t, err)
	r := &copyQueueRig{t: t, g: g, gpu: gpu, mapping: mapping, q: q}
	t.Cleanup(r.close) // before the fake's check of what is left
	return r
}

// close closes the queue, once, and checks that its goroutine ended. close
// returns once the goroutine is done with the queue; the goroutine itself
// may still be on its way out (its deferred Done ran), hence the bounded
// poll.
func (r *copyQueueRig) close() {
	r.closed.Do(func() {
		r.q.close()
		require.NoError(r.t, leaktest.Poll(5*time.Second, func() error {
			if g := leaktest.Goroutines("oob.(*copyQueue).reap"); len(g) > 0 {
				return fmt.Errorf("the queue's goroutine lives on: %v", g)
			}
			return nil
		}))
	})
}

func rangePattern(i int) []byte {
	b := make([]byte, rangeLen)
	for j := range b {
		b[j] = byte(i*31 + j*7 + 1)
	}
	return b
}

// copy queues a copy of a new source holding range i's pattern into range
// i, with an event after it, and lets go of the source: from then on only
// the queue holds it. It may run on any goroutine.
func (r *copyQueueRig) copy(i int) (*devicebuf.Event, error) {
	src, err := r.gpu.Alloc(rangeLen)
	if !assert.NoError(r.t, err) {
		return nil, err
	}
	defer func() { assert.NoError(r.t, src.Release()) }()
	assert.NoError(r.t, r.g.Poke(src.Ptr(), rangePattern(i)))
	ev, _, err := devicebuf.NewIPCEvent(0)
	if !assert.NoError(r.t, err) {
		return nil, err
	}
	err = r.q.copyInto(r.mapping, &rtr{IPCOffset: uint64(i * rangeLen), Length: rangeLen}, src, ev)
	return ev, err
}

// check waits for the copy into range i and compares its bytes.
func (r *copyQueueRig) check(i int, ev *devicebuf.Event) {
	assert.NoError(r.t, ev.Synchronize())
	got, err := r.g.Peek(r.mapping.Ptr()+uintptr(i*rangeLen), rangeLen)
	assert.NoError(r.t, err)
	assert.True(r.t, bytes.Equal(rangePattern(i), got), "range %d: copied bytes differ", i)
	assert.NoError(r.t, ev.Close())
}

// TestCopyQueue: copies queued from several goroutines at once land
// byte-exact, each in its range; the queue's goroutine lets go of their
// sources once they are complete, without waiting for a later copy or the
// close; a closed queue refuses copies.
func TestCopyQueue(t *testing.T) {
	const workers, each = 4, 8
	r := newCopyQueueRig(t, workers*each)
	before := r.g.Allocations()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for k := range each {
				i := w*each + k
				ev, err := r.copy(i)
				if assert.NoError(t, err) {
					r.check(i, ev)
				}
			}
		})
	}
	wg.Wait()

	// The fake runs a stream's copies when it is synchronized: the last
	// source is let go of only by the queue's goroutine.
	ev, err := r.copy(0)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return r.g.Allocations() == before }, 10*time.Second, 50*time.Microsecond,
		"the queue let go of the copy's source")
	r.check(0, ev)

	r.close()
	ev, err = r.copy(1)
	require.ErrorIs(t, err, net.ErrClosed, "a closed queue refuses copies")
	require.NoError(t, ev.Close())
	require.Equal(t, before, r.g.Allocations(), "a refused copy holds nothing")
}

// TestCopyQueueCloseWhileCopying: closing a queue while copies are being
// queued ends each of them (complete, or refused with net.ErrClosed) and
// the queue's goroutine; nothing hangs or stays held.
func TestCopyQueueCloseWhileCopying(t *testing.T) {
	const workers, each = 4, 50
	r := newCopyQueueRig(t, workers*each)
	before := r.g.Allocations()
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := range workers {
		wg.Go(func() {
			<-start
			for k := range each {
				i := w*each + k
				ev, err := r.copy(i)
				if err != nil {
					assert.ErrorIs(t, err, net.ErrClosed)
					if ev != nil {
						assert.NoError(t, ev.Close())
					}
					return
				}
				r.check(i, ev)
			}
		})
	}
	close(start)
	r.close()
	wg.Wait()
	require.Equal(t, before, r.g.Allocations(), "the closed queue holds no source")
}

// TestCopyQueueBackToBack: a copy queued while the queue's goroutine waits
// for the one before (held up here by work that does not end) is waited for
// in turn once that work ends, by the goroutine's polling wait, and both
// copies' sources are let go of.
func TestCopyQueueBackToBack(t *testing.T) {
	r := newCopyQueueRig(t, 3)
	before := r.g.Allocations()
	unhang, err := r.g.Hang(r.q.stream.Handle())
	require.NoError(t, err)
	defer unhang()
	first, err := r.copy(0)
	require.NoError(t, err)
	// The goroutine takes the first kick and waits behind the hung work;
	// once the kick channel is empty again, the next copy's kick is one that
	// came during that wait.
	require.Eventually(t, func() bool { return len(r.q.kick) == 0 }, 10*time.Second, 50*time.Microsecond)
	second, err := r.copy(1)
	require.NoError(t, err)
	require.Equal(t, before+2, r.g.Allocations(), "both sources held while the work before them hangs")
	unhang()
	require.Eventually(t, func() bool { return r.g.Allocations() == before }, 10*time.Second, 50*time.Microsecond,
		"the queue let go of both sources")
	r.check(0, first)
	r.check(1, second)
}

// neverArriving returns a buffer of rangeLen bytes whose arrival is another
// stream's event recorded behind work that never ends (until unhang), its
// waits bounded by within; the test's end unhangs the stream and closes it
// and the event.
func (r *copyQueueRig) neverArriving(within time.Duration) (src *devicebuf.Buffer, unhang func()) {
	t := r.t
	other, err := devicebuf.NewCopyStream(0)
	require.NoError(t, err)
	unhang, err = r.g.Hang(other.Handle())
	require.NoError(t, err)
	arrival, _, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	require.NoError(t, other.Record(arrival))
	t.Cleanup(func() {
		unhang()
		require.NoError(t, other.Close())
		require.NoError(t, arrival.Close())
	})
	mem, err := r.gpu.Alloc(rangeLen)
	require.NoError(t, err)
	return devicebuf.WrapArriving(mem.Ptr(), rangeLen, 0, func() { mem.Release() }, arrival, within), unhang
}

// A source whose bytes are still arriving (a payload received stream-ordered
// and sent on) is waited for within its bound before its copy is queued: the
// space's stream never waits on another process's event, so a copy of a
// source that never arrives fails, and neither the space's later copies nor
// its close wait for that source.
func TestCopyQueueSourceNeverArrives(t *testing.T) {
	r := newCopyQueueRig(t, 2)
	src, unhang := r.neverArriving(50 * time.Millisecond)
	ev, _, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	require.ErrorIs(t, r.q.copyInto(r.mapping, &rtr{IPCOffset: 0, Length: rangeLen}, src, ev), devicebuf.ErrNotArrived)
	require.NoError(t, src.Release())

	// The next copy, into the other range, goes through.
	want := rangePattern(1)
	next := devicebuf.HostFromBytes(want)
	defer next.Release()
	gsrc, err := r.gpu.Alloc(rangeLen)
	require.NoError(t, err)
	require.NoError(t, devicebuf.Copy(gsrc, next))
	require.NoError(t, r.q.copyInto(r.mapping, &rtr{IPCOffset: rangeLen, Length: rangeLen}, gsrc, ev))
	require.NoError(t, gsrc.Release())
	require.NoError(t, ev.Synchronize())
	got := make([]byte, rangeLen)
	view, err := r.mapping.Slice(rangeLen, rangeLen)
	require.NoError(t, err)
	hostGot := devicebuf.HostFromBytes(got)
	require.NoError(t, devicebuf.Copy(hostGot, view))
	require.NoError(t, hostGot.Release())
	require.NoError(t, view.Release())
	require.True(t, bytes.Equal(want, got), "the next copy's bytes")

	closed := make(chan struct{})
	go func() { r.close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Fatal("the queue's close waits for a source that never arrives")
	}
	unhang()
	require.NoError(t, ev.Close())
}

// A source sent on while still arriving is waited for once, within its
// bound or the call's context, whichever ends first, before anything is
// queued into the peer's space: not a second time by the copy that stands in
// when the queue refuses it.
func TestPeerSpaceCopyWaitsOnce(t *testing.T) {
	const bound = 200 * time.Millisecond
	r := newCopyQueueRig(t, 1)
	cs, _ := tcpPair(t)
	src, unhang := r.neverArriving(bound)
	ev, h, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	p := &peerSpace{id: 1, taken: map[uint64]*write{0: {n: rangeLen, gen: 1}}, eventOf: map[uint64]int{},
		mapping: r.mapping.Retain(), events: []devicebuf.IPCEventHandle{h}, opened: []*devicebuf.Event{ev},
		eventUses: []int{0}, copies: r.q}
	start := time.Now()
	_, err = p.copyInto(context.Background(), cs, &rtr{IPCOffset: 0, Length: rangeLen}, 0, 1, Source{Buffer: src})
	took := time.Since(start)
	require.ErrorIs(t, err, devicebuf.ErrNotArrived)
	require.Less(t, took, bound+bound/2, "the copy waited %v for a source bounded by %v", took, bound)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = p.copyInto(ctx, cs, &rtr{IPCOffset: 0, Length: rangeLen}, 0, 1, Source{Buffer: src})
	require.ErrorIs(t, err, context.Canceled, "the call's context")
	require.NoError(t, src.Release())
	p.mapping.Release()
	unhang()
	r.close()
	require.NoError(t, ev.Close())
}
