package rdma_test

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

func TestSmoke(t *testing.T) {
	requireUCX(t)
	for _, tls := range []string{"shm", "tcp"} {
		t.Run(tls, func(t *testing.T) {
			c, err := rdma.NewContext(rdma.WithTransports(tlsFor(tls)))
			require.NoError(t, err)
			defer c.Close()
			t.Logf("info %+v", c.Info())
			w2, err := c.NewWorker()
			require.NoError(t, err)
			defer w2.Close()
			l, err := w2.Listen("127.0.0.1:0")
			require.NoError(t, err)
			defer l.Close()
			t.Log("listening", l.Addr())
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			acc := make(chan *rdma.Endpoint, 1)
			go func() {
				e, err := l.Accept(ctx)
				if err != nil {
					t.Error(err)
				}
				acc <- e
			}()
			e1, err := c.Worker().Dial(ctx, l.Addr().String())
			require.NoError(t, err)
			e2 := <-acc
			require.NotNil(t, e2)
			t.Log(e1.LocalAddr(), e1.RemoteAddr(), e2.LocalAddr(), e2.RemoteAddr())
			t.Log(e1.TransportInfo())
			msg := []byte("hello over ucx")
			n, err := e1.Write(msg)
			require.NoError(t, err)
			require.Equal(t, len(msg), n)
			buf := make([]byte, 100)
			n, err = io.ReadAtLeast(e2, buf, len(msg))
			require.NoError(t, err)
			require.Equal(t, msg, buf[:n])

			m, err := c.Alloc(1 << 20)
			require.NoError(t, err)
			defer m.Close()
			key, err := m.PackKey()
			require.NoError(t, err)
			t.Logf("packed key %d bytes", len(key))
			rk, err := e1.UnpackKey(key)
			require.NoError(t, err)
			defer rk.Close()
			src := []byte("put payload")
			require.NoError(t, e1.PutBytes(ctx, src, uint64(m.Addr())+5, rk))
			require.NoError(t, e1.Flush(ctx))
			require.Equal(t, src, m.Bytes()[5:5+len(src)])

			require.NoError(t, e1.Close())
			n, err = e2.Read(buf)
			require.Equal(t, 0, n)
			require.ErrorIs(t, err, io.EOF)
			require.NoError(t, e2.Close())
		})
	}
}

func tlsFor(name string) string {
	if name == "shm" {
		return "posix,sysv,cma,tcp"
	}
	return "tcp"
}
