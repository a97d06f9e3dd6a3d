package rdma_test

import (
	"bytes"
	"io"
	"strings"
	"testing"

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
		})
	}
}

func TestStreamSizes(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tls string) {
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
	forEachTransport(t, func(t *testing.T, tls string) {
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
