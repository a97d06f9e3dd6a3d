package transport_test

import (
	"context"
	"io"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// TestPeerInProcess: both ends of a session inside this process know it,
// and keep knowing it after the other end closed; a session to another
// process does not. The registry counts the pair's digest down as each end
// closes. (TestPeerInProcessIdentities: ends of distinct identities.)
func TestPeerInProcess(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.options(t)
			st := dialPair(t, opts)
			require.Equal(t, 2, transport.HandshakeHeld(st.client))
			require.True(t, st.client.PeerInProcess())
			require.True(t, st.server.PeerInProcess())
			require.NoError(t, st.server.Close())
			<-st.server.Done()
			require.True(t, st.client.PeerInProcess(), "the answer stays once found")
			require.NoError(t, st.client.Close())
			<-st.client.Done()
			require.Zero(t, transport.HandshakeHeld(st.client))

			_, s, _ := dialEchoChild(t, tc, opts)
			require.False(t, s.PeerInProcess())
		})
	}
}

// TestPeerInProcessRelayed: a peer that relays this process's own handshake
// to its own listener (a relay between TCP connections from this process's
// client and to its server) gives the two sessions one digest,
// but their connections do not mirror each other: neither end takes its peer
// for this process.
func TestPeerInProcessRelayed(t *testing.T) {
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	l, err := transport.Listen("127.0.0.1:0", opts...)
	require.NoError(t, err)
	defer l.Close()
	relay, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer relay.Close()
	go func() { // every connection, the session's lanes too
		for {
			in, err := relay.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				in.Close()
				return
			}
			pipe := func(dst, src net.Conn) {
				_, _ = io.Copy(dst, src)
				dst.Close()
				src.Close()
			}
			go pipe(out, in)
			go pipe(in, out)
		}
	}()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	cs, err := transport.Dial(ctx, relay.Addr().String(), opts...)
	require.NoError(t, err)
	defer cs.Close()
	cc, err := cs.Conn(ctx)
	require.NoError(t, err)
	defer cc.Close()
	var sc net.Conn
	select {
	case sc = <-accepted:
	case <-ctx.Done():
		t.Fatal("the relayed session reached no Accept")
	}
	defer sc.Close()
	ss := transport.SessionOf(sc)
	require.NotNil(t, ss)
	require.Equal(t, 2, transport.HandshakeHeld(cs), "both ends hold the relayed handshake's digest")
	require.False(t, cs.PeerInProcess())
	require.False(t, ss.PeerInProcess())
}
