package transport

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// heldReads is a connection whose reads, once held is set, keep what they
// read until release closes: its process stopped reading.
type heldReads struct {
	net.Conn
	held    atomic.Bool
	release chan struct{}
}

func (c *heldReads) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if c.held.Load() {
		<-c.release
	}
	return n, err
}

// CloseGracefully cut short returns at once even while the gRPC conn's own
// close waits: on a session without lanes, the stream's end is a frame
// that waits behind a peer that reads nothing, up to the keepalive timeout.
func TestCloseGracefullyCutWhileCloseWaits(t *testing.T) {
	c1, c2 := net.Pipe() // no buffer: a write waits for the peer's read
	server := &heldReads{Conn: c2, release: make(chan struct{})}
	opts := []Option{WithMode(ModeTCP), WithKeepAlive(-1, 30*time.Second)}
	cs, ss := pairOver(t, c1, server, opts, opts)
	defer close(server.release) // before the sessions' Close: the server's reader takes its end
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc, err := cs.Conn(ctx)
	require.NoError(t, err)
	_, err = ss.Conn(ctx)
	require.NoError(t, err)

	server.held.Store(true)
	go func() { _, _ = cc.Write(make([]byte, 64<<10)) }() // takes the server's last read, then waits
	cut := make(chan struct{})
	returned := make(chan bool, 1)
	go func() { returned <- CloseGracefully(cc, cut) }()
	require.Eventually(t, func() bool { return cc.(*streamConn).closed.Load() }, 10*time.Second, time.Millisecond,
		"the conn's close began")
	start := time.Now()
	close(cut)
	select {
	case cutShort := <-returned:
		require.True(t, cutShort)
		require.Less(t, time.Since(start), 10*time.Second)
	case <-time.After(20 * time.Second):
		t.Fatal("CloseGracefully waited for the conn's close past its cut")
	}
	require.True(t, released(cs))
}
