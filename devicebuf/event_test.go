package devicebuf_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// TestIPCEventArrival is the contract of a buffer whose bytes arrive after it is handed
// out: a sender copies on a stream of its own and records an event the receiver made;
// the receiver's buffer is Pending, nothing has landed yet (the fake runs queued copies
// only when something waits for them or looks at their event), and the bytes are in
// place after Wait, after a stream's WaitOn, and for Copy, which waits itself.
func TestIPCEventArrival(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	n := 1 << 16
	src := cudaKind(0).alloc(t, n)
	want := pattern(11, n)
	require.NoError(t, g.Poke(src.Ptr(), want))
	recvEvent, h, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	sendEvent, err := devicebuf.OpenIPCEvent(h, 0)
	require.NoError(t, err)
	sender, err := devicebuf.NewCopyStream(0)
	require.NoError(t, err)

	// send copies src into fresh device memory on the sender's stream, records the
	// receiver's event, and returns the receiver's Pending buffer of that memory; both go
	// when t ends.
	send := func(t *testing.T) (b, dst *devicebuf.Buffer) {
		dst = cudaKind(0).alloc(t, n)
		require.NoError(t, devicebuf.CopyAsync(sender, dst, src))
		require.NoError(t, sender.Record(sendEvent))
		b = devicebuf.WrapArriving(dst.Ptr(), n, 0, nil, recvEvent, 0)
		t.Cleanup(func() {
			require.NoError(t, b.Release())
			require.NoError(t, dst.Release())
		})
		require.True(t, b.Pending())
		early, err := g.Peek(dst.Ptr(), n)
		require.NoError(t, err)
		require.Equal(t, make([]byte, n), early, "bytes landed before anything waited")
		return b, dst
	}
	host := hostKinds()[0].alloc(t, n)
	hb, _ := host.HostBytes()
	// readOn copies b back to the host on s after b.WaitOn(s).
	readOn := func(t *testing.T, s *devicebuf.Stream, b *devicebuf.Buffer) []byte {
		require.NoError(t, b.WaitOn(s))
		require.True(t, b.Pending(), "WaitOn does not wait on the host")
		clear(hb)
		require.NoError(t, devicebuf.CopyAsync(s, host, b))
		require.NoError(t, s.Synchronize())
		return hb
	}

	t.Run("Copy waits", func(t *testing.T) {
		b, _ := send(t)
		clear(hb)
		require.NoError(t, devicebuf.Copy(host, b))
		requireBytes(t, want, hb, "Copy of a pending buffer")
		require.False(t, b.Pending())
	})
	t.Run("Wait", func(t *testing.T) {
		b, dst := send(t)
		require.NoError(t, b.Wait())
		require.False(t, b.Pending())
		got, err := g.Peek(dst.Ptr(), n)
		require.NoError(t, err)
		requireBytes(t, want, got, "after Wait")
	})
	t.Run("WaitOn", func(t *testing.T) {
		b, _ := send(t)
		done, err := recvEvent.Query()
		require.NoError(t, err)
		require.False(t, done, "the copy is still queued")
		s, err := devicebuf.NewStream(0)
		require.NoError(t, err)
		requireBytes(t, want, readOn(t, s, b), "a copy queued after WaitOn")
		require.NoError(t, s.Close())
	})
	t.Run("WaitOn after arrival", func(t *testing.T) {
		b, _ := send(t)
		require.NoError(t, sender.Synchronize()) // the fake runs the copy
		done, err := recvEvent.Query()
		require.NoError(t, err)
		require.True(t, done)
		s, err := devicebuf.NewStream(0)
		require.NoError(t, err)
		require.NoError(t, b.WaitOn(s))
		require.False(t, b.Pending(), "bytes in place: nothing left to wait for")
		clear(hb)
		require.NoError(t, devicebuf.CopyAsync(s, host, b))
		require.NoError(t, s.Synchronize())
		requireBytes(t, want, hb, "a copy after WaitOn of an arrived buffer")
		require.NoError(t, s.Close())
	})
	t.Run("WaitOn an adopted stream", func(t *testing.T) {
		b, _ := send(t)
		const appStream = 0x7777000 // the application's own stream, made outside devicebuf
		s, err := devicebuf.AdoptStream(0, appStream)
		require.NoError(t, err)
		require.Equal(t, uintptr(appStream), s.Handle())
		_, err = devicebuf.AdoptStream(0, appStream)
		require.Error(t, err, "adopted twice")
		requireBytes(t, want, readOn(t, s, b), "a copy queued on the application's stream after WaitOn")
		require.NoError(t, s.Close()) // lets go of the stream, does not destroy it
		s2, err := devicebuf.AdoptStream(0, appStream)
		require.NoError(t, err, "adoptable again once let go")
		require.NoError(t, s2.Close())
	})

	require.NoError(t, sender.Close())
	require.NoError(t, sendEvent.Close())
	require.NoError(t, recvEvent.Close())
	require.NoError(t, recvEvent.Close(), "Close is idempotent")
	require.ErrorIs(t, recvEvent.Synchronize(), errClosed)
	_, err = recvEvent.Query()
	require.ErrorIs(t, err, errClosed)
	require.NoError(t, host.Release())
	require.NoError(t, src.Release())
	requireLive(t, base)
}

// TestIPCEventErrors: handles that name nothing are refused, and a stream takes no event
// after it closed.
func TestIPCEventErrors(t *testing.T) {
	devicebuftest.Install(t, 1)
	base := devicebuf.Live()
	_, err := devicebuf.OpenIPCEvent(devicebuf.IPCEventHandle{}, 0)
	require.Error(t, err)
	_, _, err = devicebuf.NewIPCEvent(3)
	require.Error(t, err)
	ev, h, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	s, err := devicebuf.NewCopyStream(0)
	require.NoError(t, err)
	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Record(ev), errClosed)
	require.NoError(t, ev.Close())
	_, err = devicebuf.OpenIPCEvent(h, 0)
	require.Error(t, err, "the event was destroyed")
	requireLive(t, base)
}

// TestEventAwait: Await returns once the work before the event is complete,
// not while a synchronization still runs it, and gives up with ctx's error
// when that work does not end.
func TestEventAwait(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	n := 1 << 16
	src, dst := cudaKind(0).alloc(t, n), cudaKind(0).alloc(t, n)
	defer src.Release()
	defer dst.Release()
	want := pattern(12, n)
	require.NoError(t, g.Poke(src.Ptr(), want))
	ev, _, err := devicebuf.NewIPCEvent(0)
	require.NoError(t, err)
	defer ev.Close()
	st, err := devicebuf.NewCopyStream(0)
	require.NoError(t, err)
	defer st.Close()

	unhang, err := g.Hang(st.Handle())
	require.NoError(t, err)
	defer unhang()
	require.NoError(t, devicebuf.CopyAsync(st, dst, src))
	require.NoError(t, st.Record(ev))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, ev.Await(ctx), context.DeadlineExceeded, "the work before the event does not end")

	// A synchronization under way, held by the hung work, has not run the copy yet.
	synced := make(chan error, 1)
	go func() { synced <- st.Synchronize() }()
	ctx, cancel = context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, ev.Await(ctx), context.DeadlineExceeded, "complete while its copy waits")
	unhang()
	require.NoError(t, ev.Await(context.Background()))
	got, err := g.Peek(dst.Ptr(), n)
	require.NoError(t, err)
	require.Equal(t, want, got, "the copy before the event")
	require.NoError(t, <-synced)
}

// TestSynchronizeBy: SynchronizeBy returns once the copies queued before it
// are complete, their bytes in place and their buffers let go of; work that
// does not end holds it up; on a closed event it still waits for the stream,
// and a closed stream refuses it.
func TestSynchronizeBy(t *testing.T) {
	g := devicebuftest.Install(t, 1)
	n := 1<<16 + 5
	st, err := devicebuf.NewCopyStream(0)
	require.NoError(t, err)
	defer st.Close()
	ev, err := devicebuf.NewEvent(0)
	require.NoError(t, err)
	defer ev.Close()
	before := g.Allocations()
	// queue copies a fresh pattern into dst and lets go of its source: the
	// stream holds it until a synchronization lets go of it.
	queue := func(dst *devicebuf.Buffer, seed uint64) []byte {
		src := cudaKind(0).alloc(t, n)
		want := pattern(seed, n)
		require.NoError(t, g.Poke(src.Ptr(), want))
		require.NoError(t, devicebuf.CopyAsync(st, dst, src))
		require.NoError(t, src.Release())
		return want
	}
	requireBytes := func(dst *devicebuf.Buffer, want []byte) {
		got, err := g.Peek(dst.Ptr(), n)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	dst := cudaKind(0).alloc(t, n)
	defer dst.Release()

	want := queue(dst, 3)
	require.NoError(t, st.SynchronizeBy(ev))
	requireBytes(dst, want)
	require.Equal(t, before+1, g.Allocations(), "the source let go of, dst left")

	unhang, err := g.Hang(st.Handle())
	require.NoError(t, err)
	defer unhang()
	want = queue(dst, 4)
	probe, err := devicebuf.NewEvent(0)
	require.NoError(t, err)
	defer probe.Close()
	require.NoError(t, st.Record(probe))
	synced := make(chan error, 1)
	go func() { synced <- st.SynchronizeBy(ev) }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, probe.Await(ctx), context.DeadlineExceeded, "the hung work holds the copy")
	select {
	case err := <-synced:
		t.Fatalf("SynchronizeBy returned (%v) before the hung work ended", err)
	default:
	}
	require.Equal(t, before+2, g.Allocations(), "the source held while its copy waits")
	unhang()
	require.NoError(t, <-synced)
	requireBytes(dst, want)
	require.Equal(t, before+1, g.Allocations())

	// A closed event tells nothing: the stream itself is waited for.
	closed, err := devicebuf.NewEvent(0)
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	want = queue(dst, 5)
	require.ErrorIs(t, st.SynchronizeBy(closed), net.ErrClosed)
	requireBytes(dst, want)
	require.Equal(t, before+1, g.Allocations())

	require.NoError(t, st.Close())
	require.ErrorIs(t, st.SynchronizeBy(ev), net.ErrClosed)
}
