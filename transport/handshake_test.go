package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
)

func sampleCaps() Caps {
	return Caps{
		UCX:           true,
		UCXVersion:    "1.13.1",
		MemoryTypes:   []string{"host", "cuda"},
		UCXTransports: []string{"posix/memory", "tcp/lo"},
		CUDADevices:   []string{"GPU-0a1b"},
		Codecs:        []string{"gdr"},
		Lanes:         true,
	}
}

// sampleKey is a public key, a nonce and a signature filled with bytes that
// are not zero, to see every field of the wire format travel.
func sampleKey() (publicKey, nonce, signature) {
	self := NewIdentity()
	return self.publicKey(), newNonce(), self.signTranscript([]byte("sample"))
}

func TestHandshakeRoundTrip(t *testing.T) {
	key, n, sig := sampleKey()
	h := hello{ID: newToken(), HostID: newToken(), Mode: ModeUCX, Caps: sampleCaps(), Key: key, Nonce: n}
	v, body, err := readFrame(bytes.NewReader(encodeHello(h)), false)
	require.NoError(t, err)
	got, err := parseHello(v, body)
	require.NoError(t, err)
	require.Equal(t, h, got)

	w := welcome{ID: newToken(), HostID: newToken(), Caps: Caps{Codecs: []string{"gdr"}}, Transport: "ucx", FallbackOK: true, UCXPort: 4242, Token: newToken(),
		Key: key, Nonce: newNonce(), Signature: sig}
	v, body, err = readFrame(bytes.NewReader(encodeWelcome(w)), false)
	require.NoError(t, err)
	gotW, err := parseWelcome(v, body)
	require.NoError(t, err)
	require.Equal(t, w, gotW)
	require.Equal(t, body[len(body)-signatureLen:], sig[:])
	require.Equal(t, body[:len(body)-signatureLen], unsignedWelcome(body))

	p := proof{Signature: sig}
	v, body, err = readFrame(bytes.NewReader(encodeProof(p)), false)
	require.NoError(t, err)
	gotP, err := parseProof(v, body)
	require.NoError(t, err)
	require.Equal(t, p, gotP)
}

func TestParseProofErrors(t *testing.T) {
	good := encodeProof(proof{})[frameHeaderLen:]
	tests := []struct {
		name    string
		version uint16
		body    []byte
		want    error
		msg     string
	}{
		{name: "short signature", version: protocolVersion, body: good[:len(good)-1], want: ErrMalformed, msg: "signature: need 64 bytes, have 63"},
		{name: "trailing", version: protocolVersion, body: append(append([]byte{}, good...), 0), want: ErrMalformed, msg: "1 trailing bytes"},
		{name: "wrong kind", version: protocolVersion, body: append([]byte{kindHello}, good[1:]...), want: ErrMalformed, msg: "expected proof"},
		{name: "other version", version: protocolVersion + 1, body: good, want: ErrVersion},
		{name: "reject", version: protocolVersion - 1, body: encodeReject(rejectIdentity, "no")[frameHeaderLen:], want: ErrRejected, msg: "rejected by peer: no (code 5)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseProof(tc.version, tc.body)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, tc.msg)
		})
	}
}

// frameWith builds a frame with any version and body.
func frameWith(version uint16, body []byte) []byte {
	b := append([]byte(magic), 0, 0, 0, 0, 0, 0)
	binary.BigEndian.PutUint16(b[len(magic):], version)
	binary.BigEndian.PutUint32(b[len(magic)+2:], uint32(len(body)))
	return append(b, body...)
}

func TestHandshakeParseErrors(t *testing.T) {
	good := encodeHello(hello{ID: newToken(), Caps: sampleCaps()})
	tests := []struct {
		name  string
		input []byte
		want  error
		msg   string
	}{
		{name: "empty", input: nil, want: io.EOF},
		{name: "http1", input: []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), want: ErrNotGDRPC, msg: "bad magic"},
		{name: "short magic", input: []byte("GDR"), want: ErrNotGDRPC},
		{name: "zero length", input: frameWith(protocolVersion, nil), want: ErrMalformed, msg: "body length 0"},
		{name: "huge length", input: frameWith(protocolVersion, nil)[:frameHeaderLen-4], want: io.ErrUnexpectedEOF},
		{name: "truncated body", input: good[:len(good)-3], want: ErrMalformed, msg: "truncated"},
		{name: "trailing", input: frameWith(protocolVersion, append(append([]byte{}, good[frameHeaderLen:]...), 9)), want: ErrMalformed, msg: "trailing"},
		{name: "next version", input: frameWith(protocolVersion+1, good[frameHeaderLen:]), want: ErrVersion,
			msg: fmt.Sprintf("we speak %d, the peer speaks %d", protocolVersion, protocolVersion+1)},
		{name: "wrong kind", input: frameWith(protocolVersion, []byte{kindWelcome, 1, 2}), want: ErrMalformed, msg: "expected hello"},
		{name: "bad mode", input: func() []byte {
			b := append([]byte{}, good...)
			b[frameHeaderLen+1+32] = 9
			return b
		}(), want: ErrMalformed, msg: "unknown mode"},
		{name: "long list", input: frameWith(protocolVersion, append([]byte{kindHello}, append(make([]byte, 33), 0, 0, 0, 0, 0xff, 0xff)...)), want: ErrMalformed, msg: "list of 255 items"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v, body, err := readFrame(bytes.NewReader(tc.input), false)
			if err == nil {
				_, err = parseHello(v, body)
			}
			require.ErrorIs(t, err, tc.want)
			if tc.msg != "" {
				require.Contains(t, err.Error(), tc.msg)
			}
		})
	}
	// A frame header claiming more than the maximum body is refused before
	// reading (no allocation driven by the peer).
	b := frameWith(protocolVersion, nil)
	binary.BigEndian.PutUint32(b[len(magic)+2:], maxBodyLen+1)
	_, _, err := readFrame(bytes.NewReader(b), false)
	require.ErrorIs(t, err, ErrMalformed)
}

func TestRejectOfAnyVersion(t *testing.T) {
	// A reject is understood whatever version the frame says.
	b := encodeReject(rejectVersion, "server speaks 7")
	binary.BigEndian.PutUint16(b[len(magic):], 7)
	v, body, err := readFrame(bytes.NewReader(b), false)
	require.NoError(t, err)
	_, err = parseWelcome(v, body)
	var re *RejectError
	require.ErrorAs(t, err, &re)
	require.ErrorIs(t, err, ErrRejected)
	require.ErrorIs(t, err, ErrVersion)
	require.Contains(t, err.Error(), "server speaks 7")
	// A welcome of another version is a version error.
	w := encodeWelcome(welcome{Transport: "tcp"})
	binary.BigEndian.PutUint16(w[len(magic):], protocolVersion+1)
	v, body, err = readFrame(bytes.NewReader(w), false)
	require.NoError(t, err)
	_, err = parseWelcome(v, body)
	require.ErrorIs(t, err, ErrVersion)
}

// TestServerRejectsVersion: a client speaking the next version gets a reject that
// says why, and the server reports a version error.
func TestServerRejectsVersion(t *testing.T) {
	c1, c2 := net.Pipe()
	defer c1.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srvErr := make(chan error, 1)
	go func() {
		s, err := NewServerSession(ctx, c2)
		if s != nil {
			_ = s.Close()
		}
		srvErr <- err
	}()
	good := encodeHello(hello{ID: newToken(), Caps: sampleCaps()})
	_, err := c1.Write(frameWith(protocolVersion+1, good[frameHeaderLen:]))
	require.NoError(t, err)
	v, body, err := readFrame(c1, false)
	require.NoError(t, err)
	_, err = parseWelcome(v, body)
	require.ErrorIs(t, err, ErrVersion)
	require.Contains(t, err.Error(), fmt.Sprintf("server speaks gdrpc protocol version %d, client %d", protocolVersion, protocolVersion+1))
	require.ErrorIs(t, <-srvErr, ErrVersion)
}

// TestClientGarbage: a server that answers garbage gives the client a clear
// error, not a hang.
func TestClientGarbage(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer []byte
		want   error
	}{
		{"http", []byte("HTTP/1.1 400 Bad Request\r\n\r\n"), ErrNotGDRPC},
		{"welcome v9", func() []byte {
			b := encodeWelcome(welcome{Transport: "tcp"})
			binary.BigEndian.PutUint16(b[len(magic):], 9)
			return b
		}(), ErrVersion},
		{"bad transport", frameWith(protocolVersion, append([]byte{kindWelcome}, make([]byte, 32+1+10+1+1+2+16+keyLen+nonceLen+signatureLen)...)), ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c1, c2 := net.Pipe()
			defer c2.Close()
			go func() {
				_, _, _ = readFrame(c2, false)
				_, _ = c2.Write(tc.answer)
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := NewClientSession(ctx, c1)
			require.ErrorIs(t, err, tc.want)
		})
	}
}

// TestHandshakeDeadline: a handshake that runs out of time, on either side
// and at any step, fails with an error that matches
// context.DeadlineExceeded and os.ErrDeadlineExceeded and is a net.Error
// with Timeout() true.
func TestHandshakeDeadline(t *testing.T) {
	const bound = 50 * time.Millisecond
	// Each case plays the peer by hand and stops at some step; the session
	// under test waits for the next message.
	silent := func(net.Conn) {}
	helloOnly := func(c net.Conn) {
		self := NewIdentity()
		_, _ = c.Write(encodeHello(handHello(self.ID(), self.publicKey())))
		_, _, _ = readFrame(c, false) // the welcome; the proof never comes
	}
	readHello := func(c net.Conn) { _, _, _ = readFrame(c, false) } // no welcome
	tests := []struct {
		name   string
		server bool // the server side is under test
		ctx    bool // bounded by the caller's context, not WithHandshakeTimeout
		peer   func(net.Conn)
	}{
		{name: "client, no welcome", peer: readHello},
		{name: "client, no welcome, context", ctx: true, peer: readHello},
		{name: "server, no hello", server: true, peer: silent},
		{name: "server, no proof", server: true, peer: helloOnly},
		{name: "server, no proof, context", server: true, ctx: true, peer: helloOnly},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mine, theirs := net.Pipe()
			peerDone := make(chan struct{})
			go func() {
				defer close(peerDone)
				tc.peer(theirs)
				_, _ = io.Copy(io.Discard, theirs) // until the side under test closes
			}()
			t.Cleanup(func() {
				_ = theirs.Close()
				<-peerDone
			})
			// Taken before the context: its deadline counts from its making.
			start := time.Now()
			ctx := context.Background()
			opts := []Option{WithHandshakeTimeout(bound)}
			if tc.ctx {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, bound)
				defer cancel()
				opts = nil
			}
			var s *Session
			var err error
			if tc.server {
				s, err = NewServerSession(ctx, mine, opts...)
			} else {
				s, err = NewClientSession(ctx, mine, opts...)
			}
			require.Nil(t, s)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorIs(t, err, os.ErrDeadlineExceeded)
			var ne net.Error
			require.ErrorAs(t, err, &ne)
			require.True(t, ne.Timeout(), "%v", err)
			require.GreaterOrEqual(t, time.Since(start), bound)
		})
	}
}

// deadlineOnlyCtx has a deadline in the past but reports no error yet: the
// moment between a conn's deadline firing and the context's timer.
type deadlineOnlyCtx struct{ context.Context }

func (deadlineOnlyCtx) Deadline() (time.Time, bool) { return time.Unix(1, 0), true }

// TestCtxErrDeadlineFirst: an I/O deadline error seen before the context's
// own timer fired is the handshake's timeout all the same.
func TestCtxErrDeadlineFirst(t *testing.T) {
	ioErr := &net.OpError{Op: "read", Net: "pipe", Err: os.ErrDeadlineExceeded}
	err := ctxErr(deadlineOnlyCtx{context.Background()}, ioErr)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	var te *TimeoutError
	require.ErrorAs(t, err, &te)
	require.Equal(t, "handshake", te.Op)
	// Another error is returned as it is.
	other := errors.New("other")
	require.Same(t, other, ctxErr(deadlineOnlyCtx{context.Background()}, other))
}

func FuzzParseHello(f *testing.F) {
	key, n, _ := sampleKey()
	f.Add(encodeHello(hello{ID: IDOf(key[:]), Caps: sampleCaps(), Key: key, Nonce: n}))
	f.Add(encodeHello(hello{ID: newToken(), Caps: sampleCaps()}))
	f.Add(encodeHello(hello{}))
	f.Add(frameWith(2, []byte{1}))
	f.Add([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, body, err := readFrame(bytes.NewReader(b), false)
		if err != nil {
			return
		}
		h, err := parseHello(v, body)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrVersion) {
				t.Fatalf("unexpected error class: %v", err)
			}
			return
		}
		// What parses re-encodes to the same body (canonical encoding).
		re := encodeHello(h)
		if !bytes.Equal(re[frameHeaderLen:], body) {
			t.Fatalf("re-encoding differs:\n%x\n%x", re[frameHeaderLen:], body)
		}
	})
}

func FuzzParseWelcome(f *testing.F) {
	key, n, sig := sampleKey()
	f.Add(encodeWelcome(welcome{Transport: "ucx", UCXPort: 1, Caps: sampleCaps(), Key: key, Nonce: n, Signature: sig}))
	f.Add(encodeWelcome(welcome{Transport: "ucx", UCXPort: 1, Caps: sampleCaps()}))
	f.Add(encodeReject(rejectMode, "no"))
	f.Add(frameWith(5, []byte{kindReject, 1, 0, 1, 'x'}))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, body, err := readFrame(bytes.NewReader(b), false)
		if err != nil {
			return
		}
		w, err := parseWelcome(v, body)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrVersion) && !errors.Is(err, ErrRejected) {
				t.Fatalf("unexpected error class: %v", err)
			}
			return
		}
		re := encodeWelcome(w)
		if !bytes.Equal(re[frameHeaderLen:], body) {
			t.Fatalf("re-encoding differs")
		}
	})
}

func FuzzParseProof(f *testing.F) {
	_, _, sig := sampleKey()
	f.Add(encodeProof(proof{Signature: sig}))
	f.Add(encodeReject(rejectIdentity, "no"))
	f.Add(frameWith(protocolVersion, []byte{kindProof, 1}))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, body, err := readFrame(bytes.NewReader(b), false)
		if err != nil {
			return
		}
		p, err := parseProof(v, body)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrVersion) && !errors.Is(err, ErrRejected) {
				t.Fatalf("unexpected error class: %v", err)
			}
			return
		}
		re := encodeProof(p)
		if !bytes.Equal(re[frameHeaderLen:], body) {
			t.Fatalf("re-encoding differs")
		}
	})
}

// FuzzServerHandshake feeds arbitrary bytes to a server handshake: it must
// end (error or session) without hanging or panicking.
func FuzzServerHandshake(f *testing.F) {
	self := NewIdentity()
	proven := encodeHello(hello{ID: self.ID(), Caps: sampleCaps(), Key: self.publicKey(), Nonce: newNonce()})
	_, _, sig := sampleKey()
	f.Add(proven)                                                                     // reaches the proof
	f.Add(append(append([]byte{}, proven...), encodeProof(proof{Signature: sig})...)) // a proof that does not verify
	f.Add(encodeHello(hello{ID: newToken(), Caps: sampleCaps()}))
	f.Add(encodeHello(hello{Mode: ModeUCX}))
	f.Add([]byte(strings.Repeat("GDRPC\x00", 3)))
	f.Fuzz(func(t *testing.T, b []byte) {
		c1, c2 := net.Pipe()
		defer c1.Close()
		go func() {
			_, _ = c1.Write(b)
			_, _ = io.Copy(io.Discard, c1)
		}()
		s, err := NewServerSession(context.Background(), c2, WithHandshakeTimeout(200*time.Millisecond), WithKeepAlive(-1, 0))
		if err == nil {
			_ = s.Close()
		}
	})
}

// FuzzClientHandshake answers a client's hello with arbitrary bytes: the
// client must end (error or session) without hanging or panicking, and a
// session comes only from a welcome signed by the key of the id it names.
func FuzzClientHandshake(f *testing.F) {
	key, n, sig := sampleKey()
	f.Add(encodeWelcome(welcome{ID: IDOf(key[:]), Transport: "tcp", Caps: sampleCaps(), Key: key, Nonce: n, Signature: sig}))
	f.Add(encodeWelcome(welcome{Transport: "ucx", UCXPort: 1}))
	f.Add(encodeReject(rejectIdentity, "no"))
	f.Fuzz(func(t *testing.T, b []byte) {
		c1, c2 := net.Pipe()
		defer c2.Close()
		go func() {
			_, _, _ = readFrame(c2, false)
			_, _ = c2.Write(b)
			_, _ = io.Copy(io.Discard, c2)
		}()
		s, err := NewClientSession(context.Background(), c1, WithHandshakeTimeout(200*time.Millisecond), WithKeepAlive(-1, 0))
		if err == nil {
			_ = s.Close()
			t.Fatalf("a session from a welcome that no key signed for this hello")
		}
	})
}

// TestDialPlainGRPCServer: dialing a gRPC server that is not on a gdrpc
// listener fails at once with an error that says so, not with the bare bad
// magic.
func TestDialPlainGRPCServer(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer()
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	defer func() {
		gs.Stop()
		require.NoError(t, <-served)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = Dial(ctx, lis.Addr().String(), WithMode(ModeTCP))
	require.ErrorIs(t, err, ErrNotGDRPC)
	require.ErrorContains(t, err, "the peer speaks HTTP/2, as a gRPC server on a plain listener does")
}

// deadlineConn records the last deadline set on it; past is closed once a
// deadline in the past was set.
type deadlineConn struct {
	mu       sync.Mutex
	dl       time.Time
	past     chan struct{}
	pastOnce sync.Once
}

func (c *deadlineConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dl = t
	if !t.IsZero() && t.Before(time.Now()) {
		c.pastOnce.Do(func() { close(c.past) })
	}
	return nil
}

// A conn whose handshake's context ended just before its deadline was
// unbound (a session set up right at its deadline, which goes on) is left
// with no deadline: the context's end, which sets a past one on another
// goroutine, is waited for.
func TestUnbindAfterContextEnd(t *testing.T) {
	for i := range 500 {
		c := &deadlineConn{past: make(chan struct{})}
		ctx, cancel := context.WithCancel(context.Background())
		unbind := bindDeadline(ctx, c)
		cancel()
		unbind()
		unbind() // a second call undoes nothing more, and does not wait
		<-c.past // the context's end set its deadline, before or after unbind
		c.mu.Lock()
		dl := c.dl
		c.mu.Unlock()
		require.True(t, dl.IsZero(), "round %d: the conn kept the deadline %v", i, dl)
	}
}
