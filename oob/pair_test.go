package oob

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// lanePair dials one session served by the engine, with the given options on
// each side, and returns both sessions and their gRPC conns.
func lanePair(t testing.TB, serverOpts, clientOpts []transport.Option) (l *transport.Listener, cs, ss *transport.Session, cc, sc net.Conn) {
	t.Helper()
	serverOpts = append([]transport.Option{transport.WithEngine(Engine()), transport.WithIdentity(transport.NewIdentity())}, serverOpts...)
	clientOpts = append([]transport.Option{transport.WithEngine(Engine()), transport.WithIdentity(transport.NewIdentity())}, clientOpts...)
	l, err := transport.Listen("127.0.0.1:0", serverOpts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	cs, err = transport.Dial(ctx, l.Addr().String(), clientOpts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cs.Close() })
	cc, err = cs.Conn(ctx)
	require.NoError(t, err)
	select {
	case sc = <-accepted:
	case <-ctx.Done():
		t.Fatal("no conn accepted")
	}
	ss = transport.SessionOf(sc)
	require.NotNil(t, ss)
	t.Cleanup(func() { _ = ss.Close() })
	return l, cs, ss, cc, sc
}

// requireEnds waits for s to close and checks why.
func requireEnds(t *testing.T, s *transport.Session, why string) {
	t.Helper()
	select {
	case <-s.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the session did not close")
	}
	require.ErrorContains(t, s.Err(), why)
}

// requireLive checks that s has not closed.
func requireLive(t *testing.T, s *transport.Session) {
	t.Helper()
	select {
	case <-s.Done():
		t.Fatalf("the session closed: %v", s.Err())
	default:
	}
}

// pipePair is a pair of sessions served by the engine over net.Pipe, with
// distinct process ids.
func pipePair(t testing.TB, opts ...transport.Option) (client, server *transport.Session) {
	t.Helper()
	side := func(more ...transport.Option) []transport.Option {
		return append(append([]transport.Option{transport.WithIdentity(transport.NewIdentity())}, more...), opts...)
	}
	return transporttest.PairWith(t, side(transport.WithEngine(Engine())), side(transport.WithEngine(Engine())))
}

// Sessions the engine serves announce its codec; a session without an engine
// announces none, so the codec's peers send it no descriptor.
func TestEngineAnnouncesCodec(t *testing.T) {
	c, s := pipePair(t)
	require.True(t, c.Speaks("gdr"))
	require.True(t, s.Speaks("gdr"))

	bare, other := transporttest.PairWith(t,
		[]transport.Option{transport.WithEngine(Engine()), transport.WithIdentity(transport.NewIdentity())},
		[]transport.Option{transport.WithIdentity(transport.NewIdentity())})
	require.False(t, bare.Speaks("gdr"), "the peer has no engine")
	require.False(t, other.Speaks("gdr"), "this side has no engine")
	require.Empty(t, bare.Peer().Caps.Codecs)
	require.Equal(t, []string{"gdr"}, other.Peer().Caps.Codecs)
}
