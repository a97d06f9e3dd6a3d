package transport

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// handTimeout bounds the handshakes of the hand-played peers below.
const handTimeout = 10 * time.Second

// asyncSession runs fn (a handshake) on its own goroutine. The returned
// function waits for its result; a session it made is closed when the test
// ends.
func asyncSession(t *testing.T, fn func() (*Session, error)) func() (*Session, error) {
	t.Helper()
	type result struct {
		s   *Session
		err error
	}
	ch := make(chan result, 1)
	go func() {
		s, err := fn()
		ch <- result{s, err}
	}()
	var once sync.Once
	var r result
	get := func() (*Session, error) {
		once.Do(func() { r = <-ch })
		return r.s, r.err
	}
	t.Cleanup(func() {
		if s, _ := get(); s != nil {
			_ = s.Close()
		}
	})
	return get
}

// handHello is a hello announcing claimed with key, with a fresh nonce.
func handHello(claimed ID, key publicKey) hello {
	return hello{ID: claimed, HostID: LocalHostID(), Mode: ModeTCP, Caps: Caps{Codecs: []string{"gdr"}}, Key: key, Nonce: newNonce()}
}

// readHandFrame reads one handshake frame from a hand-played peer's end.
func readHandFrame(t *testing.T, c net.Conn) (uint16, []byte) {
	t.Helper()
	v, body, err := readFrame(c, false)
	require.NoError(t, err)
	return v, body
}

// requireIdentityError checks that err is the IdentityError for claimed with
// the reason given.
func requireIdentityError(t *testing.T, err error, claimed ID, reason string) {
	t.Helper()
	require.ErrorIs(t, err, ErrIdentity)
	var ie *IdentityError
	require.ErrorAs(t, err, &ie)
	require.Equal(t, claimed, ie.Claimed)
	require.Equal(t, reason, ie.Reason)
}

// requireClosedSilently checks that the other end closed c without sending
// anything more. The caller has bounded c with a deadline.
func requireClosedSilently(t *testing.T, c net.Conn) {
	t.Helper()
	n, err := c.Read(make([]byte, 1))
	require.Zero(t, n)
	require.ErrorIs(t, err, io.EOF)
}

const (
	reasonNotDerived = "the id is not derived from the public key sent"
	reasonBadSig     = "the handshake signature does not verify"
	reasonOwnKey     = "it is this process's own id, and the key sent is not this process's"
	reasonOwnSig     = "it is this process's own id, and the handshake signature is not this process's"
)

// TestIdentityServerRejectsImpersonation: a client played by hand that does
// not prove the id it announces (another live process's, the server's own)
// gets no session: the handshake fails with the reason, the registry is as it
// was (so no RTR for that process can reach the impostor), and the server
// closes the connection without a byte more.
func TestIdentityServerRejectsImpersonation(t *testing.T) {
	server, other, attacker := NewIdentity(), NewIdentity(), NewIdentity()
	// other is a live process with a session to the server.
	_, otherSession := pipePairWith(t, []Option{WithIdentity(other)}, []Option{WithIdentity(server)})
	registered := ReadStats().Sessions

	flip := func(sig signature) signature { sig[7] ^= 0x10; return sig }
	tests := []struct {
		name   string
		hello  hello
		proof  func(h hello, helloBody, welcomeBody []byte) signature // nil: refused at the hello
		reason string
	}{
		{
			name:  "another process's id and key",
			hello: handHello(other.ID(), other.publicKey()),
			proof: func(_ hello, hb, wb []byte) signature {
				return attacker.signTranscript(transcript(roleClientLabel, hb, wb))
			},
			reason: reasonBadSig,
		},
		{name: "another process's id, own key", hello: handHello(other.ID(), attacker.publicKey()), reason: reasonNotDerived},
		{
			name:  "server's own id and key",
			hello: handHello(server.ID(), server.publicKey()),
			proof: func(_ hello, hb, wb []byte) signature {
				return attacker.signTranscript(transcript(roleClientLabel, hb, wb))
			},
			reason: reasonOwnSig,
		},
		{name: "server's own id, own key", hello: handHello(server.ID(), attacker.publicKey()), reason: reasonOwnKey},
		{
			name:  "tampered signature",
			hello: handHello(attacker.ID(), attacker.publicKey()),
			proof: func(_ hello, hb, wb []byte) signature {
				return flip(attacker.signTranscript(transcript(roleClientLabel, hb, wb)))
			},
			reason: reasonBadSig,
		},
		{
			name:  "signature of another hello",
			hello: handHello(attacker.ID(), attacker.publicKey()),
			proof: func(h hello, _, wb []byte) signature {
				h.Nonce = newNonce() // what a relay changing the hello would make the server see
				return attacker.signTranscript(transcript(roleClientLabel, encodeHello(h)[frameHeaderLen:], wb))
			},
			reason: reasonBadSig,
		},
		{
			name:  "signature in the server's role",
			hello: handHello(attacker.ID(), attacker.publicKey()),
			proof: func(_ hello, hb, wb []byte) signature {
				return attacker.signTranscript(transcript(roleServerLabel, hb, wb))
			},
			reason: reasonBadSig,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c1, c2 := net.Pipe()
			serverResult := asyncSession(t, func() (*Session, error) {
				ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
				defer cancel()
				return NewServerSession(ctx, c2, WithIdentity(server), WithKeepAlive(-1, 0))
			})
			t.Cleanup(func() { _ = c1.Close() })
			require.NoError(t, c1.SetDeadline(time.Now().Add(handTimeout)))

			helloFrame := encodeHello(tc.hello)
			_, err := c1.Write(helloFrame)
			require.NoError(t, err)
			v, body := readHandFrame(t, c1)
			if tc.proof == nil {
				_, err = parseWelcome(v, body)
				var re *RejectError
				require.ErrorAs(t, err, &re)
				require.Equal(t, uint8(rejectIdentity), re.Code)
			} else {
				w, err := parseWelcome(v, body)
				require.NoError(t, err)
				require.Equal(t, server.ID(), w.ID)
				sig := tc.proof(tc.hello, helloFrame[frameHeaderLen:], body)
				_, err = c1.Write(encodeProof(proof{Signature: sig}))
				require.NoError(t, err)
			}
			s, err := serverResult()
			require.Nil(t, s)
			requireIdentityError(t, err, tc.hello.ID, tc.reason)
			require.Contains(t, err.Error(), "peer did not prove its process id")
			requireClosedSilently(t, c1)

			require.Equal(t, []*Session{otherSession}, SessionsTo(other.ID()))
			require.Empty(t, SessionsTo(attacker.ID()))
			require.Equal(t, registered, ReadStats().Sessions)
		})
	}
}

// TestIdentityClientRejectsImpersonation: a server played by hand that does
// not prove the id its welcome announces gets no session from the client,
// which tells it why in a reject and closes the connection.
func TestIdentityClientRejectsImpersonation(t *testing.T) {
	client, other, attacker := NewIdentity(), NewIdentity(), NewIdentity()
	otherSession, _ := pipePairWith(t, []Option{WithIdentity(client)}, []Option{WithIdentity(other)})
	registered := ReadStats().Sessions

	welcomeAs := func(id ID, key publicKey) welcome {
		return welcome{ID: id, HostID: LocalHostID(), Caps: Caps{Codecs: []string{"gdr"}}, Transport: "tcp", Token: newToken(), Key: key, Nonce: newNonce()}
	}
	// signed encodes w with signer's signature of the transcript; tamper, if
	// set, changes the body after signing.
	signed := func(signer *Identity, helloBody []byte, w welcome, tamper func(body []byte)) []byte {
		f := encodeWelcome(w)
		body := f[frameHeaderLen:]
		sig := signer.signTranscript(transcript(roleServerLabel, helloBody, unsignedWelcome(body)))
		copy(body[len(body)-signatureLen:], sig[:])
		if tamper != nil {
			tamper(body)
		}
		return f
	}
	tests := []struct {
		name    string
		claimed ID
		welcome func(helloBody []byte) []byte
		reason  string
	}{
		{
			name:    "another process's id and key",
			claimed: other.ID(),
			welcome: func(hb []byte) []byte { return signed(attacker, hb, welcomeAs(other.ID(), other.publicKey()), nil) },
			reason:  reasonBadSig,
		},
		{
			name:    "another process's id, own key",
			claimed: other.ID(),
			welcome: func(hb []byte) []byte { return signed(attacker, hb, welcomeAs(other.ID(), attacker.publicKey()), nil) },
			reason:  reasonNotDerived,
		},
		{
			name:    "client's own id and key",
			claimed: client.ID(),
			welcome: func(hb []byte) []byte { return signed(attacker, hb, welcomeAs(client.ID(), client.publicKey()), nil) },
			reason:  reasonOwnSig,
		},
		{
			name:    "client's own id, own key",
			claimed: client.ID(),
			welcome: func(hb []byte) []byte {
				return signed(attacker, hb, welcomeAs(client.ID(), attacker.publicKey()), nil)
			},
			reason: reasonOwnKey,
		},
		{
			name:    "tampered signature",
			claimed: attacker.ID(),
			welcome: func(hb []byte) []byte {
				return signed(attacker, hb, welcomeAs(attacker.ID(), attacker.publicKey()), func(b []byte) { b[len(b)-1] ^= 1 })
			},
			reason: reasonBadSig,
		},
		{
			name:    "token changed after signing",
			claimed: attacker.ID(),
			welcome: func(hb []byte) []byte {
				w := welcomeAs(attacker.ID(), attacker.publicKey())
				return signed(attacker, hb, w, func(b []byte) {
					at := len(b) - signatureLen - nonceLen - keyLen - len(ID{})
					require.Equal(t, w.Token[:], b[at:at+len(ID{})])
					b[at] ^= 0xff
				})
			},
			reason: reasonBadSig,
		},
		{
			name:    "welcome of another handshake",
			claimed: attacker.ID(),
			welcome: func([]byte) []byte {
				earlier := encodeHello(handHello(client.ID(), client.publicKey()))[frameHeaderLen:]
				return signed(attacker, earlier, welcomeAs(attacker.ID(), attacker.publicKey()), nil)
			},
			reason: reasonBadSig,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c1, c2 := net.Pipe()
			clientResult := asyncSession(t, func() (*Session, error) {
				ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
				defer cancel()
				return NewClientSession(ctx, c1, WithIdentity(client), WithKeepAlive(-1, 0))
			})
			t.Cleanup(func() { _ = c2.Close() })
			require.NoError(t, c2.SetDeadline(time.Now().Add(handTimeout)))

			v, helloBody := readHandFrame(t, c2)
			h, err := parseHello(v, helloBody)
			require.NoError(t, err)
			require.Equal(t, client.ID(), h.ID)
			_, err = c2.Write(tc.welcome(helloBody))
			require.NoError(t, err)

			v, body := readHandFrame(t, c2)
			_, err = parseWelcome(v, body) // a reject parses as one
			var re *RejectError
			require.ErrorAs(t, err, &re)
			require.Equal(t, uint8(rejectIdentity), re.Code)

			s, err := clientResult()
			require.Nil(t, s)
			requireIdentityError(t, err, tc.claimed, tc.reason)
			require.Equal(t, (&IdentityError{Claimed: tc.claimed, Reason: tc.reason}).Error(), re.Message)
			requireClosedSilently(t, c2)

			require.Equal(t, []*Session{otherSession}, SessionsTo(other.ID()))
			require.Empty(t, SessionsTo(attacker.ID()))
			require.Equal(t, registered, ReadStats().Sessions)
		})
	}
}

// TestIdentityProven: each end of a session knows the other's proven id and
// key; a session of a process to itself proves its own id and is accepted.
func TestIdentityProven(t *testing.T) {
	a, b := NewIdentity(), NewIdentity()
	require.Equal(t, IDOf(a.PublicKey()), a.ID())
	c, s := pipePairWith(t, []Option{WithIdentity(a)}, []Option{WithIdentity(b)})
	require.Equal(t, b.ID(), c.Peer().ID)
	require.Equal(t, b.PublicKey(), c.Peer().PublicKey)
	require.Equal(t, a.ID(), s.Peer().ID)
	require.Equal(t, a.PublicKey(), s.Peer().PublicKey)

	self := NewIdentity()
	c, s = pipePairWith(t, []Option{WithIdentity(self)}, []Option{WithIdentity(self)})
	require.Equal(t, self.ID(), c.Peer().ID)
	require.Equal(t, self.ID(), s.Peer().ID)
	require.ElementsMatch(t, []*Session{c, s}, SessionsTo(self.ID()))
}

// TestLocalIdentityOnce: the process identity is made once, whoever asks
// first, and the id is its key's.
func TestLocalIdentityOnce(t *testing.T) {
	const callers = 8
	got := make([]*Identity, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i] = LocalIdentity()
		}()
	}
	wg.Wait()
	for _, id := range got {
		require.Same(t, got[0], id)
	}
	require.Equal(t, IDOf(got[0].PublicKey()), LocalID())
	cfg, err := newConfig(nil)
	require.NoError(t, err)
	require.Same(t, got[0], cfg.identity)
}

// TestIdentityListenerRejectsImpersonation: through a Listener, a client
// that announces another live process's id and cannot prove it gets no
// session, and the token of the welcome it got opens nothing: no UCX
// upgrade, no lane.
func TestIdentityListenerRejectsImpersonation(t *testing.T) {
	t.Run("tcp", func(t *testing.T) {
		testListenerImpersonation(t, []Option{WithMode(ModeTCP)}, nil)
	})
	t.Run("ucx", func(t *testing.T) {
		rc := internalUCX(t)
		testListenerImpersonation(t, []Option{WithRDMAContext(rc), WithMode(ModeUCX)}, rc)
	})
}

func testListenerImpersonation(t *testing.T, opts []Option, rc *rdma.Context) {
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	other, attacker := NewIdentity(), NewIdentity()
	l, err := Listen("127.0.0.1:0", opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })

	// other is a live process with a session to the listener.
	legit, err := Dial(ctx, l.Addr().String(), append(opts, WithIdentity(other))...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = legit.Close() })
	_, err = legit.Conn(ctx)
	require.NoError(t, err)
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	select {
	case c := <-accepted: // the server's session is up
		require.NotNil(t, c)
	case <-ctx.Done():
		t.Fatal("the legitimate session was not accepted")
	}
	otherSessions := SessionsTo(other.ID())
	require.Len(t, otherSessions, 1)
	registered := ReadStats().Sessions

	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(handTimeout)))
	h := handHello(other.ID(), other.publicKey())
	h.Caps.Lanes = true
	if rc != nil {
		h.Mode, h.Caps.UCX = ModeUCX, true
	}
	helloFrame := encodeHello(h)
	_, err = c.Write(helloFrame)
	require.NoError(t, err)
	v, body := readHandFrame(t, c)
	w, err := parseWelcome(v, body)
	require.NoError(t, err)
	if rc != nil {
		require.Equal(t, "ucx", w.Transport)
	}
	sig := attacker.signTranscript(transcript(roleClientLabel, helloFrame[frameHeaderLen:], body))
	_, err = c.Write(encodeProof(proof{Signature: sig}))
	require.NoError(t, err)
	requireClosedSilently(t, c)

	// refused dials the address, sends msg and expects a zero ack, then the end.
	refused := func(dial func() (net.Conn, error), msg []byte) {
		t.Helper()
		c, err := dial()
		if errors.Is(err, rdma.ErrRejected) {
			return // the UCX listener expected no connection: turned away before it carried a byte
		}
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, c.SetDeadline(time.Now().Add(handTimeout)))
		_, err = c.Write(msg)
		require.NoError(t, err)
		b, err := io.ReadAll(c)
		require.Equal(t, []byte{0}, b, "a refusal, then the end")
		if err != nil {
			require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
		}
	}
	lane := append(append([]byte(laneMagic), w.Token[:]...), roleControl)
	refused(func() (net.Conn, error) { return d.DialContext(ctx, "tcp", l.Addr().String()) }, lane)
	if rc != nil {
		dialUCX := func() (net.Conn, error) { return rc.Worker().Dial(ctx, l.UCXAddr().String()) }
		refused(dialUCX, append([]byte(upgradeMagic), w.Token[:]...))
		refused(dialUCX, lane)
	}

	require.Equal(t, otherSessions, SessionsTo(other.ID()))
	require.Empty(t, SessionsTo(attacker.ID()))
	require.Equal(t, registered, ReadStats().Sessions)
}
