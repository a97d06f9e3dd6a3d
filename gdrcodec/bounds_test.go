package gdrcodec_test

import (
	"context"
	"crypto/rand"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"
	"weak"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// markedPrefix is the length of what precedes a descriptor in a marked bytes
// field: the magic and the marker byte.
const markedPrefix = 9

// forgeClaim returns a request body whose payload (a DeviceBuffer, or the
// marked bytes field when blob) claims length bytes owned by owner, under a
// token nobody holds.
func forgeClaim(t *testing.T, owner transport.ID, length uint64, blob bool) []byte {
	t.Helper()
	real := &tensorpb.Tensor{Blob: pattern(64<<10, 1)}
	if !blob {
		src := devicebuf.HostFromBytes(pattern(64<<10, 1))
		real = &tensorpb.Tensor{Data: gdrcodec.New(src)}
		src.Release()
	}
	body, err := gdrcodec.MarshalForTest(real)
	require.NoError(t, err)
	gdrcodec.ReleaseAll(real)
	var m tensorpb.Tensor
	require.NoError(t, proto.Unmarshal(body, &m))
	db := m.Data
	if blob {
		db = &gdrv1.DeviceBuffer{}
		require.NoError(t, proto.Unmarshal(m.Blob[markedPrefix:], db))
	}
	oob.Withdraw(oob.Token(db.Token))
	db.Owner, db.Length = owner[:], length
	if blob {
		desc, err := proto.Marshal(db)
		require.NoError(t, err)
		m.Blob = append(m.Blob[:markedPrefix:markedPrefix], desc...)
	}
	body, err = proto.Marshal(&m)
	require.NoError(t, err)
	return body
}

// A descriptor claiming more than the limits allow fails with
// ResourceExhausted before anything is allocated, even when its owner is
// connected and would answer.
func TestOversizedClaims(t *testing.T) {
	id := transport.NewIdentity()
	owner := id.ID()
	engine := transport.WithEngine(oob.Engine())
	transporttest.PairWith(t, []transport.Option{transport.WithIdentity(id), engine}, []transport.Option{engine})
	var stranger transport.ID
	rand.Read(stranger[:])
	tests := []struct {
		name   string
		owner  transport.ID
		length uint64
		blob   bool
		limits oob.Limits
		want   codes.Code
	}{
		{name: "bytes field of 16 GiB", owner: owner, length: 16 << 30, blob: true, want: codes.ResourceExhausted},
		{name: "DeviceBuffer of 16 GiB", owner: owner, length: 16 << 30, want: codes.ResourceExhausted},
		{name: "bytes field over the session's budget", owner: owner, length: 64 << 20, blob: true,
			limits: oob.Limits{PullBytes: 1 << 20}, want: codes.ResourceExhausted},
		{name: "bytes field from nobody connected", owner: stranger, length: 64 << 20, blob: true, want: codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			oob.SetTransferConfig(oob.TransferConfig{Limits: tt.limits})
			t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })
			body := forgeClaim(t, tt.owner, tt.length, tt.blob)
			var got tensorpb.Tensor
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			err := gdrcodec.UnmarshalForTest(body, &got)
			runtime.ReadMemStats(&after)
			t.Log(err)
			require.Equal(t, tt.want, status.Code(err), "%v", err)
			require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(16<<20), "bytes allocated while decoding")
			gdrcodec.ReleaseAll(&got)
		})
	}
}

// A 0-byte payload sent out-of-band arrives as an empty buffer.
func TestZeroLengthPayload(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	gdrcodec.Register(gdrcodec.WithEagerThreshold(-1)) // everything out-of-band
	t.Cleanup(func() { gdrcodec.Register() })
	src := devicebuf.HostFromBytes([]byte{})
	req := &tensorpb.Tensor{Name: "empty", Data: gdrcodec.New(src)}
	src.Release()
	defer gdrcodec.ReleaseAll(req)
	got, err := r.client.Echo(context.Background(), req)
	require.NoError(t, err)
	defer gdrcodec.ReleaseAll(got)
	b, ok := gdrcodec.Buffer(got.Data)
	require.True(t, ok, "a buffer is attached")
	require.Zero(t, b.Len())
}

// rawCodec decodes messages as they are on the wire: a client that takes a
// response and never pulls its payloads.
type rawCodec struct{}

func (rawCodec) Name() string { return gdrcodec.Name }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, err := proto.Marshal(v.(proto.Message))
	return mem.BufferSlice{mem.SliceBuffer(b)}, err
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return proto.Unmarshal(data.Materialize(), v.(proto.Message))
}

// Responses a client never pulled leave the server's outbox once the client
// is gone, not at the end of their lease.
func TestUnpulledResponsesAfterDisconnect(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	for seed := range uint32(4) {
		got, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: seed}, grpc.ForceCodecV2(rawCodec{}))
		require.NoError(t, err)
		require.NotEmpty(t, got.Data.GetToken(), "the response carries a descriptor")
	}
	require.Equal(t, 4, oob.ReadStats().Offered, "the unpulled responses")
	require.NoError(t, r.cc.Close())
	require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 5*time.Second, 5*time.Millisecond,
		"%d unpulled responses still held after the client left", oob.ReadStats().Offered)
}

// uploadWatch is a TensorService whose Upload tells the test of each message
// it received.
type uploadWatch struct {
	tensor.Server
	got chan struct{}
}

func (s *uploadWatch) Upload(st tensorpb.TensorService_UploadServer) error {
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return st.SendAndClose(&tensorpb.Summary{})
		}
		if err != nil {
			return err
		}
		gdrcodec.ReleaseAll(m)
		s.got <- struct{}{}
	}
}

// Without a retry policy, a client stream's payload leaves the outbox once
// the server pulled it, while the stream goes on.
func TestStreamPayloadLeavesOncePulled(t *testing.T) {
	srv := &uploadWatch{got: make(chan struct{}, 1)}
	r := newRig(t, transport.ModeTCP, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := r.client.Upload(ctx)
	require.NoError(t, err)
	for seed := range uint32(3) {
		sendAndWait(ctx, t, st, srv, seed)
		require.Zero(t, oob.ReadStats().Offered, "payloads of the stream held after their pull")
	}
	_, err = st.CloseAndRecv()
	require.NoError(t, err)
}

// Under a retry policy gRPC may replay a client stream's messages, so their
// payloads stay in the outbox, pulled or not, until the stream ends.
func TestStreamPayloadHeldUnderRetryPolicy(t *testing.T) {
	srv := &uploadWatch{got: make(chan struct{}, 1)}
	r := newRig(t, transport.ModeTCP, srv)
	const retry = `{"methodConfig": [{"name": [{"service": "gdrpc.examples.tensor.TensorService"}],
		"retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
		"backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	cc, err := grpc.NewClient(r.cc.Target(), append(d.DialOptions(insecure.NewCredentials()), grpc.WithDefaultServiceConfig(retry))...)
	require.NoError(t, err)
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := tensorpb.NewTensorServiceClient(cc).Upload(ctx)
	require.NoError(t, err)
	sendAndWait(ctx, t, st, srv, 1)
	require.Equal(t, 1, oob.ReadStats().Offered, "the pulled payload stays for a replay")
	_, err = st.CloseAndRecv()
	require.NoError(t, err)
	require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 5*time.Second, time.Millisecond,
		"the stream's end releases its payloads")
}

// sendAndWait sends one message with a 1 MiB out-of-band payload on st and
// waits until the server received it.
func sendAndWait(ctx context.Context, t *testing.T, st tensorpb.TensorService_UploadClient, srv *uploadWatch, seed uint32) {
	t.Helper()
	src := devicebuf.HostFromBytes(pattern(1<<20, seed))
	m := &tensorpb.Tensor{Data: gdrcodec.New(src)}
	src.Release()
	require.NoError(t, st.Send(m))
	gdrcodec.ReleaseAll(m)
	select {
	case <-srv.got:
	case <-ctx.Done():
		t.Fatal("the server did not receive the message")
	}
}

// checkSized checks that m holds size bytes of seed's pattern, and
// releases it.
func checkSized(t *testing.T, m *tensorpb.Tensor, size int, seed uint32) {
	t.Helper()
	sum, n, err := tensor.Checksum(m, 0)
	require.NoError(t, err)
	gdrcodec.ReleaseAll(m)
	require.Equal(t, uint64(size), n)
	require.Equal(t, tensor.ChecksumBytes(pattern(size, seed)), sum, "message of seed %d", seed)
}

// downloadFirst starts a Download of four messages of size bytes, seeds 20
// to 23, and checks the first.
func downloadFirst(ctx context.Context, t *testing.T, r *rig, size int) grpc.ServerStreamingClient[tensorpb.Tensor] {
	t.Helper()
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: uint64(size), Seed: 20})
	require.NoError(t, err)
	m, err := st.Recv()
	require.NoError(t, err)
	checkSized(t, m, size, 20)
	return st
}

// downloadRest reads and checks the other three messages of downloadFirst's
// stream, then its end.
func downloadRest(t *testing.T, st grpc.ServerStreamingClient[tensorpb.Tensor], size int) {
	t.Helper()
	for i := range uint32(3) {
		m, err := st.Recv()
		require.NoError(t, err)
		checkSized(t, m, size, 21+i)
	}
	_, err := st.Recv()
	require.ErrorIs(t, err, io.EOF)
}

// A server stream whose client reads slowly runs at most
// Limits.UnpulledBytes ahead of it: its next message waits for the client's
// pulls rather than pile up in the outbox. The client's other calls to that
// server are not held back meanwhile, and once it reads on, the stream
// delivers every message, byte-exact.
func TestUnpulledResponsesBounded(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	const size, limit = 1 << 20, 2 << 20
	oob.SetTransferConfig(oob.TransferConfig{Timeout: 20 * time.Second, Limits: oob.Limits{UnpulledBytes: limit}})
	peer := transport.LocalID() // the client is this process
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	check := func(m *tensorpb.Tensor, seed uint32) { t.Helper(); checkSized(t, m, size, seed) }
	st := downloadFirst(ctx, t, r, size)
	require.Eventually(t, func() bool { return oob.Unpulled(peer) == limit }, 10*time.Second, time.Millisecond,
		"the two messages after the one read wait unpulled")

	resp, err := r.client.Make(ctx, &tensorpb.Sized{Size: size, Seed: 30})
	require.NoError(t, err, "another call while the stream waits")
	check(resp, 30)
	require.Equal(t, int64(limit), oob.Unpulled(peer), "the stream's fourth message was held back")

	downloadRest(t, st, size)
	require.Eventually(t, func() bool { return oob.Unpulled(peer) == 0 }, 10*time.Second, time.Millisecond)
}

// TestEndedCallWithdrawsResponse: a client call that fails after its
// response came (here the client refuses the payload's size) tells the
// server, which withdraws the response's payload from its outbox rather
// than pin it for its lease (oob.DefaultLease, two minutes).
func TestEndedCallWithdrawsResponse(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	peer := transport.LocalID() // the client is this process
	gdrcodec.Register(gdrcodec.WithMaxReceivePayload(1 << 20))
	t.Cleanup(func() { gdrcodec.Register() })
	_, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 2 << 20, Seed: 1})
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Eventually(t, func() bool { return oob.Unpulled(peer) == 0 && oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond,
		"the response's payload left the outbox")

	// A stream the client leaves after its first message.
	ctx, cancel := context.WithCancel(context.Background())
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: 256 << 10, Seed: 2})
	require.NoError(t, err)
	m, err := st.Recv()
	require.NoError(t, err)
	gdrcodec.ReleaseAll(m)
	cancel()
	require.Eventually(t, func() bool { return oob.Unpulled(peer) == 0 && oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond,
		"the stream's unread messages left the outbox")
}

// TestPeerUnpulledResponsesBounded: a response that would take what its
// client left unpulled over oob.Limits.PeerUnpulledBytes waits for the
// client's pulls: a call that gives up first takes nothing with it, and one
// that waits goes once the client reads its stream.
func TestPeerUnpulledResponsesBounded(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	const size = 1 << 20
	oob.SetTransferConfig(oob.TransferConfig{Timeout: 20 * time.Second, Limits: oob.Limits{PeerUnpulledBytes: 2 * size}})
	peer := transport.LocalID()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waiting := func(n int) func() bool { return func() bool { return oob.ReadStats().Waiting == n } }
	check := func(m *tensorpb.Tensor, seed uint32) { t.Helper(); checkSized(t, m, size, seed) }
	st := downloadFirst(ctx, t, r, size)
	require.Eventually(t, waiting(1), 10*time.Second, time.Millisecond, "the stream's fourth message waits")
	require.Equal(t, int64(2*size), oob.Unpulled(peer))

	// A call that gives up while its response waits.
	gaveUp, giveUp := context.WithCancel(ctx)
	made := make(chan error, 1)
	go func() {
		_, err := r.client.Make(gaveUp, &tensorpb.Sized{Size: size, Seed: 30})
		made <- err
	}()
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond, "the response waits")
	giveUp()
	require.Equal(t, codes.Canceled, status.Code(<-made))
	require.Eventually(t, func() bool { return oob.ReadStats().Waiting == 1 && oob.ReadStats().Offered == 3 }, 10*time.Second, time.Millisecond,
		"its payload left the outbox")

	small, err := r.client.Make(ctx, &tensorpb.Sized{Size: 1024, Seed: 31})
	require.NoError(t, err, "a response sent inline takes nothing of the bound")
	gdrcodec.ReleaseAll(small)

	// A call that waits goes once the client reads its stream.
	type result struct {
		m   *tensorpb.Tensor
		err error
	}
	results := make(chan result, 1)
	go func() {
		m, err := r.client.Make(ctx, &tensorpb.Sized{Size: size, Seed: 32})
		results <- result{m, err}
	}()
	require.Eventually(t, waiting(2), 10*time.Second, time.Millisecond)
	downloadRest(t, st, size)
	res := <-results
	require.NoError(t, res.err)
	check(res.m, 32)
	require.Eventually(t, func() bool {
		st := oob.ReadStats()
		return oob.Unpulled(peer) == 0 && st.Offered == 0 && st.Waiting == 0
	}, 10*time.Second, time.Millisecond)
}

// gatedListener hands out conns whose writes wait while its gate is shut:
// what the server sends is held back, what it receives is not.
type gatedListener struct {
	net.Listener
	mu     sync.Mutex
	closed chan struct{} // nil while open
}

func (l *gatedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &gatedConn{Conn: c, l: l}, nil
}

func (l *gatedListener) shut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed == nil {
		l.closed = make(chan struct{})
	}
}

func (l *gatedListener) open() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed != nil {
		close(l.closed)
		l.closed = nil
	}
}

type gatedConn struct {
	net.Conn
	l *gatedListener
}

func (c *gatedConn) Write(p []byte) (int, error) {
	c.l.mu.Lock()
	closed := c.l.closed
	c.l.mu.Unlock()
	if closed != nil {
		<-closed
	}
	return c.Conn.Write(p)
}

func (c *gatedConn) Session() *transport.Session { return transport.SessionOf(c.Conn) }

// TestGivenUpCallWithdrawsResponse: a client call that gives up before its
// response's headers arrive, while the server has sent the response, tells
// the server, which withdraws the response's payload rather than pin it
// for its lease.
func TestGivenUpCallWithdrawsResponse(t *testing.T) {
	var gate *gatedListener
	r := newRigWrapped(t, transport.ModeTCP, nil, nil, func(l net.Listener) net.Listener {
		gate = &gatedListener{Listener: l}
		return gate
	})
	t.Cleanup(gate.open) // before the rig's cleanup stops the server
	peer := transport.LocalID()
	warm, err := r.client.Make(context.Background(), &tensorpb.Sized{Size: 1024, Seed: 1})
	require.NoError(t, err, "the connection is up")
	gdrcodec.ReleaseAll(warm)

	gate.shut()
	ctx, cancel := context.WithCancel(context.Background())
	made := make(chan error, 1)
	go func() {
		_, err := r.client.Make(ctx, &tensorpb.Sized{Size: 1 << 20, Seed: 2})
		made <- err
	}()
	require.Eventually(t, func() bool { return oob.Unpulled(peer) == 1<<20 }, 10*time.Second, time.Millisecond,
		"the response is sent, its headers held back")
	cancel()
	require.Equal(t, codes.Canceled, status.Code(<-made))
	require.Eventually(t, func() bool { return oob.Unpulled(peer) == 0 && oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond,
		"the response's payload left the outbox")
}

// connsListener sends each connection it accepts on conns.
type connsListener struct {
	net.Listener
	conns chan<- net.Conn
}

func (l *connsListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.conns <- c
	}
	return c, err
}

// uploadGate is an Upload that takes no message until open is closed, or
// fails the call without taking any when fail is closed first: a server
// that reads a client stream late, or never.
type uploadGate struct {
	tensor.Server
	open, fail chan struct{}
	headers    bool // send the response's headers first
}

func (s *uploadGate) Upload(st tensorpb.TensorService_UploadServer) error {
	if s.headers {
		if err := st.SendHeader(nil); err != nil {
			return err
		}
	}
	select {
	case <-s.open:
		return s.Server.Upload(st)
	case <-s.fail:
		return status.Error(codes.FailedPrecondition, "not reading")
	}
}

// A client stream runs at most Limits.UnpulledBytes ahead of the server's
// pulls: while the server takes none, the next message waits in the
// outbox (oob.Stats.Waiting) before it is sent, and goes once the server
// pulled the earlier ones; a server that ends the stream meanwhile ends the
// wait with io.EOF, its status coming from CloseAndRecv, and so does one
// whose connection closes after it sent the response's headers, well before
// the session ends (a client with a call open keeps it lingering for the
// payloads' pulls up to the transfer timeout). Nothing stays in the outbox
// in any case.
func TestClientStreamWaitsForPulls(t *testing.T) {
	const (
		late = iota
		ends
		drops
	)
	for end, name := range []string{"server reads late", "server ends the stream", "server's connection closes"} {
		t.Run(name, func(t *testing.T) {
			srv := &uploadGate{open: make(chan struct{}), fail: make(chan struct{}), headers: end == drops}
			conns := make(chan net.Conn, 4)
			r := newRigWrapped(t, transport.ModeTCP, srv, nil, func(l net.Listener) net.Listener { return &connsListener{l, conns} })
			// The session lingers for the transfer timeout at most: the
			// wait must end with the connection, well before it.
			oob.SetTransferConfig(oob.TransferConfig{Timeout: time.Minute, Limits: oob.Limits{UnpulledBytes: 2 << 20}})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			st, err := r.client.Upload(ctx)
			require.NoError(t, err)
			var sum uint32
			var total uint64
			message := func(seed uint32) *tensorpb.Tensor {
				src := devicebuf.HostFromBytes(pattern(1<<20, seed))
				m := &tensorpb.Tensor{Data: gdrcodec.New(src)}
				src.Release()
				var n uint64
				sum, n, err = tensor.Checksum(m, sum)
				require.NoError(t, err)
				total += n
				return m
			}
			// 1 MiB payloads out of band, under a 2 MiB bound: the third
			// goes (two wait unpulled), the fourth waits.
			for seed := range uint32(3) {
				m := message(seed)
				require.NoError(t, st.Send(m))
				gdrcodec.ReleaseAll(m)
			}
			require.Equal(t, 3, oob.ReadStats().Offered)
			fourth := message(3)
			defer gdrcodec.ReleaseAll(fourth)
			sent := make(chan error, 1)
			go func() { sent <- st.Send(fourth) }()
			require.Eventually(t, func() bool { return oob.ReadStats().Waiting == 1 }, 10*time.Second, time.Millisecond,
				"the fourth message waits for the server's pulls")
			select {
			case err := <-sent:
				t.Fatalf("a message went while the server pulled nothing: %v", err)
			default:
			}
			result := func() error {
				select {
				case err := <-sent:
					return err
				case <-ctx.Done():
					t.Fatal("the waiting message neither went nor failed")
				}
				return nil
			}
			switch end {
			case ends:
				close(srv.fail)
				require.ErrorIs(t, result(), io.EOF)
				_, err = st.CloseAndRecv()
				require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
			case drops:
				defer close(srv.fail) // the handler, whose stream is gone, returns
				require.NoError(t, (<-conns).Close())
				require.ErrorIs(t, result(), io.EOF)
				_, err = st.CloseAndRecv()
				require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			case late:
				close(srv.open)
				require.NoError(t, result())
				got, err := st.CloseAndRecv()
				require.NoError(t, err)
				require.Equal(t, total, got.Bytes)
				require.Equal(t, sum, got.Crc32C)
			}
			require.Eventually(t, func() bool {
				st := oob.ReadStats()
				return st.Offered == 0 && st.Waiting == 0
			}, 10*time.Second, time.Millisecond, "payloads left in the outbox")
		})
	}
}

// serveUp serves handler as /test.Up/Up (any method the tensor service
// lacks, streaming both ways: the server may send twice), and returns a
// client whose responses land in pool; both go when the test ends.
func serveUp(t *testing.T, handler grpc.StreamHandler, pool *devicebuf.Pool) *grpc.ClientConn {
	t.Helper()
	addr := serveTensors(t, &tensor.Server{}, grpc.UnknownServiceHandler(handler))
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	cc, err := grpc.NewClient("passthrough:///"+addr, d.DialOptions(insecure.NewCredentials(), gdrcodec.WithReceiveAllocator(pool))...)
	require.NoError(t, err)
	t.Cleanup(func() { cc.Close() })
	return cc
}

// upHandler reads the client's stream, then sends n responses of 1 MiB
// and ends the call with err.
func upHandler(n int, err error) grpc.StreamHandler {
	return func(_ any, ss grpc.ServerStream) error {
		for {
			var in tensorpb.Tensor
			if err := ss.RecvMsg(&in); err == io.EOF {
				break
			} else if err != nil {
				return err
			}
			gdrcodec.ReleaseAll(&in)
		}
		for range n {
			b := devicebuf.HostFromBytes(pattern(1<<20, 7))
			resp := &tensorpb.Tensor{Data: gdrcodec.New(b)}
			b.Release()
			if err := ss.SendMsg(resp); err != nil {
				return err
			}
		}
		return err
	}
}

// openUp opens a client-streaming call of /test.Up/Up, sends one message
// and closes its side.
func openUp(t *testing.T, cc *grpc.ClientConn) grpc.ClientStream {
	t.Helper()
	cs, err := cc.NewStream(context.Background(), &grpc.StreamDesc{StreamName: "Up", ClientStreams: true}, "/test.Up/Up")
	require.NoError(t, err)
	require.NoError(t, cs.SendMsg(&tensorpb.Tensor{Name: "x"}))
	require.NoError(t, cs.CloseSend())
	return cs
}

// A client-streaming call whose server sends its response and then fails
// the call, or sends a second response, returns an error and no response
// (generated code drops the message): the payload the codec attached to it
// goes back to the receive pool, as a failed unary call's does. A receive
// after the response came (gRPC's "until a non-nil error") leaves the
// response, the caller's, as it is.
func TestClientStreamFailedResponseReleased(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler grpc.StreamHandler
		want    codes.Code
	}{
		{"status after the response", upHandler(1, status.Error(codes.Aborted, "the handler failed after its response")), codes.Aborted},
		{"two responses", upHandler(2, nil), codes.Internal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 64 << 20})
			require.NoError(t, err)
			defer pool.Close()
			cc := serveUp(t, tc.handler, pool)
			for range 3 {
				m := new(tensorpb.Tensor)
				require.Equal(t, tc.want, status.Code(openUp(t, cc).RecvMsg(m)))
				_, attached := gdrcodec.Buffer(m.GetData())
				require.False(t, attached, "the dropped response keeps no buffer")
				require.Zero(t, pool.Stats().InUse, "the response's payload went back to the pool")
			}
		})
	}
	t.Run("receive after the response", func(t *testing.T) {
		pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 64 << 20})
		require.NoError(t, err)
		defer pool.Close()
		cs := openUp(t, serveUp(t, upHandler(1, nil), pool))
		m := new(tensorpb.Tensor)
		require.NoError(t, cs.RecvMsg(m))
		b, attached := gdrcodec.Buffer(m.GetData())
		require.True(t, attached)
		require.ErrorIs(t, cs.RecvMsg(m), io.EOF)
		_, attached = gdrcodec.Buffer(m.GetData())
		require.True(t, attached, "the response the caller holds keeps its payload")
		require.False(t, b.Released())
		require.Equal(t, 1, pool.Stats().InUse)
		gdrcodec.ReleaseAll(m)
		require.Zero(t, pool.Stats().InUse)
	})
}

// A response whose body starts with a call number (a server's own, or a
// hostile server's) names nothing of the client's: decoded while this
// process's server decodes a request of the same type, it is not taken for
// that request and kept for its pulls, whatever it carries.
func TestClientIgnoresCallNumberInResponse(t *testing.T) {
	odd := grpc.UnknownServiceHandler(func(_ any, st grpc.ServerStream) error {
		var in tensorpb.Sized
		if err := st.RecvMsg(&in); err != nil {
			return err
		}
		out := &tensorpb.Sized{}
		u := protowire.AppendVarint(protowire.AppendTag(nil, 19061, protowire.VarintType), 777) // a call number
		u = protowire.AppendBytes(protowire.AppendTag(u, 1000, protowire.BytesType), make([]byte, 64<<10))
		out.ProtoReflect().SetUnknown(u)
		return st.SendMsg(out)
	})
	r := newRigWith(t, transport.ModeTCP, nil, []grpc.ServerOption{odd})
	// A call of this process's server that sent its headers and no request:
	// the server decodes a Sized.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := r.cc.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, "/gdrpc.examples.tensor.TensorService/Make")
	require.NoError(t, err)
	sized := (&tensorpb.Sized{}).ProtoReflect().Descriptor().FullName()
	require.Eventually(t, func() bool { return gdrcodec.DecodingForTest(sized) }, 10*time.Second, time.Millisecond)

	var ws []weak.Pointer[tensorpb.Sized]
	for range 20 {
		reply := &tensorpb.Sized{}
		require.NoError(t, r.cc.Invoke(context.Background(), "/odd.S/Get", &tensorpb.Sized{Size: 1}, reply))
		ws = append(ws, weak.Make(reply))
	}
	runtime.GC()
	for i, w := range ws {
		require.True(t, w.Value() == nil, "response %d is kept", i)
	}
}
