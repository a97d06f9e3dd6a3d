//go:build cgo && !nordma

package rdma_test

import (
	"encoding/binary"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// A burst that the reader takes late grows the endpoint's inbound ring; once
// it is read and the endpoint idled for a while (ringLinger), the ring goes
// back to its first size, and later data still arrives whole.
func TestInboundRingShrinksWhenIdle(t *testing.T) {
	c := newContext(t, "tcp")
	client, server := pair(t, c)
	burst := make([]byte, 1<<20)
	for i := 0; i < len(burst); i += 4 {
		binary.BigEndian.PutUint32(burst[i:], uint32(i)) // no two words alike: an offset error shows
	}
	written := make(chan error, 1)
	go func() {
		_, err := client.Write(burst)
		written <- err
	}()
	require.Eventually(t, func() bool { return server.RingLen() > rdma.RingInitial }, 10*time.Second, time.Millisecond,
		"the unread burst never grew the ring")
	got := make([]byte, len(burst))
	_, err := io.ReadFull(server, got)
	require.NoError(t, err)
	require.Equal(t, burst, got)
	require.NoError(t, <-written)
	require.Eventually(t, func() bool { return server.RingLen() <= rdma.RingInitial }, 10*time.Second, time.Millisecond,
		"the ring kept %d bytes after the endpoint went idle", server.RingLen())

	msg := []byte("after the burst")
	_, err = client.Write(msg)
	require.NoError(t, err)
	got = make([]byte, len(msg))
	_, err = io.ReadFull(server, got)
	require.NoError(t, err)
	require.Equal(t, msg, got)
}
