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

// fixedPool hands out one buffer, over and over: a pool that allocates
// nothing.
type fixedPool struct{ buf *[]byte }

func (p fixedPool) Get(int) *[]byte { return p.buf }
func (p fixedPool) Put(*[]byte)     {}

// A read of the gRPC lane over TCP allocates nothing: gRPC's reader calls
// ReadOnReady a few times per call, and a closure over the read's results
// would put them on the heap each time.
func TestLaneReadOnReadyAllocatesNothing(t *testing.T) {
	st := dialPair(t, transportCases[0].options(t))
	rr := st.sc.(readyReader)
	buf := make([]byte, 32<<10)
	pool := fixedPool{&buf}
	msg := []byte("f")
	allocs := testing.AllocsPerRun(200, func() {
		if _, err := st.cc.Write(msg); err != nil {
			t.Fatal(err)
		}
		got, n, err := rr.ReadOnReady(len(buf), pool)
		if err != nil || n != 1 || (*got)[0] != 'f' {
			t.Fatalf("read %d bytes (%v)", n, err)
		}
	})
	require.Zero(t, allocs, "allocations per read and write")
}
