package transporttest_test

import (
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

func TestPairs(t *testing.T) {
	for _, tc := range []struct {
		name string
		make func(testing.TB, ...transport.Option) (*transport.Session, *transport.Session)
	}{
		{"pipe", transporttest.Pair},
		{"tcp", transporttest.TCPPair},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := tc.make(t)
			require.Equal(t, "tcp", c.Transport())
			cc, sc := transporttest.Conns(t, c, s)
			go func() { _, _ = io.Copy(sc, sc) }()
			_, err := cc.Write([]byte("ping"))
			require.NoError(t, err)
			b := make([]byte, 4)
			_, err = io.ReadFull(cc, b)
			require.NoError(t, err)
			require.Equal(t, "ping", string(b))
			require.Contains(t, transport.SessionsTo(transport.LocalID()), c)
			require.Contains(t, transport.SessionsTo(transport.LocalID()), s)
		})
	}
	transporttest.NoSessions(t)
}

func TestPairWithIDs(t *testing.T) {
	ia, ib := transport.NewIdentity(), transport.NewIdentity()
	a, b := ia.ID(), ib.ID()
	c, s := transporttest.PairWith(t, []transport.Option{transport.WithIdentity(ia)}, []transport.Option{transport.WithIdentity(ib)})
	require.Equal(t, b, c.Peer().ID)
	require.Equal(t, a, s.Peer().ID)
	require.Equal(t, []*transport.Session{c}, transport.SessionsTo(b))
	require.Equal(t, []*transport.Session{s}, transport.SessionsTo(a))
}
