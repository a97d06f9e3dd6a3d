package transport_test

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/nettest"

	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// TestConn runs x/net/nettest's conformance suite over the gRPC stream conn
// of every transport: the in-memory fake pair, TCP, UCX shm and UCX tcp.
func TestConn(t *testing.T) {
	t.Run("fake", func(t *testing.T) {
		nettest.TestConn(t, transporttest.MakePipe())
	})
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			nettest.TestConn(t, makePipe(t, tc.options(t)))
		})
	}
}

// TestConnTransfer moves bytes both ways at a few sizes over every transport
// and checks what arrived, and that the chosen transport is visible.
func TestConnTransfer(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			sizes := []int{1, 1000, 1 << 20, 8<<20 + 3}
			if !testing.Short() && tc.name == "ucx-shm" {
				sizes = append(sizes, 64<<20) // one big case, on the fastest path
			}
			p := dialPair(t, tc.options(t))
			require.Equal(t, tc.want(), p.client.Transport())
			require.Equal(t, tc.want(), p.server.Transport())
			require.Equal(t, "gdrpc+"+tc.want(), p.cc.LocalAddr().Network())
			require.Equal(t, "gdrpc+"+tc.want(), p.sc.RemoteAddr().Network())
			if tc.ucx != "" {
				require.NotNil(t, p.client.Endpoint())
				require.NotNil(t, p.server.Endpoint())
				require.NotNil(t, p.client.RDMAContext())
				info := p.client.Endpoint().TransportInfo()
				found := false
				for _, l := range tc.lanes {
					found = found || strings.Contains(info, l)
				}
				require.True(t, found, "lanes %v not in:\n%s", tc.lanes, info)
			} else {
				require.Nil(t, p.client.Endpoint())
				require.Nil(t, p.client.RDMAContext())
			}
			for _, n := range sizes {
				want := make([]byte, n)
				_, _ = rand.Read(want)
				echoed := make(chan error, 1)
				go func() { // the server echoes n bytes
					buf := make([]byte, n)
					if _, err := io.ReadFull(p.sc, buf); err != nil {
						echoed <- err
						return
					}
					_, err := p.sc.Write(buf)
					echoed <- err
				}()
				wrote := make(chan error, 1)
				go func() {
					_, err := p.cc.Write(want)
					wrote <- err
				}()
				got := make([]byte, n)
				_, err := io.ReadFull(p.cc, got)
				require.NoError(t, err)
				require.NoError(t, <-wrote)
				require.NoError(t, <-echoed)
				require.True(t, bytes.Equal(want, got), "size %d: bytes differ", n)
			}
		})
	}
}

// TestConnErrors checks the error contract of the conns: timeouts are
// net.Errors that unwrap to os.ErrDeadlineExceeded (yamux's do not), and
// after Close every call fails with net.ErrClosed.
func TestConnErrors(t *testing.T) {
	c, s := transporttest.Pair(t)
	cc, sc := transporttest.Conns(t, c, s)

	require.NoError(t, cc.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
	_, err := cc.Read(make([]byte, 1))
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout())
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	// A deadline in the past fails at once even with data buffered.
	_, err = sc.Write([]byte("x"))
	require.NoError(t, err)
	require.NoError(t, cc.SetReadDeadline(time.Unix(1, 0)))
	_, err = cc.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, cc.SetReadDeadline(time.Time{}))
	b := make([]byte, 1)
	_, err = io.ReadFull(cc, b)
	require.NoError(t, err)
	require.Equal(t, "x", string(b))

	// Close wakes a blocked Read, and is idempotent.
	readErr := make(chan error, 1)
	go func() {
		_, err := sc.Read(make([]byte, 1))
		readErr <- err
	}()
	require.NoError(t, sc.Close())
	require.NoError(t, sc.Close())
	select {
	case err := <-readErr:
		require.ErrorIs(t, err, net.ErrClosed)
	case <-time.After(testTimeout):
		t.Fatal("Close did not wake Read")
	}
	_, err = sc.Write([]byte("y"))
	require.ErrorIs(t, err, net.ErrClosed)
	require.ErrorIs(t, sc.SetDeadline(time.Now()), net.ErrClosed)

	// Closing the gRPC stream closed the server session; the client sees it.
	select {
	case <-s.Done():
	case <-time.After(testTimeout):
		t.Fatal("server session still open")
	}
	require.ErrorIs(t, s.Err(), net.ErrClosed)
	select {
	case <-c.Done():
	case <-time.After(testTimeout):
		t.Fatal("client session did not see the peer leave")
	}
	require.ErrorIs(t, c.Err(), transport.ErrPeerGone)
	_, err = cc.Write([]byte("z"))
	require.Error(t, err)
	require.ErrorIs(t, err, net.ErrClosed)
	require.True(t, errors.Is(c.Close(), nil))
}
