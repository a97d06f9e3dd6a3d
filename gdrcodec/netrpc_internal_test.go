package gdrcodec

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/rpc"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// hookConn is a connection whose reads come from a pipe the test writes and
// whose writes run onWrite, then fail with fail or succeed. It belongs to a
// session that negotiated the codec, as a gdrpc conn does: payloads go
// out-of-band over it. The rest of net.Conn (addresses, deadlines) is an
// unused pipe's.
type hookConn struct {
	net.Conn
	session *transport.Session
	pr      *io.PipeReader
	pw      *io.PipeWriter
	onWrite func()
	fail    error
	// reading, when set, is sent each Read's buffer size before it blocks.
	reading chan int
}

func newHookConn(t *testing.T) *hookConn {
	pr, pw := io.Pipe()
	t.Cleanup(func() { pw.Close() })
	engine := transport.WithEngine(oob.Engine())
	s, _ := transporttest.PairWith(t, []transport.Option{engine}, []transport.Option{engine})
	addrs, other := net.Pipe()
	t.Cleanup(func() { addrs.Close(); other.Close() })
	return &hookConn{Conn: addrs, session: s, pr: pr, pw: pw}
}

func (c *hookConn) Session() *transport.Session { return c.session }

func (c *hookConn) Read(p []byte) (int, error) {
	if c.reading != nil {
		c.reading <- len(p)
	}
	return c.pr.Read(p)
}

func (c *hookConn) Write(p []byte) (int, error) {
	if c.onWrite != nil {
		c.onWrite()
	}
	if c.fail != nil {
		return 0, c.fail
	}
	return len(p), nil
}

func (c *hookConn) Close() error { return nil }

// frame is one header frame (seq, method, error) followed by a body frame.
func frame(seq uint64, method, errMsg string, body []byte) []byte {
	hdr := binary.AppendUvarint(nil, seq)
	hdr = binary.AppendUvarint(hdr, uint64(len(method)))
	hdr = append(hdr, method...)
	hdr = binary.AppendUvarint(hdr, uint64(len(errMsg)))
	hdr = append(hdr, errMsg...)
	f := binary.AppendUvarint(nil, uint64(len(hdr)))
	f = append(f, hdr...)
	f = binary.AppendUvarint(f, uint64(len(body)))
	return append(f, body...)
}

// outOfBand is a message whose 4 KiB host payload goes out-of-band.
func outOfBand() *gdrv1.DeviceBuffer {
	b := devicebuf.HostFromBytes(make([]byte, 4096))
	defer b.Release()
	return New(b)
}

// heldPayloads is how many payloads the hold of seq keeps offered.
func heldPayloads(c *clientCodec, seq uint64) int {
	c.mu.Lock()
	h := c.held[seq]
	c.mu.Unlock()
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, t := range h.tokens {
		if oob.Offered(t) {
			n++
		}
	}
	return n
}

func heldSeqs(c *clientCodec) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.held)
}

// A reply read before WriteRequest returned releases the request's payloads
// all the same.
func TestNetRPCReplyBeforeWriteReturns(t *testing.T) {
	base := oob.ReadStats().Offered
	conn := newHookConn(t)
	c := NewClientCodec(conn, WithEagerThreshold(-1)).(*clientCodec)
	defer c.Close()
	read := make(chan error, 1)
	go func() {
		var r rpc.Response
		err := c.ReadResponseHeader(&r)
		if err == nil {
			err = c.ReadResponseBody(nil)
		}
		read <- err
	}()
	var once sync.Once
	conn.onWrite = func() {
		once.Do(func() {
			// The server answers before the request's write returns.
			go conn.pw.Write(frame(1, "S.M", "", nil))
			require.NoError(t, <-read)
		})
	}
	body := outOfBand()
	require.NoError(t, c.WriteRequest(&rpc.Request{Seq: 1, ServiceMethod: "S.M"}, body))
	ReleaseAll(body)
	require.Zero(t, heldSeqs(c), "the answered request is still held")
	require.Equal(t, base, oob.ReadStats().Offered, "the answered request's payload is still in the outbox")
}

// A request holds its payloads until its reply; one that has none is not
// held at all, and held requests whose payloads all left the outbox (their
// lease ended: a server that answered a seq before its request was
// written, or never) are forgotten once many are held.
func TestNetRPCHeldRequestsPruned(t *testing.T) {
	conn := newHookConn(t)
	c := NewClientCodec(conn, WithEagerThreshold(-1)).(*clientCodec)
	defer c.Close()
	require.NoError(t, c.WriteRequest(&rpc.Request{Seq: 0, ServiceMethod: "S.M"}, &gdrv1.DeviceBuffer{}))
	require.Zero(t, heldSeqs(c), "a request without payloads is held")
	var expired []oob.Token
	for seq := uint64(1); seq < maxNoted; seq++ {
		body := outOfBand()
		require.NoError(t, c.WriteRequest(&rpc.Request{Seq: seq, ServiceMethod: "S.M"}, body))
		ReleaseAll(body)
		c.mu.Lock()
		expired = append(expired, c.held[seq].tokens...)
		c.mu.Unlock()
	}
	require.Equal(t, maxNoted-1, heldSeqs(c))
	for _, tok := range expired {
		oob.Withdraw(tok) // as their lease ending does
	}
	body := outOfBand()
	defer ReleaseAll(body)
	require.NoError(t, c.WriteRequest(&rpc.Request{Seq: maxNoted, ServiceMethod: "S.M"}, body))
	require.Equal(t, 1, heldSeqs(c), "requests whose payloads left the outbox are still held")
	require.Equal(t, 1, heldPayloads(c, maxNoted))
}

// net/rpc's Client.Close does not wait for a request being written: what
// the request offered leaves the outbox with Close, and a request written
// after Close fails.
func TestNetRPCCloseDuringWrite(t *testing.T) {
	base := oob.ReadStats().Offered
	conn := newHookConn(t)
	c := NewClientCodec(conn, WithEagerThreshold(-1)).(*clientCodec)
	conn.onWrite = func() { require.NoError(t, c.Close()) }
	body := outOfBand()
	defer ReleaseAll(body)
	require.NoError(t, c.WriteRequest(&rpc.Request{Seq: 1, ServiceMethod: "S.M"}, body))
	require.Zero(t, heldSeqs(c))
	require.Equal(t, base, oob.ReadStats().Offered, "a payload outlived Close")

	err := c.WriteRequest(&rpc.Request{Seq: 2, ServiceMethod: "S.M"}, body)
	require.ErrorIs(t, err, net.ErrClosed)
	require.Zero(t, heldSeqs(c))
	require.Equal(t, base, oob.ReadStats().Offered, "a request written after Close offered its payload")
}

// One message sent by two client codecs at once is held by each of them
// for its own request.
func TestNetRPCSameMessageTwoCodecs(t *testing.T) {
	base := oob.ReadStats().Offered
	for range 50 {
		a := NewClientCodec(newHookConn(t), WithEagerThreshold(-1)).(*clientCodec)
		b := NewClientCodec(newHookConn(t), WithEagerThreshold(-1)).(*clientCodec)
		body := outOfBand()
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i, c := range []*clientCodec{a, b} {
			wg.Go(func() { errs[i] = c.WriteRequest(&rpc.Request{Seq: 1, ServiceMethod: "S.M"}, body) })
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs...))
		require.Equal(t, 1, heldPayloads(a, 1), "codec A's request")
		require.Equal(t, 1, heldPayloads(b, 1), "codec B's request")
		require.NoError(t, a.Close())
		require.NoError(t, b.Close())
		ReleaseAll(body)
	}
	require.Equal(t, base, oob.ReadStats().Offered)
}

// A client codec refuses a second request with the seq of one not answered
// yet: the first reply would release both.
func TestNetRPCClientDuplicateSeq(t *testing.T) {
	c := NewClientCodec(newHookConn(t), WithEagerThreshold(-1)).(*clientCodec)
	defer c.Close()
	body := outOfBand()
	defer ReleaseAll(body)
	require.NoError(t, c.WriteRequest(&rpc.Request{Seq: 3, ServiceMethod: "S.M"}, body))
	require.ErrorContains(t, c.WriteRequest(&rpc.Request{Seq: 3, ServiceMethod: "S.M"}, body), "seq 3")
	require.Equal(t, 1, heldPayloads(c, 3), "the first request's payload")
}

// A reply whose write fails takes its payloads out of the outbox and
// releases its buffers: nobody will pull them.
func TestNetRPCReplyWriteFails(t *testing.T) {
	base := oob.ReadStats().Offered
	conn := newHookConn(t)
	conn.fail = errors.New("connection broken")
	s := NewServerCodec(conn, WithEagerThreshold(-1))
	defer s.Close()
	body := outOfBand()
	buf, ok := Buffer(body)
	require.True(t, ok)
	buf.Retain() // this test's reference, to see the others go
	require.ErrorContains(t, s.WriteResponse(&rpc.Response{Seq: 1, ServiceMethod: "S.M"}, body), "connection broken")
	require.Equal(t, base, oob.ReadStats().Offered, "the unsent reply's payload is still offered")
	buf.Release()
	require.True(t, buf.Released(), "the unsent reply's buffer is still referenced")
}

// A peer that announces a large frame and stalls gets no memory for it
// before its bytes arrive; a header frame over its bound is refused at once.
func TestNetRPCFrameBounds(t *testing.T) {
	conn := newHookConn(t)
	conn.reading = make(chan int, 16)
	s := NewServerCodec(conn, WithNetRPCMaxBody(64<<20))
	defer s.Close()
	read := make(chan error, 1)
	go func() {
		var r rpc.Request
		err := s.ReadRequestHeader(&r)
		if err == nil {
			err = s.ReadRequestBody(&gdrv1.DeviceBuffer{})
		}
		read <- err
	}()
	<-conn.reading // the header's first read
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	hdr := frame(1, "S.M", "", nil)
	hdr = hdr[:len(hdr)-1] // the empty body's length: announce 60 MiB instead
	go conn.pw.Write(append(hdr, binary.AppendUvarint(nil, 60<<20)...))
	<-conn.reading // the body's read, its bytes not sent
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(4<<20), "memory taken for a body whose bytes did not arrive")
	require.NoError(t, conn.pw.CloseWithError(io.EOF))
	require.ErrorIs(t, <-read, io.ErrUnexpectedEOF)

	conn = newHookConn(t)
	s = NewServerCodec(conn)
	defer s.Close()
	go conn.pw.Write(binary.AppendUvarint(nil, 1<<20))
	var r rpc.Request
	require.ErrorContains(t, s.ReadRequestHeader(&r), "at most 65536")
}

// An error message too long for a header arrives cut short; a method name
// too long is an error on the client.
func TestNetRPCLongHeaders(t *testing.T) {
	pr, pw := net.Pipe()
	defer pr.Close()
	s := NewServerCodec(pw)
	defer s.Close()
	c := NewClientCodec(pr).(*clientCodec)
	long := strings.Repeat("é", maxNetRPCHeader) // two bytes a rune
	written := make(chan error, 1)
	go func() { written <- s.WriteResponse(&rpc.Response{Seq: 9, ServiceMethod: "S.M", Error: long}, nil) }()
	var r rpc.Response
	require.NoError(t, c.ReadResponseHeader(&r))
	require.NoError(t, c.ReadResponseBody(nil))
	require.NoError(t, <-written)
	require.Equal(t, uint64(9), r.Seq)
	require.True(t, strings.HasPrefix(long, r.Error), "the error is not a prefix of the one sent")
	require.Greater(t, len(r.Error), maxNetRPCHeader/2)
	require.True(t, strings.HasSuffix(r.Error, "é"), "the error was cut inside a rune")

	// Refused before anything is written: were it written, nobody reads it.
	require.NoError(t, pr.SetWriteDeadline(time.Now().Add(10*time.Second)))
	err := c.WriteRequest(&rpc.Request{Seq: 1, ServiceMethod: strings.Repeat("m", maxNetRPCHeader)}, nil)
	require.ErrorContains(t, err, "method name")
	require.Zero(t, heldSeqs(c))
}

// countingAllocator counts what it is asked for.
type countingAllocator struct{ allocs atomic.Int64 }

func (a *countingAllocator) Kind() devicebuf.Kind { return devicebuf.Host }
func (a *countingAllocator) Device() int          { return -1 }
func (a *countingAllocator) Alloc(n int) (*devicebuf.Buffer, error) {
	a.allocs.Add(1)
	return devicebuf.HostFromBytes(make([]byte, n)), nil
}

// Over a connection that is no gdrpc session (a plain peer the listener
// handed over, a pipe), a body that names a payload by owner and token is
// refused before anything is allocated or pulled for it, and the codecs'
// own payloads travel inline.
func TestNetRPCPlainConnection(t *testing.T) {
	a := &countingAllocator{}
	pr, pw := net.Pipe()
	defer pr.Close()
	s := NewServerCodec(pw, WithReceiveAllocator(a))
	defer s.Close()
	// The descriptor names an owner this process has a session to: pulled on
	// the plain peer's word, it would be allocated for and asked for.
	owner := transport.NewIdentity()
	engine := transport.WithEngine(oob.Engine())
	transporttest.PairWith(t, []transport.Option{transport.WithIdentity(owner), engine}, []transport.Option{engine})
	id := owner.ID()
	var token [16]byte
	_, _ = rand.Read(token[:])
	forged, err := proto.Marshal(&gdrv1.DeviceBuffer{Owner: id[:], Token: token[:], Length: 1 << 20, Kind: gdrv1.Kind_KIND_HOST})
	require.NoError(t, err)
	go func() { _, _ = pr.Write(frame(1, "S.M", "", forged)) }()
	var r rpc.Request
	require.NoError(t, s.ReadRequestHeader(&r))
	err = s.ReadRequestBody(&gdrv1.DeviceBuffer{})
	require.Error(t, err, "a plain peer's descriptor")
	require.Zero(t, a.allocs.Load(), "allocated for a plain peer's descriptor")

	// The other way, a payload goes inline: the plain client reads it whole.
	c := NewClientCodec(pr).(*clientCodec)
	base := oob.ReadStats().Offered
	body := outOfBand()
	defer ReleaseAll(body)
	written := make(chan error, 1)
	go func() { written <- s.WriteResponse(&rpc.Response{Seq: 1, ServiceMethod: "S.M"}, body) }()
	var resp rpc.Response
	require.NoError(t, c.ReadResponseHeader(&resp))
	var got gdrv1.DeviceBuffer
	require.NoError(t, c.ReadResponseBody(&got))
	require.NoError(t, <-written)
	require.Equal(t, base, oob.ReadStats().Offered, "a payload offered over a plain connection")
	b, ok := Buffer(&got)
	require.True(t, ok)
	require.Equal(t, 4096, b.Len())
	ReleaseAll(&got)
}

type countingEcho struct{ calls *atomic.Int64 }

func (s countingEcho) Echo(_, _ *gdrv1.DeviceBuffer) error { s.calls.Add(1); return nil }

// A body frame refused for its length, before its bytes were read, ends the
// connection: net/rpc goes on reading after a body's error, and what came
// next would be read from inside the refused body, bytes a client forwarded
// taken for requests of their own. The same for a body the server skips (an
// unknown method) and a client reading replies.
func TestNetRPCRefusedFrameEndsReading(t *testing.T) {
	oversized := func(seq uint64, method string) []byte {
		f := frame(seq, method, "", nil)
		f = f[:len(f)-1] // the empty body's length
		f = binary.AppendUvarint(f, DefaultNetRPCMaxBody+1)
		return append(f, frame(seq+1, "Svc.Echo", "", nil)...) // inside the body
	}
	for _, method := range []string{"Svc.Echo", "Svc.Missing"} {
		t.Run(method, func(t *testing.T) {
			var calls atomic.Int64
			srv := rpc.NewServer()
			require.NoError(t, srv.RegisterName("Svc", countingEcho{&calls}))
			cli, sv := net.Pipe()
			defer cli.Close()
			served := make(chan struct{})
			go func() { srv.ServeCodec(NewServerCodec(sv)); close(served) }()
			go func() { _, _ = cli.Write(oversized(1, method)) }()
			c := NewClientCodec(cli)
			require.NoError(t, cli.SetReadDeadline(time.Now().Add(20*time.Second)))
			var r rpc.Response
			require.NoError(t, c.ReadResponseHeader(&r))
			require.Equal(t, uint64(1), r.Seq)
			require.NotEmpty(t, r.Error, "the refused request's reply")
			require.NoError(t, c.ReadResponseBody(nil))
			r = rpc.Response{}
			require.Error(t, c.ReadResponseHeader(&r), "a reply to bytes inside the refused body")
			<-served
			require.Zero(t, calls.Load(), "a request read from inside a refused body ran")
		})
	}

	t.Run("client", func(t *testing.T) {
		cli, sv := net.Pipe()
		defer cli.Close()
		defer sv.Close()
		go func() { _, _ = sv.Write(oversized(1, "")) }()
		c := NewClientCodec(cli)
		var r rpc.Response
		require.NoError(t, c.ReadResponseHeader(&r))
		err := c.ReadResponseBody(nil)
		require.ErrorContains(t, err, "at most")
		r = rpc.Response{}
		require.ErrorIs(t, c.ReadResponseHeader(&r), err, "the reading stays lost")
	})
}

// A body too large for the peer to take is refused before anything is
// written: the peer would end the connection.
func TestNetRPCOversizedBodyNotWritten(t *testing.T) {
	c := newHookConn(t)
	var wrote atomic.Bool
	c.onWrite = func() { wrote.Store(true) }
	cc := NewClientCodec(c, WithEagerThreshold(1<<30)).(*clientCodec) // the payload goes inline
	big := &gdrv1.DeviceBuffer{}
	Attach(big, devicebuf.HostFromBytes(make([]byte, DefaultNetRPCMaxBody+1)))
	defer ReleaseAll(big)
	err := cc.WriteRequest(&rpc.Request{Seq: 1, ServiceMethod: "Svc.Echo"}, big)
	require.ErrorContains(t, err, "at most")
	require.False(t, wrote.Load(), "bytes of a body the peer would refuse were written")
	cc.mu.Lock()
	require.Empty(t, cc.held, "a request never sent holds nothing")
	cc.mu.Unlock()
}

// blockingEcho's calls wait for release; each notes how many requests of the
// connection waited for their replies when it started.
type blockingEcho struct {
	codec   *serverCodec
	release chan struct{}
	started atomic.Int64
	most    atomic.Int64
	pulled  atomic.Int64 // requests whose 1 MiB payload was attached, all its bytes alike
}

func (s *blockingEcho) Echo(in, _ *gdrv1.DeviceBuffer) error {
	if b, ok := attachedBuffer(in); ok && b.Len() == 1<<20 {
		if got, err := b.HostBytes(); err == nil && bytes.Equal(got, bytes.Repeat(got[:1], 1<<20)) {
			s.pulled.Add(1)
		}
	}
	s.codec.mu.Lock()
	n := int64(len(s.codec.args))
	s.codec.mu.Unlock()
	for m := s.most.Load(); n > m && !s.most.CompareAndSwap(m, n); m = s.most.Load() {
	}
	s.started.Add(1)
	<-s.release
	return nil
}

// blockingServer serves blockingEcho as "Svc" over a pipe with a server
// codec made with opts, and returns a client over the pipe's other end;
// served is closed once the server's loop returned.
func blockingServer(t *testing.T, opts ...Option) (sc *serverCodec, svc *blockingEcho, client *rpc.Client, served chan struct{}) {
	t.Helper()
	cli, sv := net.Pipe()
	return blockingServerOver(t, cli, sv, opts...)
}

// blockingServerOver is blockingServer over the conns cli and sv.
func blockingServerOver(t *testing.T, cli, sv net.Conn, opts ...Option) (sc *serverCodec, svc *blockingEcho, client *rpc.Client, served chan struct{}) {
	t.Helper()
	t.Cleanup(func() { cli.Close() })
	sc = NewServerCodec(sv, opts...).(*serverCodec)
	svc = &blockingEcho{codec: sc, release: make(chan struct{})}
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Svc", svc))
	served = make(chan struct{})
	go func() { srv.ServeCodec(sc); close(served) }()
	return sc, svc, rpc.NewClientWithCodec(NewClientCodec(cli)), served
}

// A client that pipelines requests and reads no reply gets at most
// DefaultNetRPCPending of them read and served at once; the rest wait in the
// connection, and all are answered once replies go out.
func TestNetRPCPendingBounded(t *testing.T) {
	_, svc, client, served := blockingServer(t)
	const n = DefaultNetRPCPending + 16
	done := make(chan *rpc.Call, n)
	for range n {
		go client.Go("Svc.Echo", &gdrv1.DeviceBuffer{}, &gdrv1.DeviceBuffer{}, done)
	}
	require.Eventually(t, func() bool { return svc.started.Load() >= DefaultNetRPCPending }, 20*time.Second, time.Millisecond)
	close(svc.release)
	for range n {
		require.NoError(t, (<-done).Error)
	}
	require.Equal(t, int64(n), svc.started.Load())
	require.LessOrEqual(t, svc.most.Load(), int64(DefaultNetRPCPending), "requests read while as many waited for replies")
	require.NoError(t, client.Close())
	<-served
}

// A connection's pending requests are bounded in bytes too, their bodies
// and the payloads they named out-of-band (pulled while the body was read):
// with 1 MiB payloads, inline over a pipe (no gdrpc session) or pulled over a
// session, under a 3.5 MiB bound, at most four requests wait for their
// replies at once; all are answered once the handlers return.
func TestNetRPCPendingBytesBounded(t *testing.T) {
	for _, tc := range []struct {
		name   string
		conns  func(t *testing.T) (cli, sv net.Conn)
		pulled bool
	}{
		{"inline", func(*testing.T) (net.Conn, net.Conn) { return net.Pipe() }, false},
		{"pulled", func(t *testing.T) (net.Conn, net.Conn) {
			engine := transport.WithEngine(oob.Engine())
			cs, ss := transporttest.PairWith(t, []transport.Option{engine}, []transport.Option{engine})
			return transporttest.Conns(t, cs, ss)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cli, sv := tc.conns(t)
			sc, svc, client, served := blockingServerOver(t, cli, sv, WithNetRPCPendingBytes(3<<20+1<<19))
			const n = 8
			done := make(chan *rpc.Call, n)
			for i := range n {
				b := devicebuf.HostFromBytes(bytes.Repeat([]byte{byte(i)}, 1<<20))
				in := New(b)
				b.Release()
				defer ReleaseAll(in)
				go client.Go("Svc.Echo", in, &gdrv1.DeviceBuffer{}, done) // its write waits while the server reads no request
			}
			require.Eventually(t, func() bool { return svc.started.Load() >= 4 }, 20*time.Second, time.Millisecond)
			sc.mu.Lock()
			held := sc.held
			sc.mu.Unlock()
			require.Greater(t, held, int64(4<<20), "the requests held")
			close(svc.release)
			for range n {
				require.NoError(t, (<-done).Error)
			}
			require.Equal(t, int64(n), svc.started.Load())
			if tc.pulled {
				require.Equal(t, int64(n), svc.pulled.Load(), "every request's payload arrived out-of-band, byte for byte")
			}
			require.LessOrEqual(t, svc.most.Load(), int64(4), "requests read while they held the bound")
			require.Eventually(t, func() bool { // the last reply's bookkeeping follows its write
				sc.mu.Lock()
				defer sc.mu.Unlock()
				return sc.held == 0 && len(sc.sizes) == 0
			}, 10*time.Second, time.Millisecond, "requests still counted once every reply went")
			require.NoError(t, client.Close())
			<-served
		})
	}
}

type bigReply struct{}

func (bigReply) Get(_, out *gdrv1.DeviceBuffer) error {
	b := devicebuf.HostFromBytes(make([]byte, DefaultNetRPCMaxBody+1))
	Attach(out, b)
	b.Release()
	return nil
}

// A reply the codec refuses to write (a body over 4 MiB, its payload
// inline) reaches its caller as an error: net/rpc drops a reply's write
// error, and the call would wait for ever.
func TestNetRPCUnsendableReplyAnswered(t *testing.T) {
	cli, sv := net.Pipe()
	defer cli.Close()
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Svc", bigReply{}))
	go srv.ServeCodec(NewServerCodec(sv, WithEagerThreshold(1<<30)))
	client := rpc.NewClientWithCodec(NewClientCodec(cli))
	defer client.Close()
	var out gdrv1.DeviceBuffer
	call := client.Go("Svc.Get", &gdrv1.DeviceBuffer{}, &out, nil)
	select {
	case <-call.Done:
	case <-time.After(20 * time.Second):
		t.Fatal("the call was never answered")
	}
	require.ErrorContains(t, call.Error, "the reply could not be sent")
	require.ErrorContains(t, client.Call("Svc.Get", &gdrv1.DeviceBuffer{}, &out), "the reply could not be sent", "the connection still serves")
}

type longPoll struct{ release chan struct{} }

func (p *longPoll) Wait(_, _ *gdrv1.DeviceBuffer) error   { <-p.release; return nil }
func (p *longPoll) Notify(_, _ *gdrv1.DeviceBuffer) error { close(p.release); return nil }

// A service whose calls wait for a later call of the same connection sets
// the bound of pending requests above the calls it keeps waiting.
func TestNetRPCPendingOption(t *testing.T) {
	const waits = 8
	cli, sv := net.Pipe()
	defer cli.Close()
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Svc", &longPoll{release: make(chan struct{})}))
	go srv.ServeCodec(NewServerCodec(sv, WithNetRPCPending(waits+1)))
	client := rpc.NewClientWithCodec(NewClientCodec(cli))
	defer client.Close()
	done := make(chan *rpc.Call, waits)
	for range waits {
		client.Go("Svc.Wait", &gdrv1.DeviceBuffer{}, &gdrv1.DeviceBuffer{}, done)
	}
	require.NoError(t, client.Call("Svc.Notify", &gdrv1.DeviceBuffer{}, &gdrv1.DeviceBuffer{}))
	for range waits {
		require.NoError(t, (<-done).Error)
	}
}

// A request whose method name fills its header frame still gets its error
// reply ("can't find service"), the name it echoes cut: net/rpc drops a
// reply's write error, and its caller would wait for ever.
func TestNetRPCLongMethodAnswered(t *testing.T) {
	cli, sv := net.Pipe()
	defer cli.Close()
	go rpc.NewServer().ServeCodec(NewServerCodec(sv))
	method := "Svc." + strings.Repeat("x", maxNetRPCHeader-16)
	require.Greater(t, len(method), headerRoom, "a name the reply has no room for")
	go func() { _, _ = cli.Write(frame(7, method, "", nil)) }()
	require.NoError(t, cli.SetReadDeadline(time.Now().Add(20*time.Second)))
	c := NewClientCodec(cli)
	var r rpc.Response
	require.NoError(t, c.ReadResponseHeader(&r))
	require.NoError(t, c.ReadResponseBody(nil))
	require.Equal(t, uint64(7), r.Seq)
	require.Contains(t, r.Error, "can't find")
	require.True(t, strings.HasPrefix(method, r.ServiceMethod))
}

type echoes struct{}

func (echoes) Echo(in, out *gdrv1.DeviceBuffer) error { return nil }

// A client that sends requests and stops reading replies holds a reply's
// write no longer than the write timeout: the connection then ends, every
// request waiting for its reply is let go, and the server's loop returns.
func TestNetRPCWriteTimeoutEndsConnection(t *testing.T) {
	cli, sv := net.Pipe() // a write waits for the peer's read
	defer cli.Close()
	sc := NewServerCodec(sv, WithNetRPCWriteTimeout(100*time.Millisecond)).(*serverCodec)
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Svc", echoes{}))
	served := make(chan struct{})
	go func() { srv.ServeCodec(sc); close(served) }()
	cc := NewClientCodec(cli)
	for seq := range uint64(4) {
		require.NoError(t, cc.WriteRequest(&rpc.Request{Seq: seq, ServiceMethod: "Svc.Echo"}, &gdrv1.DeviceBuffer{}))
	}
	select {
	case <-served:
	case <-time.After(20 * time.Second):
		t.Fatal("the server still serves a client that reads nothing")
	}
	sc.mu.Lock()
	require.Empty(t, sc.args, "requests kept")
	sc.mu.Unlock()
	var r rpc.Response
	require.Error(t, cc.ReadResponseHeader(&r), "the connection ended")
}

// deadlineLog is a connection that records the write deadline each Write
// found, and the length of each Write.
type deadlineLog struct {
	net.Conn
	deadline time.Time
	writes   []int
	at       []time.Time
}

func (c *deadlineLog) SetWriteDeadline(t time.Time) error { c.deadline = t; return nil }
func (c *deadlineLog) Write(p []byte) (int, error) {
	c.writes, c.at = append(c.writes, len(p)), append(c.at, c.deadline)
	return len(p), nil
}

// A write's deadline bounds how long the peer may read none of it, not how
// long the whole write takes: a progressWriter writes in pieces, each with
// a deadline of its own. A server codec bounds its writes by default, a
// client codec only when told to.
func TestNetRPCWriteDeadlinePerPiece(t *testing.T) {
	conn := &deadlineLog{}
	w := &progressWriter{nc: conn, idle: time.Minute}
	before := time.Now()
	n, err := w.Write(make([]byte, 2*progressPiece+100))
	require.NoError(t, err)
	require.Equal(t, 2*progressPiece+100, n)
	require.Equal(t, []int{progressPiece, progressPiece, 100}, conn.writes)
	for i, dl := range conn.at {
		require.False(t, dl.Before(before.Add(time.Minute)), "piece %d's deadline", i)
		if i > 0 {
			require.False(t, dl.Before(conn.at[i-1]), "piece %d's deadline is earlier than the one before", i)
		}
	}

	cli, sv := net.Pipe()
	defer cli.Close()
	defer sv.Close()
	require.Equal(t, DefaultNetRPCWriteTimeout, NewServerCodec(sv).(*serverCodec).idle)
	require.Zero(t, NewClientCodec(cli).(*clientCodec).idle)
	require.Equal(t, time.Second, NewClientCodec(cli, WithNetRPCWriteTimeout(time.Second)).(*clientCodec).idle)
	require.Zero(t, NewServerCodec(sv, WithNetRPCWriteTimeout(-1)).(*serverCodec).idle)
}

// A body of empty DeviceBuffers (two bytes each on the wire, a couple of
// hundred bytes each once decoded) is refused before it is decoded: the
// decode of a frame of them would allocate a hundred times its size before the walk
// after it counted MaxPayloads.
func TestNetRPCPayloadsCountedBeforeDecode(t *testing.T) {
	const n = 1 << 20
	body := bytes.Repeat([]byte{0x2a, 0x00}, n/2) // Tensor.parts (5), an empty element each
	c := NewServerCodec(readOnly{bytes.NewReader(frame(1, "Svc.M", "", body))}).(*serverCodec)
	defer c.Close()
	var r rpc.Request
	require.NoError(t, c.ReadRequestHeader(&r))
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err := c.ReadRequestBody(&tensorpb.Tensor{})
	runtime.ReadMemStats(&after)
	require.ErrorContains(t, err, "more than 4096 payloads")
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(4*n), "bytes allocated decoding a %d-byte body", n)
}

type copier struct{}

func (copier) Copy(in, out *gdrv1.DeviceBuffer) error {
	b, ok := Buffer(in)
	if !ok {
		return errors.New("no payload arrived")
	}
	Attach(out, b)
	return nil
}

// A body over DefaultNetRPCMaxBody (payloads inline, as over a conn that is
// no gdrpc session) goes where both ends raised the bound
// (WithNetRPCMaxBody), and is refused before it is written where the
// sender's is the default.
func TestNetRPCMaxBody(t *testing.T) {
	const n = DefaultNetRPCMaxBody + 1<<20
	payload := make([]byte, n)
	_, _ = rand.Read(payload)
	cli, sv := net.Pipe()
	defer cli.Close()
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Svc", copier{}))
	raised := []Option{WithEagerThreshold(1 << 30), WithNetRPCMaxBody(2 * n)}
	go srv.ServeCodec(NewServerCodec(sv, raised...))
	client := rpc.NewClientWithCodec(NewClientCodec(cli, raised...))
	defer client.Close()
	src := devicebuf.HostFromBytes(payload)
	in := New(src)
	src.Release()
	defer ReleaseAll(in)
	var out gdrv1.DeviceBuffer
	require.NoError(t, client.Call("Svc.Copy", in, &out))
	b, ok := Buffer(&out)
	require.True(t, ok)
	got, err := b.HostBytes()
	require.NoError(t, err)
	require.True(t, bytes.Equal(payload, got), "the payload arrived changed")
	ReleaseAll(&out)

	require.Equal(t, maxNetRPCFrame, newOptions([]Option{WithNetRPCMaxBody(-1)}).netRPCMaxBody(), "n < 0: the framing's bound")
	require.Equal(t, maxNetRPCFrame, newOptions([]Option{WithNetRPCMaxBody(2 << 30)}).netRPCMaxBody())
	require.Equal(t, DefaultNetRPCMaxBody, newOptions(nil).netRPCMaxBody())

	c := NewClientCodec(newHookConn(t), WithEagerThreshold(1<<30))
	defer c.Close()
	require.ErrorContains(t, c.WriteRequest(&rpc.Request{Seq: 1, ServiceMethod: "Svc.Copy"}, in), fmt.Sprintf("at most %d", DefaultNetRPCMaxBody))
}

// A pending request counts what it holds once decoded against
// WithNetRPCPendingBytes, not its body alone: a packed list of one-byte
// varints takes eight times its body, a list of empty messages far more.
func TestNetRPCPendingCountsDecoded(t *testing.T) {
	const n = 1 << 20
	for _, tc := range []struct {
		name  string
		body  []byte
		arg   func() proto.Message
		least int64
	}{
		{"packed", append(append([]byte{0x12}, binary.AppendUvarint(nil, n)...), bytes.Repeat([]byte{1}, n)...), // Tensor.shape
			func() proto.Message { return &tensorpb.Tensor{} }, 8 * n},
		{"empty messages", bytes.Repeat([]byte{0x0a, 0x00}, n/2), // ListValue.values
			func() proto.Message { return &structpb.ListValue{} }, 16 * n},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := NewServerCodec(readOnly{bytes.NewReader(frame(1, "Svc.M", "", tc.body))}).(*serverCodec)
			defer c.Close()
			var r rpc.Request
			require.NoError(t, c.ReadRequestHeader(&r))
			require.NoError(t, c.ReadRequestBody(tc.arg()))
			c.mu.Lock()
			held := c.held
			c.mu.Unlock()
			t.Logf("counted %d bytes for a %d-byte body", held, len(tc.body))
			require.GreaterOrEqual(t, held, tc.least, "what the pending bound counts for a %d-byte body", len(tc.body))
		})
	}
}

// A reply that cannot be read (the server went away, or sent a body that
// does not parse) ends net/rpc's reading: it fails every pending call but
// closes the codec only when the application closes the Client. The
// requests' payloads are given back then, not at Close or the lease's end,
// and a request written after it files nothing.
func TestNetRPCReadingEndedReleasesRequests(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(c *hookConn)
	}{
		{"server gone", func(c *hookConn) { c.pw.CloseWithError(io.EOF) }},
		{"malformed body", func(c *hookConn) {
			go c.pw.Write(frame(1, "S.M", "", []byte{0x0a, 0xff})) // a field longer than the body
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := oob.ReadStats().Offered
			conn := newHookConn(t)
			client := rpc.NewClientWithCodec(NewClientCodec(conn, WithEagerThreshold(-1)))
			defer client.Close()
			var calls []*rpc.Call
			for range 2 {
				body := outOfBand()
				calls = append(calls, client.Go("S.M", body, &gdrv1.DeviceBuffer{}, nil))
				ReleaseAll(body)
			}
			require.Equal(t, base+2, oob.ReadStats().Offered, "both requests' payloads offered")
			tc.end(conn)
			for _, call := range calls {
				select {
				case <-call.Done:
					require.Error(t, call.Error)
				case <-time.After(10 * time.Second):
					t.Fatal("a call did not fail")
				}
			}
			require.Equal(t, base, oob.ReadStats().Offered, "failed calls' payloads still offered: %+v", oob.ReadStats())

			codec := NewClientCodec(newHookConn(t), WithEagerThreshold(-1)).(*clientCodec)
			defer codec.Close()
			codec.readingEnded()
			body := outOfBand()
			defer ReleaseAll(body)
			require.ErrorContains(t, codec.WriteRequest(&rpc.Request{Seq: 9, ServiceMethod: "S.M"}, body), "no longer be read")
			require.Zero(t, heldPayloads(codec, 9))
			require.Equal(t, base, oob.ReadStats().Offered)
		})
	}
}
