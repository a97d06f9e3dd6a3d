package transport_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/mem"

	"github.com/gdrpc/gdrpc/transport"
)

// readyReader is gRPC's optional reader of a conn, which its framer uses for
// reads that pin no memory while the conn is idle.
type readyReader interface {
	ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error)
}

// The gRPC lane's ReadOnReady returns what a Read would: the bytes that
// came, a deadline as a timeout, the peer's close as io.EOF, and after this
// side's close an error wrapping net.ErrClosed; it takes no buffer it does
// not return.
func TestLaneReadOnReady(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			st := dialPair(t, tc.options(t))
			rr, ok := st.sc.(readyReader)
			require.True(t, ok, "%T has no ReadOnReady", st.sc)
			pool := &countingPool{BufferPool: mem.DefaultBufferPool()}

			msg := []byte("a frame for gRPC's framer")
			_, err := st.cc.Write(msg)
			require.NoError(t, err)
			var got []byte
			for len(got) < len(msg) {
				buf, n, err := rr.ReadOnReady(32<<10, pool)
				require.NoError(t, err)
				got = append(got, (*buf)[:n]...)
				pool.Put(buf)
			}
			require.Equal(t, msg, got)

			require.NoError(t, st.sc.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
			buf, _, err := rr.ReadOnReady(32<<10, pool)
			require.Nil(t, buf)
			var te *transport.TimeoutError
			require.ErrorAs(t, err, &te)
			require.NoError(t, st.sc.SetReadDeadline(time.Time{}))

			require.NoError(t, st.cc.Close())
			buf, _, err = rr.ReadOnReady(32<<10, pool)
			require.Nil(t, buf)
			require.ErrorIs(t, err, io.EOF)

			require.NoError(t, st.sc.Close())
			buf, _, err = rr.ReadOnReady(32<<10, pool)
			require.Nil(t, buf)
			require.ErrorIs(t, err, net.ErrClosed)
			require.Zero(t, pool.out, "buffers taken and not returned")
		})
	}
}

// countingPool counts the buffers out of a pool.
type countingPool struct {
	mem.BufferPool
	out int
}

func (p *countingPool) Get(n int) *[]byte { p.out++; return p.BufferPool.Get(n) }
func (p *countingPool) Put(b *[]byte)     { p.out--; p.BufferPool.Put(b) }
