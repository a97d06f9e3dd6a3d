//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// Both ends of a connection on one worker pair up, and the worker goes quiet;
// ends on two workers do not. Closing one end of a pair leaves the other
// unpaired, and the worker no longer quiet.
func TestPairing(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		w := newWorker(t, c)
		require.False(t, w.Quiet(), "a worker without endpoints parks on its event fd")

		client, server := samePair(t, w)
		require.True(t, client.Paired())
		require.True(t, server.Paired())
		require.True(t, w.Quiet())

		other, otherServer := pair(t, c)
		require.False(t, other.Paired())
		require.False(t, otherServer.Paired())

		require.NoError(t, client.Close())
		require.False(t, server.Paired())
		require.False(t, w.Quiet())
		require.NoError(t, server.Close())
	})
}

// A quiet worker still serves what only its driver sees: a connection request
// from another worker while a pair on it is idle, and that connection's bytes.
// Once that connection and a failed dial are gone, the worker is quiet again.
func TestQuietWorkerAccepts(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		w := newWorker(t, c)
		client, server := samePair(t, w)
		require.True(t, w.Quiet())
		msg := pattern(1000, 7)
		exchange(t, client, server, msg) // the idle, quiet pair works

		remote, accepted, err := connect(testCtx(t), c.Worker(), w)
		require.NoError(t, err)
		require.False(t, w.Quiet())
		exchange(t, remote, accepted, msg)
		require.NoError(t, remote.Close())
		require.NoError(t, accepted.Close())
		require.True(t, w.Quiet())

		ctx, cancel := context.WithTimeout(testCtx(t), 10*time.Second)
		defer cancel()
		_, err = w.Dial(ctx, "127.0.0.1:1") // nobody listens
		require.Error(t, err)
		require.True(t, w.Quiet())
		exchange(t, client, server, msg)
	})
}

// A resting driver is woken whenever the worker stops being quiet: with its
// tick an hour long, writes that leave requests in flight, flushes, puts and a
// graceful close must complete through the wake-ups alone (the close within
// its linger time: the FIN-ACK must not wait for the driver).
func TestQuietWorkerWakes(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		w := newWorker(t, c)
		client, server := samePair(t, w)
		w.SetQuietTick(time.Hour)
		// Before the endpoints close: a lost wake-up fails the test, not
		// its cleanup.
		t.Cleanup(func() { w.SetQuietTick(time.Millisecond) })
		resting := func() {
			t.Helper()
			deadline := time.Now().Add(10 * time.Second)
			for !restsWithin(w, time.Second) {
				require.True(t, time.Now().Before(deadline), "the driver rests")
				// A driver that found no work for quietIdle parks instead
				// of resting, as it may when a loaded machine runs it late
				// after the last work: a byte each way is new work, after
				// which a quiet worker's driver rests.
				exchange(t, client, server, []byte{1})
			}
		}
		resting()

		// 8 MiB pinned writes (requests in flight), in both directions.
		exchange(t, client, server, pattern(8<<20, 0))
		resting()
		exchange(t, server, client, pattern(8<<20, 1))
		resting()

		ctx, cancel := context.WithTimeout(testCtx(t), 10*time.Second)
		defer cancel()
		dst, _, rk := exposed(t, c, client, 1<<20)
		want := pattern(1<<20, 9)
		require.NoError(t, client.PutBytes(ctx, want, uint64(dst.Addr()), rk))
		require.NoError(t, client.Flush(ctx))
		require.True(t, bytes.Equal(want, dst.Bytes()))
		resting()

		start := time.Now()
		require.NoError(t, client.Close())
		// Under the linger time (2 s), with room for a loaded machine.
		require.Less(t, time.Since(start), 1900*time.Millisecond, "Close waited for its linger time")
		_, err := server.Read(make([]byte, 1))
		require.ErrorIs(t, err, io.EOF)
	})
}

// exchange writes msg on a and reads it whole on b, both under a deadline.
// The write runs in its own goroutine: one above the copied-write limit waits
// for the reader.
func exchange(t *testing.T, a, b *rdma.Endpoint, msg []byte) {
	t.Helper()
	dl := time.Now().Add(10 * time.Second)
	require.NoError(t, a.SetWriteDeadline(dl))
	require.NoError(t, b.SetReadDeadline(dl))
	errc := make(chan error, 1)
	go func() {
		_, err := a.Write(msg)
		errc <- err
	}()
	got := make([]byte, len(msg))
	_, err := io.ReadFull(b, got)
	require.NoError(t, err)
	require.NoError(t, <-errc)
	require.True(t, bytes.Equal(msg, got))
	require.NoError(t, a.SetWriteDeadline(time.Time{}))
	require.NoError(t, b.SetReadDeadline(time.Time{}))
}

// restsWithin reports whether w's driver rests within d (polled).
func restsWithin(w *rdma.Worker, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !w.Resting() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond) // polling an observable, bounded
	}
	return true
}
