//go:build cgo && !nordma

package rdma_test

import (
	"bytes"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// A peer that writes to an endpoint nobody reads and then closes it has what
// it sent taken out of UCX into the endpoint's ring before the endpoint goes,
// up to DrainMax: a reader then gets those bytes and io.EOF, or, past
// DrainMax, the first DrainMax bytes and ErrUnreadCut, never an io.EOF that
// hides the bytes dropped. The ring stays within DrainMax however much the
// peer sent.
func TestPeerCloseDrainBounded(t *testing.T) {
	for _, tls := range []string{"tcp", "posix,sysv,cma,tcp"} {
		for _, tc := range []struct {
			name string
			n    int
		}{{"within", 2 * rdma.RingInitial << 8}, {"exactly", rdma.DrainMax}, {"past", rdma.DrainMax + 32<<20}} {
			t.Run(tls+"/"+tc.name, func(t *testing.T) {
				c := newContext(t, tls)
				client, server := pair(t, c)
				sent := make([]byte, tc.n)
				for i := range sent {
					sent[i] = byte(i % 251)
				}
				require.NoError(t, client.SetWriteDeadline(time.Now().Add(time.Minute)))
				for off := 0; off < len(sent); off += 1 << 20 {
					_, err := client.Write(sent[off:min(off+1<<20, len(sent))])
					require.NoError(t, err)
				}
				require.NoError(t, client.Close())
				select {
				case <-server.Done():
				case <-time.After(time.Minute):
					t.Fatal("the peer's close never arrived")
				}
				require.LessOrEqual(t, server.RingLen(), rdma.DrainMax)
				require.NoError(t, server.SetReadDeadline(time.Now().Add(time.Minute)))
				got, err := io.ReadAll(server)
				if tc.n <= rdma.DrainMax {
					require.NoError(t, err) // io.EOF
					require.True(t, bytes.Equal(sent, got), "read %d bytes of %d, or other bytes", len(got), len(sent))
					return
				}
				require.ErrorIs(t, err, rdma.ErrUnreadCut)
				require.Equal(t, rdma.DrainMax, len(got), "bytes read before the error")
				require.True(t, bytes.Equal(sent[:len(got)], got), "the bytes read are not the first ones sent")
			})
		}
	}
}

// TestNoDataAfterFIN: a peer that announced its close (FIN) and goes on
// sending gets none of it read: the reads end at the FIN with io.EOF, as a
// net.Conn's must, and what follows is not kept.
func TestNoDataAfterFIN(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			c := newContext(t, tr.tls)
			client, server := pair(t, c)
			_, err := server.Write([]byte("before"))
			require.NoError(t, err)
			require.NoError(t, server.SendFIN())
			got, err := io.ReadAll(client)
			require.NoError(t, err) // ReadAll stops at io.EOF
			require.Equal(t, "before", string(got))

			_, err = server.Write([]byte("late bytes"))
			require.NoError(t, err)
			require.NoError(t, server.Flush(testCtx(t)))
			// A round of the client's worker after the bytes reached it:
			// its progress handles their arrival before the round's end.
			round := make(chan struct{})
			w := c.Worker()
			require.NoError(t, w.Submit(func() { w.Later(func() { close(round) }) }))
			<-round
			require.Zero(t, client.Buffered(), "bytes kept from after the FIN")
			n, err := client.Read(make([]byte, 64))
			require.Equal(t, 0, n)
			require.ErrorIs(t, err, io.EOF)
		})
	}
}

// TestOneFINAckPerPeer: a peer that sends FIN after FIN gets one FIN-ACK,
// the first FIN's: each further one would be a request of the receiver's
// that the peer alone decides to queue.
func TestOneFINAckPerPeer(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			c := newContext(t, tr.tls)
			client, server := pair(t, c)
			for range 5 {
				require.NoError(t, server.SendFIN())
			}
			require.NoError(t, server.Flush(testCtx(t)))
			// A round of the client's worker after the FINs reached it:
			// its progress handles their arrival before the round's end.
			round := make(chan struct{})
			w := c.Worker()
			require.NoError(t, w.Submit(func() { w.Later(func() { close(round) }) }))
			<-round
			n, err := client.FINAcksSent()
			require.NoError(t, err)
			require.Equal(t, 1, n, "FIN-ACKs sent for 5 FINs")
			_, err = io.ReadAll(client)
			require.NoError(t, err) // the reads end at the first FIN
		})
	}
}

// UCX gives a released endpoint's address to the next endpoint it creates,
// possibly before the first one's close completion is handled: that
// completion leaves the FIN and FIN-ACK events naming the address to the
// new endpoint, whose peer's close would otherwise never reach it.
func TestClosedEndpointLeavesReusedHandle(t *testing.T) {
	c := newContext(t, "tcp")
	w := c.Worker()
	old, _ := pairOn(t, w, newWorker(t, c))
	newer, _ := pairOn(t, w, newWorker(t, c))
	h := old.Handle()
	require.NotZero(t, h)
	require.True(t, old.EndpointAt(h) == old, "events naming the endpoint reach another")
	newer.SetEndpointAt(h, newer)
	t.Cleanup(func() { newer.SetEndpointAt(h, nil) })
	require.NoError(t, old.Close())
	<-old.Done()
	require.Zero(t, old.Handle(), "the UCX endpoint was not released")
	require.True(t, newer.EndpointAt(h) == newer, "the closed endpoint took the entry of the one now at its address")
}
