package devicebuf

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf/internal/driver"
)

// IPCEventHandle is a CUDA IPC event handle (cudaIpcEventHandle_t): it names an
// interprocess event to another process on the same host.
type IPCEventHandle [driver.IPCHandleSize]byte

// Event marks a point in the work of a CUDA stream: once the work queued before it was
// recorded (Stream.Record) is complete, so is the event. An interprocess event may be
// recorded by one process and waited for by another. Safe for concurrent use.
type Event struct {
	d driver.Driver
	e driver.Event

	mu     sync.RWMutex // held for reading by calls on e, for writing by Close
	closed bool
}

// NewEvent makes an event on CUDA device dev, for this process alone.
func NewEvent(dev int) (*Event, error) { return newEvent(dev, false) }

// NewIPCEvent makes an interprocess event on CUDA device dev and returns it with its handle,
// which another process opens with OpenIPCEvent.
func NewIPCEvent(dev int) (*Event, IPCEventHandle, error) {
	ev, err := newEvent(dev, true)
	if err != nil {
		return nil, IPCEventHandle{}, err
	}
	h, err := ev.d.IpcGetEventHandle(ev.e)
	if err != nil {
		_ = ev.Close()
		return nil, IPCEventHandle{}, fmt.Errorf("devicebuf: cuIpcGetEventHandle: %w", err)
	}
	return ev, h, nil
}

func newEvent(dev int, interprocess bool) (*Event, error) {
	d, err := checkDevice(dev)
	if err != nil {
		return nil, err
	}
	e, err := d.EventCreate(dev, interprocess)
	if err != nil {
		return nil, fmt.Errorf("devicebuf: cuEventCreate on device %d: %w", dev, err)
	}
	live.events.Add(1)
	return &Event{d: d, e: e}, nil
}

// OpenIPCEvent opens another process's interprocess event on CUDA device dev.
func OpenIPCEvent(h IPCEventHandle, dev int) (*Event, error) {
	d, err := checkDevice(dev)
	if err != nil {
		return nil, err
	}
	e, err := d.IpcOpenEventHandle(dev, h)
	if err != nil {
		return nil, fmt.Errorf("devicebuf: cuIpcOpenEventHandle on device %d: %w", dev, err)
	}
	live.events.Add(1)
	return &Event{d: d, e: e}, nil
}

// Synchronize waits until the work the event last captured is complete; an event never
// recorded is complete.
func (e *Event) Synchronize() error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return fmt.Errorf("devicebuf: event: %w", net.ErrClosed)
	}
	if err := e.d.EventSynchronize(e.e); err != nil {
		return fmt.Errorf("devicebuf: cuEventSynchronize: %w", err)
	}
	return nil
}

// Query reports whether the work the event last captured is complete, without waiting.
func (e *Event) Query() (bool, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return false, fmt.Errorf("devicebuf: event: %w", net.ErrClosed)
	}
	done, err := e.d.EventQuery(e.e)
	if err != nil {
		return false, fmt.Errorf("devicebuf: cuEventQuery: %w", err)
	}
	return done, nil
}

// How Await polls: on its thread for awaitBusy, as cuEventSynchronize spins
// (work a call waits for is usually microseconds from its end); then
// yielding the processor between polls until awaitSpin (longer than a device
// copy of several gigabytes takes); then in sleeps growing from awaitSleep
// to awaitSleepMax.
const (
	awaitBusy     = 200 * time.Microsecond
	awaitSpin     = 5 * time.Millisecond
	awaitSleep    = 50 * time.Microsecond
	awaitSleepMax = time.Millisecond
)

// Await is Synchronize bounded by ctx: it returns once the work the event last
// captured is complete, or an error wrapping ctx's once ctx ends first. An
// interprocess event recorded by another process completes only if that
// process's work does: a wait for one must stay bounded. It polls the event
// (Query), yielding the processor between polls.
func (e *Event) Await(ctx context.Context) error {
	var start time.Time
	var timer *time.Timer
	pause := awaitSleep
	for {
		done, err := e.Query()
		if done || err != nil {
			return err
		}
		if start.IsZero() {
			start = time.Now()
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("devicebuf: the work before the event is not complete: %w", err)
		}
		if waited := time.Since(start); waited < awaitSpin {
			if waited >= awaitBusy {
				runtime.Gosched()
			}
			continue
		}
		if timer == nil {
			timer = time.NewTimer(pause)
			defer timer.Stop()
		} else {
			timer.Reset(pause)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
		}
		pause = min(2*pause, awaitSleepMax)
	}
}

// Close destroys the event. It is idempotent.
func (e *Event) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	live.events.Add(-1)
	if err := e.d.EventDestroy(e.e); err != nil {
		return fmt.Errorf("devicebuf: cuEventDestroy: %w", err)
	}
	return nil
}

// Record captures in e the copies queued on s so far: e completes when they do. The buffers
// of those copies stay retained until a later Synchronize of s.
func (s *Stream) Record(e *Event) error { return s.withEvent(e, "cuEventRecord", s.record) }

// record is Record's driver call.
func (s *Stream) record(st driver.Stream, ev driver.Event) error { return s.d.EventRecord(ev, st) }

// Wait orders the copies queued on s after this call behind the work e captured, without
// blocking the caller.
func (s *Stream) Wait(e *Event) error {
	return s.withEvent(e, "cuStreamWaitEvent", func(st driver.Stream, ev driver.Event) error { return s.d.StreamWaitEvent(st, ev) })
}

func (s *Stream) withEvent(e *Event, op string, call func(driver.Stream, driver.Event) error) error {
	if e == nil {
		return fmt.Errorf("devicebuf: %s with a nil event", op)
	}
	if s.d == nil {
		return fmt.Errorf("devicebuf: %s on a host-only stream", op)
	}
	s.life.RLock()
	defer s.life.RUnlock()
	if s.isClosed() {
		return fmt.Errorf("devicebuf: stream: %w", net.ErrClosed)
	}
	return s.callWithEvent(e, op, call)
}

// callWithEvent is withEvent for a caller that holds s.life and checked s.
func (s *Stream) callWithEvent(e *Event, op string, call func(driver.Stream, driver.Event) error) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return fmt.Errorf("devicebuf: event: %w", net.ErrClosed)
	}
	if err := call(s.s, e.e); err != nil {
		return fmt.Errorf("devicebuf: %s: %w", op, err)
	}
	return nil
}

// How SynchronizeBy polls its event: in sleeps growing from settleSleep to
// settleSleepMax.
const (
	settleSleep    = 20 * time.Microsecond
	settleSleepMax = time.Millisecond
)

// SynchronizeBy is Synchronize for a caller that is in no hurry: it records ev
// on s and looks whether ev completed between sleeps, instead of waiting in
// cuStreamSynchronize, which spins on the device's progress and slows every
// other thread's copies queued on s meanwhile. ev is the caller's, used by
// one SynchronizeBy at a time and recorded by nothing else meanwhile: a
// record elsewhere would complete it early, and the copies still queued on s
// would lose their buffers' references.
func (s *Stream) SynchronizeBy(ev *Event) error {
	if ev == nil {
		return fmt.Errorf("devicebuf: stream synchronization by a nil event")
	}
	if s.d == nil {
		return s.Synchronize()
	}
	s.life.RLock()
	defer s.life.RUnlock()
	done, err := s.takePending() // the record below comes after all of them
	if err != nil {
		return err
	}
	if err := s.settle(ev); err != nil {
		// The event tells nothing: wait for the stream itself.
		return errors.Join(err, s.sync(done))
	}
	letGo(done)
	return nil
}

// settle records ev on s (life held, s checked) and returns once ev
// completed.
func (s *Stream) settle(ev *Event) error {
	if err := s.callWithEvent(ev, "cuEventRecord", s.record); err != nil {
		return err
	}
	for pause := settleSleep; ; pause = min(2*pause, settleSleepMax) {
		if done, err := ev.Query(); done || err != nil {
			return err
		}
		time.Sleep(pause)
	}
}

// WrapArriving is Wrap for CUDA memory whose bytes are still arriving: they are in place once
// arrival completes. The Buffer reports Pending until a wait; Copy and CopyAsync wait for it
// themselves, and code that reads the memory any other way (kernels of the application)
// must Wait, Await or WaitOn first. A wait gives up with an error wrapping ErrNotArrived once
// it took within (0: no bound; the error wraps context.DeadlineExceeded too): arrival may be
// another process's event, recorded behind work that never ends. arrival must outlive the
// Buffer.
func WrapArriving(ptr uintptr, n int, device int, release func(), arrival *Event, within time.Duration) *Buffer {
	b := Wrap(ptr, n, CUDA, device, release)
	if arrival != nil {
		b.a.within = within
		b.a.arrival.Store(arrival)
	}
	return b
}

// ErrNotArrived: a Pending buffer's bytes did not arrive within the bound WrapArriving gave.
var ErrNotArrived = errors.New("devicebuf: the buffer's bytes did not arrive in time")

// Pending reports whether the buffer's bytes may still be arriving (WrapArriving): nothing
// may read them before Wait or, on a stream, before work queued after WaitOn.
func (b *Buffer) Pending() bool { return b.a.arrival.Load() != nil }

// Wait returns once the buffer's bytes are in place (at once for a buffer that is not
// Pending), or with an error wrapping ErrNotArrived once WrapArriving's bound passed.
func (b *Buffer) Wait() error { return b.Await(context.Background()) }

// Await is Wait bounded by ctx too: it returns an error wrapping ctx's once ctx ends first.
func (b *Buffer) Await(ctx context.Context) error {
	ev := b.a.arrival.Load()
	if ev == nil {
		return nil
	}
	done, err := ev.Query() // arrived already: no wait, no timer
	if err != nil {
		return err
	}
	if !done {
		if err := b.awaitArrival(ctx, ev); err != nil {
			return err
		}
	}
	b.a.arrival.CompareAndSwap(ev, nil)
	return nil
}

// awaitArrival waits for ev, the arrival of b's bytes, within ctx and b's bound.
func (b *Buffer) awaitArrival(ctx context.Context, ev *Event) error {
	if b.a.within <= 0 && ctx.Done() == nil {
		return ev.Synchronize()
	}
	if b.a.within > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, b.a.within, fmt.Errorf("%w within %v: %w", ErrNotArrived, b.a.within, context.DeadlineExceeded))
		defer cancel()
	}
	if err := ev.Await(ctx); err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, ErrNotArrived) {
			return cause
		}
		return err
	}
	return nil
}

// WaitOn orders the work queued on s after this call behind the buffer's arrival, without
// blocking the caller: kernels of the application on s then read the arrived bytes. A
// buffer that is not Pending, or whose bytes are in place already, needs nothing: the
// buffer then stops being Pending, and s gets no wait (a wait on an event of another
// process can hold a stream up long after the event completed).
func (b *Buffer) WaitOn(s *Stream) error {
	ev := b.a.arrival.Load()
	if ev == nil {
		return nil
	}
	if s == nil {
		return fmt.Errorf("devicebuf: wait for %s on a nil stream", b)
	}
	if done, err := ev.Query(); err == nil && done {
		b.a.arrival.CompareAndSwap(ev, nil)
		return nil
	}
	return s.Wait(ev)
}
