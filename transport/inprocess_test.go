package transport_test

import (
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
