package rdma_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

func TestTransportsInUse(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			c := newContext(t, tr.tls)
			client, server := pair(t, c)
			info := client.TransportInfo()
			require.Contains(t, info, tr.lane, "lanes:\n%s", info)
			require.True(t, strings.Contains(server.TransportInfo(), tr.lane))
			// One rma_bw lane (defaultConfig): no second one on
			// another device, which every progress call would poll.
			if !envAny("UCX_MAX_RNDV_RAILS", "UCX_MAX_RNDV_LANES", "UCX_PROTO_ENABLE") {
				require.NotContains(t, info, "rma_bw#1", "lanes:\n%s", info)
			}
		})
	}
}

// envAny reports whether the environment sets any of the variables.
func envAny(names ...string) bool {
	for _, n := range names {
		if _, ok := os.LookupEnv(n); ok {
			return true
		}
	}
	return false
}

func TestStreamSizes(t *testing.T) {
	forEachPairing(t, func(t *testing.T, tls string, pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint)) {
		c := newContext(t, tls)
		client, server := pair(t, c)
		for i, n := range sizes(t) {
			t.Run(sizeName(n), func(t *testing.T) {
				// unaligned: the payload starts 3 bytes into the slice
				src := pattern(n+3, uint64(i))[3:]
				errc := make(chan error, 1)
				go func() {
					_, err := client.Write(src)
					errc <- err
				}()
				got := make([]byte, n+5)
				_, err := io.ReadFull(server, got[5:])
				require.NoError(t, err)
				require.NoError(t, <-errc)
				require.True(t, bytes.Equal(src, got[5:]), "stream bytes differ")
				// and back, in small writes
				go func() {
					var err error
					for off := 0; off < n && err == nil; off += 1000 {
						_, err = server.Write(src[off:min(off+1000, n)])
					}
					errc <- err
				}()
				back := make([]byte, n)
				_, err = io.ReadFull(client, back)
				require.NoError(t, err)
				require.NoError(t, <-errc)
				require.True(t, bytes.Equal(src, back), "stream bytes differ (small writes)")
			})
		}
	})
}

// A peer Close delivers everything written before it, then io.EOF.
func TestStreamCloseDeliversThenEOF(t *testing.T) {
	forEachPairing(t, func(t *testing.T, tls string, pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint)) {
		c := newContext(t, tls)
		client, server := pair(t, c)
		src := pattern(3<<20+11, 9)
		for off := 0; off < len(src); off += 100000 {
			_, err := client.Write(src[off:min(off+100000, len(src))])
			require.NoError(t, err)
		}
		require.NoError(t, client.Close())
		got, err := io.ReadAll(server)
		require.NoError(t, err)
		require.True(t, bytes.Equal(src, got))
		<-server.Done()
		require.ErrorIs(t, server.Err(), io.EOF)
		_, err = server.Write([]byte("x"))
		require.ErrorIs(t, err, io.EOF)
	})
}

// Reads with large buffers (the owner copies straight into them) and short
// deadlines racing the data: no byte lost or repeated.
func TestStreamDirectReadDeadlines(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
		c := newContext(t, tls)
		client, server := pair(t, c)
		want := pattern(8<<20+5, 77)
		errc := make(chan error, 1)
		go func() {
			var err error
			for off := 0; off < len(want) && err == nil; off += 200000 {
				_, err = client.Write(want[off:min(off+200000, len(want))])
			}
			errc <- err
		}()
		got := make([]byte, 0, len(want))
		buf := make([]byte, 256<<10)
		timeouts := 0
		for i := 0; len(got) < len(want); i++ {
			require.NoError(t, server.SetReadDeadline(time.Now().Add(time.Duration(i%7)*30*time.Microsecond)))
			n, err := server.Read(buf)
			got = append(got, buf[:n]...)
			if err != nil {
				var ne net.Error
				require.ErrorAs(t, err, &ne)
				require.True(t, ne.Timeout())
				require.ErrorIs(t, err, os.ErrDeadlineExceeded)
				require.Zero(t, n)
				timeouts++
			}
		}
		require.NoError(t, <-errc)
		require.True(t, bytes.Equal(want, got), "stream bytes differ")
		t.Logf("%d timeouts", timeouts)
	})
}

// A large Write that times out with its send under way returns only once
// UCX no longer reads the caller's buffer: what the caller writes into it
// afterwards never reaches the peer. The endpoint ends (how much the peer
// got is unknown), so nothing is sent twice by a Write that follows.
func TestLargeWriteTimeoutReleasesBuffer(t *testing.T) {
	c := newContext(t, "tcp")
	client, server := pair(t, c)
	const n = 64 << 20
	p := bytes.Repeat([]byte{0xAA}, n)
	require.NoError(t, client.SetWriteDeadline(time.Now().Add(time.Millisecond)))
	_, err := client.Write(p)
	var ne net.Error
	if err == nil {
		t.Skip("the write completed before its deadline")
	}
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout(), "%v", err)
	for i := range p { // the caller reuses its buffer, as net.Conn allows
		p[i] = 0x55
	}
	require.NoError(t, client.SetWriteDeadline(time.Time{}))
	_, err = client.Write(p[:1])
	require.Error(t, err, "a Write after the broken one")

	got := make([]byte, n)
	require.NoError(t, server.SetReadDeadline(time.Now().Add(20*time.Second)))
	r, err := io.ReadFull(server, got)
	require.Error(t, err, "the peer read all of a write that timed out, and then its stream went on")
	require.Zero(t, bytes.Count(got[:r], []byte{0x55}), "the peer got bytes written into p after Write returned")
	var te interface{ Timeout() bool }
	if errors.As(err, &te) {
		require.False(t, te.Timeout(), "the peer's read waited for the rest of the broken stream: %v", err)
	}
}
