package interop_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/rpc"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// netRPCTensors is the net/rpc service of these tests, registered as
// "Tensors": its arguments and replies are the example's protobuf messages,
// whose payloads (the DeviceBuffer data field, the marked blob field) move
// out-of-band over a gdrpc session from the eager threshold on.
type netRPCTensors struct{}

// Echo replies with copies of the payloads that arrived, in payloads of the
// reply's own: what the client gets back is what the server received.
func (netRPCTensors) Echo(in, out *tensorpb.Tensor) error {
	p, err := tensor.Bytes(in.GetData())
	if err != nil {
		return err
	}
	b := devicebuf.HostFromBytes(bytes.Clone(p))
	out.Name, out.Shape, out.Data, out.Blob = in.GetName(), in.GetShape(), gdrcodec.New(b), bytes.Clone(in.GetBlob())
	b.Release()
	return nil
}

// Refuse fails, naming the size and checksum of what arrived.
func (netRPCTensors) Refuse(in *tensorpb.Tensor, _ *tensorpb.Summary) error {
	return refusal(in)
}

// refusal is the error of the Refuse methods: the request's name, payload
// bytes and their CRC-32C (data, then blob), as the server saw them.
func refusal(in *tensorpb.Tensor) error {
	crc, n, err := tensor.Checksum(in, 0)
	if err != nil {
		return err
	}
	return fmt.Errorf("refused %s: %d bytes, crc32c %08x", in.GetName(), n, crc)
}

// netRPCServer serves netRPCTensors over net/rpc on a gdrpc listener, each
// accepted conn with gdrcodec.NewServerCodec, as a user wires it.
type netRPCServer struct {
	addr      string
	lis       net.Listener
	accepting chan error // why the accept loop ended
	serving   sync.WaitGroup
	mu        sync.Mutex
	accepted  []net.Conn
	closeOnce sync.Once
}

// startNetRPC starts a netRPCServer on 127.0.0.1 with opts; it stops when
// the test ends, if the test did not stop it before.
func startNetRPC(tb testing.TB, opts []gdrpc.Option) *netRPCServer {
	tb.Helper()
	noSessions(tb)
	rs := rpc.NewServer()
	require.NoError(tb, rs.RegisterName("Tensors", netRPCTensors{}))
	lis, err := listener.Listen("127.0.0.1:0", opts...)
	require.NoError(tb, err)
	s := &netRPCServer{addr: lis.Addr().String(), lis: lis, accepting: make(chan error, 1)}
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				s.accepting <- err
				return
			}
			s.mu.Lock()
			s.accepted = append(s.accepted, c)
			s.mu.Unlock()
			s.serving.Go(func() { rs.ServeCodec(gdrcodec.NewServerCodec(c)) })
		}
	}()
	tb.Cleanup(func() { s.close(tb) })
	return s
}

// conns returns the conns the server accepted so far.
func (s *netRPCServer) conns() []net.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]net.Conn(nil), s.accepted...)
}

// close closes the listener and every accepted conn, and waits (bounded)
// until the accept loop and every ServeCodec returned.
func (s *netRPCServer) close(tb testing.TB) {
	tb.Helper()
	s.closeOnce.Do(func() {
		require.NoError(tb, s.lis.Close())
		select {
		case err := <-s.accepting:
			require.ErrorIs(tb, err, net.ErrClosed)
		case <-time.After(testTimeout):
			tb.Fatal("Accept did not return after Close")
		}
		for _, c := range s.conns() {
			_ = c.Close() // ServeCodec may have closed it already
		}
		served := make(chan struct{})
		go func() {
			s.serving.Wait()
			close(served)
		}()
		select {
		case <-served:
		case <-time.After(testTimeout):
			tb.Fatal("ServeCodec did not return after its conn closed")
		}
	})
}

// dialNetRPC dials addr with a gdrpc dialer made with opts and returns a
// net/rpc client over gdrcodec.NewClientCodec, with the conn's session; the
// client is closed when the test ends, if the test did not close it before.
func dialNetRPC(tb testing.TB, addr string, opts []gdrpc.Option) (*rpc.Client, *transport.Session) {
	tb.Helper()
	conn, err := dialer.New(opts...).DialContext(callCtx(tb), addr)
	require.NoError(tb, err)
	sess := transport.SessionOf(conn)
	require.NotNil(tb, sess, "dialed conn %T has no gdrpc session", conn)
	c := rpc.NewClientWithCodec(gdrcodec.NewClientCodec(conn))
	tb.Cleanup(func() { _ = c.Close() }) // ErrShutdown when the test closed it
	return c, sess
}

// netRPCCall makes a call on c and waits for its reply at most testTimeout:
// net/rpc's Call waits without a bound.
func netRPCCall(c *rpc.Client, method string, args, reply any) error {
	call := c.Go(method, args, reply, make(chan *rpc.Call, 1))
	timer := time.NewTimer(testTimeout)
	defer timer.Stop()
	select {
	case <-call.Done:
		return call.Error
	case <-timer.C:
		return fmt.Errorf("%s: no reply within %v", method, testTimeout)
	}
}

// netRPCRequest returns a Tensor named name whose data payload is data and
// whose blob is blob; the caller releases it with gdrcodec.ReleaseAll.
func netRPCRequest(name string, data, blob []byte) *tensorpb.Tensor {
	b := devicebuf.HostFromBytes(data)
	t := &tensorpb.Tensor{Name: name, Shape: []int64{int64(len(data))}, Data: gdrcodec.New(b), Blob: blob}
	b.Release()
	return t
}

// echo calls Tensors.Echo with data and blob and checks, byte for byte, that
// the reply carries them back.
func echo(c *rpc.Client, name string, data, blob []byte) error {
	req := netRPCRequest(name, data, blob)
	defer gdrcodec.ReleaseAll(req)
	var got tensorpb.Tensor
	if err := netRPCCall(c, "Tensors.Echo", req, &got); err != nil {
		return fmt.Errorf("echo %s: %w", name, err)
	}
	defer gdrcodec.ReleaseAll(&got)
	if got.GetName() != name {
		return fmt.Errorf("echo %s: reply named %q", name, got.GetName())
	}
	p, err := tensor.Bytes(got.GetData())
	if err != nil {
		return fmt.Errorf("echo %s: data: %w", name, err)
	}
	if !bytes.Equal(data, p) {
		return fmt.Errorf("echo %s: data of %d bytes back for %d sent, or bytes differ", name, len(p), len(data))
	}
	if !bytes.Equal(blob, got.GetBlob()) {
		return fmt.Errorf("echo %s: blob of %d bytes back for %d sent, or bytes differ", name, len(got.GetBlob()), len(blob))
	}
	return nil
}

// netRPCTransports are the sessions net/rpc runs over here: the TCP fallback
// between untrusted peers (the default trust), and UCX shared memory and
// UCX tcp between trusted ones (payloads by rdma, replies into the
// client's receive space once it advertised one).
var netRPCTransports = slices.DeleteFunc(slices.Clone(transportCases), func(tc transportCase) bool { return tc.tls })

// netRPCOptions returns the gdrpc options of both sides for tc: its session
// options on the engine with the process's configuration (countPaths), and
// trust where tc runs over UCX. It skips the test when tc needs UCX and it is
// absent (fails it under GDRPC_REQUIRE=ucx).
func netRPCOptions(tb testing.TB, tc transportCase) []gdrpc.Option {
	tb.Helper()
	opts := []gdrpc.Option{gdrpc.WithSessionOptions(withEngine(tc.options(tb))...)}
	if tc.ucx != "" {
		opts = append(opts, gdrpc.WithTrustPeers())
	}
	return opts
}

// requirePayloadsSettled checks (bounded) that no payload is held any more,
// the sessions still open: no outbox entry, no pull under way, no buffer
// attached to a message, no range of a receive space held by the client or
// taken by the server.
func requirePayloadsSettled(tb testing.TB) {
	tb.Helper()
	check := func() error {
		st := oob.ReadStats()
		switch {
		case st.Offered != 0 || st.Waiting != 0 || st.Unpulled != 0:
			return fmt.Errorf("outbox: %d entries, %d messages waiting, %d bytes unpulled", st.Offered, st.Waiting, st.Unpulled)
		case st.Pulls != 0:
			return fmt.Errorf("%d pulls under way", st.Pulls)
		case st.Landed != 0 || st.PeerTaken != 0:
			return fmt.Errorf("receive space: %d ranges held here, %d of the peer's taken", st.Landed, st.PeerTaken)
		case gdrcodec.Attached() != 0:
			return fmt.Errorf("%d attached buffers", gdrcodec.Attached())
		}
		return nil
	}
	settle(tb, "payloads still held", check)
}

// memoryMaps counts the UCX memory maps and, of them, those of pool regions:
// each region of a UCX host pool is one map and the one registration its pool
// holds (devicebuf counts no other registrations).
type memoryMaps struct{ maps, regions int64 }

func liveMemoryMaps() memoryMaps {
	return memoryMaps{maps: rdma.Stats().Memories, regions: devicebuf.Live().Registrations}
}

// requireNetRPCSettled checks (bounded) that nothing is left once the test
// closed its client and server: requireSettled's checks, no receive space
// alive on either side, and no UCX memory map made since before (the
// registrations of transfers and receive spaces) left beyond the change in
// pool regions: pools keep regions until they idle out, and an earlier
// test's may idle out during this one.
func requireNetRPCSettled(t *testing.T, before memoryMaps) {
	t.Helper()
	requireSettled(t)
	check := func() error {
		st := oob.ReadStats()
		if st.Spaces != 0 || st.SpaceBytes != 0 || st.Landed != 0 || st.PeerSpaces != 0 || st.PeerTaken != 0 {
			return fmt.Errorf("receive spaces alive: %+v", st)
		}
		now := liveMemoryMaps()
		if maps, regions := now.maps-before.maps, now.regions-before.regions; maps > regions {
			return fmt.Errorf("%d UCX memory maps more than before, %d of them pool regions", maps, regions)
		}
		return nil
	}
	settle(t, "left after close", check)
}

// landingCounter is a pathCounter that also counts the payloads that landed
// in receive space this process advertised, with no rendezvous.
type landingCounter struct {
	*pathCounter
	landed atomic.Int64
}

// countLandings is countPaths, landings counted too.
func countLandings(tb testing.TB) *landingCounter {
	tb.Helper()
	lc := &landingCounter{pathCounter: countPaths(tb)} // its cleanup resets the configuration
	oob.SetTransferConfig(oob.TransferConfig{Metrics: lc, Timeout: testTimeout})
	return lc
}

func (c *landingCounter) Transfer(i oob.TransferInfo) {
	if i.Pull && i.Err == nil && i.Advertised {
		c.landed.Add(1)
	}
	c.pathCounter.Transfer(i)
}

// waitPeerSpace waits (bounded) until this process's sessions took the
// receive space one peer advertised.
func waitPeerSpace(tb testing.TB) {
	tb.Helper()
	settle(tb, "peers' receive spaces", func() error {
		if st := oob.ReadStats(); st.PeerSpaces != 1 {
			return fmt.Errorf("%+v, want one", st)
		}
		return nil
	})
}

// netRPCPair starts a server and dials a client for tc, checks that the
// client's session runs over tc's transport and speaks the gdr codec, and
// returns a function that closes both and checks that nothing is left.
func netRPCPair(t *testing.T, tc transportCase) (c *rpc.Client, sess *transport.Session, closeAll func()) {
	t.Helper()
	opts := netRPCOptions(t, tc)
	srv := startNetRPC(t, opts)
	before := liveMemoryMaps()
	c, sess = dialNetRPC(t, srv.addr, opts)
	require.Equal(t, tc.want(), sess.Transport())
	require.Equal(t, tc.ucx != "", sess.TrustsPeer(), "trust: between UCX peers only")
	require.True(t, sess.Speaks(gdrcodec.Name), "the session did not negotiate the gdr codec")
	return c, sess, func() {
		t.Helper()
		require.NoError(t, c.Close())
		srv.close(t)
		select {
		case <-sess.Done():
		case <-time.After(testTimeout):
			t.Fatal("the client's session outlived its closed conn")
		}
		requireNetRPCSettled(t, before)
	}
}

// TestNetRPC calls a net/rpc service over gdrpc's listener and dialer with
// the gdrcodec codecs, on each transport: payloads from the eager threshold
// on go out-of-band in both directions (the server pulls the request's, the
// client the reply's, or, between trusted UCX peers, the server writes the
// reply's data payload into the receive space the client advertised after
// its first pull), smaller ones inline, and every byte comes back as sent.
func TestNetRPC(t *testing.T) {
	for _, tc := range netRPCTransports {
		t.Run("transport="+tc.name, func(t *testing.T) {
			paths := countLandings(t)
			c, sess, closeAll := netRPCPair(t, tc)
			threshold := eagerThreshold(sess.Transport())
			path := oobPath(t, sess.Transport())
			advertised := false // the server took the client's receive space

			for _, sc := range []struct {
				name string
				size int  // of the data payload and of the blob
				oob  bool // both payloads go out-of-band, both ways
			}{
				{name: "inline/size=0", size: 0},
				{name: "inline/size=1", size: 1},
				{name: "inline/size=4KiB", size: 4 << 10},
				{name: "inline/size=threshold-1", size: threshold - 1},
				{name: "oob/size=threshold", size: threshold, oob: true},
				{name: "oob/size=1MiB", size: 1 << 20, oob: true},
				{name: "oob/size=3MiB+5", size: 3<<20 + 5, oob: true},
			} {
				t.Run(sc.name, func(t *testing.T) {
					seed := uint32(sc.size)
					require.NoError(t, echo(c, sc.name, pattern(sc.size, seed), pattern(sc.size, seed+1)))
					landed := paths.landed.Swap(0)
					if !sc.oob {
						require.Empty(t, paths.reset(), "inline payloads were pulled")
						require.Zero(t, landed, "inline payloads landed in receive space")
						return
					}
					// The request's data and blob pulled by the server, the
					// reply's by the client or written into its receive space.
					require.Equal(t, map[string]int{path: 4}, paths.reset())
					require.Empty(t, paths.failures())
					wantLanded := int64(0)
					if advertised {
						wantLanded = 1 // the data payload: a marked bytes field always takes the rendezvous
					}
					require.Equal(t, wantLanded, landed, "reply payloads that landed in the client's receive space")
					if sess.TrustsPeer() && !advertised {
						// A client sets aside receive space for a server it
						// trusts after its first pull by rdma.
						waitPeerSpace(t)
						advertised = true
					}
					requirePayloadsSettled(t)
				})
			}
			if sess.TrustsPeer() {
				require.True(t, advertised)
			} else {
				require.Eventually(t, func() bool { return oob.ReadStats().Making == 0 }, 10*time.Second, time.Millisecond)
				require.Zero(t, oob.ReadStats().Spaces, "receive space advertised to an untrusted peer")
			}
			closeAll()
		})
	}
}

// TestNetRPCConcurrentCalls makes calls from 16 goroutines at once on one
// net/rpc client (one session), each with payloads of its own, half of them
// out-of-band and half inline, and checks every byte.
func TestNetRPCConcurrentCalls(t *testing.T) {
	const workers, rounds = 16, 3
	for _, tc := range netRPCTransports {
		t.Run("transport="+tc.name, func(t *testing.T) {
			paths := countPaths(t)
			c, sess, closeAll := netRPCPair(t, tc)
			threshold := eagerThreshold(sess.Transport())

			concurrently(t, workers, func(w int) error {
				for r := range rounds {
					seed := uint32(w*rounds + r)
					n := 1<<10 + w // inline
					if w%2 == 0 {
						n = threshold + 64<<10 + w // out-of-band
					}
					name := fmt.Sprintf("worker=%d/round=%d", w, r)
					if err := echo(c, name, pattern(n, 2*seed), pattern(n+1, 2*seed+1)); err != nil {
						return err
					}
				}
				return nil
			})
			// Data and blob, up and down, for each call of the even workers.
			require.Equal(t, rounds*(workers/2)*4, paths.succeeded(t))
			requirePayloadsSettled(t)
			closeAll()
		})
	}
}

// TestNetRPCMethodError calls methods that return an error, with payloads
// out-of-band and inline: the client gets the method's error as an
// rpc.ServerError (naming the bytes the server received), the payloads of the
// call are given back on both sides, and later calls on the same client
// still work.
func TestNetRPCMethodError(t *testing.T) {
	for _, tc := range netRPCTransports {
		t.Run("transport="+tc.name, func(t *testing.T) {
			paths := countPaths(t)
			c, sess, closeAll := netRPCPair(t, tc)
			threshold := eagerThreshold(sess.Transport())

			for _, ec := range []struct {
				name string
				size int
			}{
				{"refuse/oob", 1 << 20},
				{"refuse/inline", threshold - 1},
			} {
				t.Run(ec.name, func(t *testing.T) {
					data, blob := pattern(ec.size, 11), pattern(ec.size, 12)
					req := netRPCRequest(ec.name, data, blob)
					err := netRPCCall(c, "Tensors.Refuse", req, &tensorpb.Summary{})
					gdrcodec.ReleaseAll(req)
					want := fmt.Sprintf("refused %s: %d bytes, crc32c %08x", ec.name, len(data)+len(blob),
						crc32cUpdate(crc32cUpdate(0, data), blob))
					var se rpc.ServerError
					require.ErrorAs(t, err, &se)
					require.Equal(t, want, string(se))
					if ec.size >= threshold {
						require.Equal(t, map[string]int{oobPath(t, sess.Transport()): 2}, paths.reset(), "the server pulled the request's payloads")
					} else {
						require.Empty(t, paths.reset(), "inline payloads were pulled")
					}
					requirePayloadsSettled(t)

					// The client goes on: the failed call left its connection
					// as it was.
					n := 1<<20 + 1
					require.NoError(t, echo(c, "after "+ec.name, pattern(n, 13), pattern(n, 14)))
					require.Equal(t, map[string]int{oobPath(t, sess.Transport()): 4}, paths.reset())
					require.Empty(t, paths.failures())
					requirePayloadsSettled(t)
				})
			}
			closeAll()
		})
	}
}

// TestNetRPCPlainClientRefused: a net/rpc client that dials gdrpc's listener
// over plain TCP, without gdrpc's dialer, is not served: the listener hands
// over gdrpc sessions and plain gRPC clients (HTTP/2, TLS) only (README,
// net/rpc). Its connection is closed before the server accepts it, with
// net/rpc's gob codec as with gdrcodec's, and its call fails instead of
// waiting; a gdrpc client of the same listener is served meanwhile.
func TestNetRPCPlainClientRefused(t *testing.T) {
	tcp := netRPCTransports[slices.IndexFunc(netRPCTransports, func(tc transportCase) bool { return tc.ucx == "" })]
	opts := netRPCOptions(t, tcp)
	srv := startNetRPC(t, opts)
	before := liveMemoryMaps()
	req := netRPCRequest("plain", pattern(1<<10, 1), nil) // inline: the conn is no gdrpc session
	defer gdrcodec.ReleaseAll(req)
	for _, pc := range []struct {
		name        string
		client      func(net.Conn) *rpc.Client
		args, reply any
	}{
		{"gob", func(nc net.Conn) *rpc.Client { return rpc.NewClient(nc) }, "hello", new(string)},
		{"gdrcodec", func(nc net.Conn) *rpc.Client { return rpc.NewClientWithCodec(gdrcodec.NewClientCodec(nc)) }, req, &tensorpb.Tensor{}},
	} {
		t.Run("codec="+pc.name, func(t *testing.T) {
			nc, err := (&net.Dialer{}).DialContext(callCtx(t), "tcp", srv.addr)
			require.NoError(t, err)
			c := pc.client(nc)
			defer func() { _ = c.Close() }()
			err = netRPCCall(c, "Tensors.Echo", pc.args, pc.reply)
			// The listener closed the connection: the call's write or its
			// read of the reply failed on that, and it did not wait.
			require.Truef(t, errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
				errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, rpc.ErrShutdown),
				"the plain client's call: %v", err)
		})
	}
	require.Empty(t, srv.conns(), "the listener handed a plain net/rpc client to Accept")

	c, _ := dialNetRPC(t, srv.addr, opts)
	require.NoError(t, echo(c, "gdrpc", pattern(1<<20, 3), pattern(10, 4)))
	require.NoError(t, c.Close())
	srv.close(t)
	gdrcodec.ReleaseAll(req)
	requireNetRPCSettled(t, before)
}
