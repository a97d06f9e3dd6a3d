//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"io"
	"testing"

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
func TestQuietWorkerAccepts(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		w := newWorker(t, c)
		client, server := samePair(t, w)
		require.True(t, w.Quiet())

		remote, accepted, err := connect(testCtx(t), c.Worker(), w)
		require.NoError(t, err)
		defer remote.Close()
		defer accepted.Close()
		msg := pattern(1000, 7)
		_, err = remote.Write(msg)
		require.NoError(t, err)
		got := make([]byte, len(msg))
		_, err = io.ReadFull(accepted, got)
		require.NoError(t, err)
		require.True(t, bytes.Equal(msg, got))

		// the idle pair still works
		_, err = client.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(server, got)
		require.NoError(t, err)
		require.True(t, bytes.Equal(msg, got))
	})
}
