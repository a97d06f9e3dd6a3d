package transport

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/leaktest"
)

// rawLaneClient plays a client by hand over TCP to l: a handshake that
// announces lanes, proven with a fresh identity. It returns the handshake
// connection (the session's main connection) and the session's token.
func rawLaneClient(t *testing.T, l *Listener) (net.Conn, ID) {
	t.Helper()
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(handTimeout)))
	id := NewIdentity()
	hf := encodeHello(hello{ID: id.ID(), HostID: LocalHostID(), Mode: ModeTCP, Caps: Caps{Lanes: true}, Key: id.publicKey(), Nonce: newNonce()})
	_, err = c.Write(hf)
	require.NoError(t, err)
	v, wb := readHandFrame(t, c)
	w, err := parseWelcome(v, wb)
	require.NoError(t, err)
	require.True(t, w.Caps.Lanes)
	_, err = c.Write(encodeProof(proof{Signature: id.signTranscript(transcript(roleClientLabel, hf[frameHeaderLen:], wb))}))
	require.NoError(t, err)
	require.NoError(t, c.SetDeadline(time.Time{}))
	return c, w.Token
}

// rawLane dials a TCP lane to l naming token and role.
func rawLane(t *testing.T, l *Listener, token ID, role byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	_, err = c.Write(append(append([]byte(laneMagic), token[:]...), role))
	require.NoError(t, err)
	return c
}

func readAck(t *testing.T, c net.Conn) []byte {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(handTimeout)))
	b := make([]byte, 1)
	n, _ := io.ReadFull(c, b)
	require.NoError(t, c.SetReadDeadline(time.Time{}))
	return b[:n]
}

func transportGoroutines() []string {
	var out []string
	for _, g := range leaktest.Goroutines("gdrpc/gdrpc/transport.", "hashicorp/yamux") {
		if strings.Contains(g, "testing.tRunner") || strings.Contains(g, "lane_repeat_test") {
			continue
		}
		out = append(out, g)
	}
	return out
}

// A client that completed its handshake and names its gRPC lane twice, then
// a control lane after it, gets the first and is refused the others; when it
// then drops its main connection, the server's session ends and nothing of it
// stays: no session, no lane slot, no handshake slot, no goroutine.
func TestLaneRepeatsThenDrop(t *testing.T) {
	l, err := Listen("127.0.0.1:0", WithMode(ModeTCP), WithEngine(testEngine{}), WithHandshakeTimeout(handTimeout))
	require.NoError(t, err)
	defer l.Close()
	main, token := rawLaneClient(t, l)
	require.Equal(t, []byte{upgradeAckOK}, readAck(t, rawLane(t, l, token, roleGRPC)))
	require.Equal(t, []byte{0}, readAck(t, rawLane(t, l, token, roleGRPC)), "a second gRPC lane")
	require.Equal(t, []byte{0}, readAck(t, rawLane(t, l, token, roleControl)), "a lane after the gRPC lane")
	require.NoError(t, main.Close())
	require.Eventually(t, func() bool {
		laneWaiting.Lock()
		slots := len(laneWaiting.m)
		laneWaiting.Unlock()
		return ReadStats().Sessions == 0 && slots == 0 && len(l.handshakes) == 0 && l.awaitingSessions() == 0
	}, handTimeout, time.Millisecond)
	require.NoError(t, l.Close())
	require.Eventually(t, func() bool { return len(transportGoroutines()) == 0 }, handTimeout, 10*time.Millisecond,
		"goroutines left: %v", transportGoroutines())
}

// Once a token's gRPC lane is taken, every later lane of it is refused as
// one of no session, even while the session has not yet taken its gRPC
// stream (which is when the listener forgets the token as well).
func TestLaneAfterGRPCLaneForgotten(t *testing.T) {
	l := &Listener{}
	token := NewIdentity().ID()
	slot := expectLane(token, l)
	defer forgetLane(token, slot)
	s := &Session{}
	slot.fill(s)
	got, err := takeLaneSession(context.Background(), l, token, roleGRPC, nil)
	require.NoError(t, err)
	require.Same(t, s, got)
	for _, role := range []byte{roleControl, roleBulk, roleGRPC} {
		_, err := takeLaneSession(context.Background(), l, token, role, nil)
		require.ErrorContains(t, err, "no session waits", "role %q", role)
	}
	laneWaiting.Lock()
	defer laneWaiting.Unlock()
	require.NotContains(t, laneWaiting.m, token)
}
