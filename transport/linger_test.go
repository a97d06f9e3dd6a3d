package transport

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// lingerClose returns by its bound while the peer neither sends its end nor
// anything else, even when another reader of the connection keeps clearing
// its read deadline (as the session's lane readers do before each frame);
// the peer reads this side's end.
func TestLingerCloseBound(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	peer := <-accepted
	require.NotNil(t, peer)
	defer peer.Close()

	stop := make(chan struct{})
	cleared := make(chan struct{})
	go func() {
		defer close(cleared)
		for {
			_ = c.SetReadDeadline(time.Time{})
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	const bound = 200 * time.Millisecond
	returned := make(chan time.Duration, 1)
	start := time.Now()
	go func() {
		_ = lingerClose(c.(*net.TCPConn), start.Add(bound))
		returned <- time.Since(start)
	}()
	select {
	case took := <-returned:
		require.GreaterOrEqual(t, took, bound)
	case <-time.After(10 * time.Second):
		t.Fatal("lingerClose outlived its bound")
	}
	close(stop)
	<-cleared
	require.NoError(t, peer.SetReadDeadline(time.Now().Add(10*time.Second)))
	n, err := peer.Read(make([]byte, 1))
	require.Zero(t, n)
	require.ErrorIs(t, err, io.EOF, "the peer reads this side's end")
}
