package gdrcodec_test

import (
	"context"
	"errors"
	"net"
	"net/rpc"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/gdrcodec/internal/nestedpb"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// Tensors is a net/rpc service over the example payloads.
type Tensors struct{}

func (Tensors) Digest(t *tensorpb.Tensor, s *tensorpb.Summary) error {
	sum, n, err := tensor.Checksum(t, 0)
	s.Bytes, s.Crc32C = n, sum
	return err
}

func (Tensors) Make(r *tensorpb.Sized, t *tensorpb.Tensor) error {
	m, err := tensor.Make(nil, r)
	if err == nil {
		*t = tensorpb.Tensor{Name: m.Name, Data: m.Data, Blob: m.Blob}
	}
	return err
}

func (Tensors) Fail(r *tensorpb.Sized, t *tensorpb.Summary) error { return errors.New("asked to fail") }

// netRPCPair serves Tensors over net/rpc on a gdrpc listener made with
// server options and returns a client dialed with client options (server's
// when nil); both go when the test ends.
func netRPCPair(t *testing.T, server, client []gdrpc.Option) *rpc.Client {
	t.Helper()
	return netRPCPairServing(t, nil, server, client)
}

// netRPCPairServing is netRPCPair with rcvr's methods served too.
func netRPCPairServing(t *testing.T, rcvr any, server, client []gdrpc.Option) *rpc.Client {
	t.Helper()
	if client == nil {
		client = server
	}
	srv := rpc.NewServer()
	require.NoError(t, srv.Register(Tensors{}))
	if rcvr != nil {
		require.NoError(t, srv.Register(rcvr))
	}
	lis, err := listener.Listen("127.0.0.1:0", server...)
	require.NoError(t, err)
	done := make(chan error, 1) // why accepting ended
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				done <- err
				return
			}
			go srv.ServeCodec(gdrcodec.NewServerCodec(c))
		}
	}()
	conn, err := dialer.New(client...).DialContext(context.Background(), lis.Addr().String())
	require.NoError(t, err)
	c := rpc.NewClientWithCodec(gdrcodec.NewClientCodec(conn))
	t.Cleanup(func() {
		require.NoError(t, c.Close())
		require.NoError(t, lis.Close())
		require.ErrorIs(t, <-done, net.ErrClosed)
	})
	return c
}

func TestNetRPC(t *testing.T) {
	for _, mode := range []transport.Mode{transport.ModeTCP, transport.ModeUCX} {
		t.Run("transport="+string(mode), func(t *testing.T) {
			if mode == transport.ModeUCX {
				requireUCX(t)
			}
			client := netRPCPair(t, []gdrpc.Option{gdrpc.WithTransport(mode)}, nil)

			for _, n := range []int{10, 1 << 20, 9<<20 + 1} {
				want := pattern(n, 4)
				b := devicebuf.HostFromBytes(want)
				req := &tensorpb.Tensor{Data: gdrcodec.New(b), Blob: want}
				b.Release()
				var sum tensorpb.Summary
				require.NoError(t, client.Call("Tensors.Digest", req, &sum))
				require.Equal(t, uint64(2*n), sum.Bytes)
				require.Equal(t, crcTwice(want), sum.Crc32C)
				gdrcodec.ReleaseAll(req)

				var got tensorpb.Tensor
				require.NoError(t, client.Call("Tensors.Make", &tensorpb.Sized{Size: uint64(n), Seed: 4}, &got))
				p, err := tensor.Bytes(got.Data)
				require.NoError(t, err)
				requireBytes(t, want, p)
				gdrcodec.ReleaseAll(&got)
			}
			err := client.Call("Tensors.Fail", &tensorpb.Sized{}, &tensorpb.Summary{})
			require.EqualError(t, err, "asked to fail")
		})
	}
}

// advertisedCounter counts a client's received payloads, pulled or taken
// from its receive space.
type advertisedCounter struct {
	gdrpc.NopMetrics
	pulled, landed atomic.Int64
}

func (c *advertisedCounter) Transfer(i gdrpc.TransferInfo) {
	switch {
	case !i.Pull || i.Err != nil:
	case i.Advertised:
		c.landed.Add(1)
	default:
		c.pulled.Add(1)
	}
}

// A net/rpc server's replies land in the receive space its trusted client
// advertised, as gRPC's do.
func TestNetRPCReceiveSpace(t *testing.T) {
	requireUCX(t)
	// Pulls from this process may take any session to it: none of an
	// earlier test's may be left.
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	counter := &advertisedCounter{}
	trusted := []gdrpc.Option{gdrpc.WithTransport(transport.ModeUCX), gdrpc.WithTrustPeers()}
	client := netRPCPair(t, trusted, append(trusted, gdrpc.WithReceiveSpace(16<<20), gdrpc.WithMetrics(counter)))
	const n = 1 << 20
	for i := range 4 {
		var got tensorpb.Tensor
		require.NoError(t, client.Call("Tensors.Make", &tensorpb.Sized{Size: n, Seed: uint32(i)}, &got))
		p, err := tensor.Bytes(got.Data)
		require.NoError(t, err)
		requireBytes(t, pattern(n, uint32(i)), p)
		gdrcodec.ReleaseAll(&got)
		if i == 0 {
			waitPeerSpace(t)
		}
	}
	require.Equal(t, int64(1), counter.pulled.Load())
	require.Equal(t, int64(3), counter.landed.Load())
}

// holder is a net/rpc service whose calls keep their request, and so its
// buffers, until the test lets them return.
type holder struct {
	arrived chan *tensorpb.Tensor // each call's request, as the call starts
	release chan struct{}         // closed: every call returns
}

func (h *holder) Hold(t *tensorpb.Tensor, s *tensorpb.Summary) error {
	h.arrived <- t
	<-h.release
	sum, n, err := tensor.Checksum(t, 0)
	s.Bytes, s.Crc32C = n, sum
	return err
}

// headerErrors is a server codec that reports each error of its
// ReadRequestHeader.
type headerErrors struct {
	rpc.ServerCodec
	errs chan error
}

func (c *headerErrors) ReadRequestHeader(r *rpc.Request) error {
	err := c.ServerCodec.ReadRequestHeader(r)
	if err != nil {
		c.errs <- err
	}
	return err
}

// A request whose seq is that of one still running is refused, unread: the
// connection ends once the first one's reply is written, the first handler
// keeps its buffer until then, and the duplicate's payload is never pulled.
func TestNetRPCDuplicateSeq(t *testing.T) {
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	pc := &pathCounter{paths: map[string]int{}}
	oob.SetTransferConfig(oob.TransferConfig{Metrics: pc, Timeout: 20 * time.Second})
	t.Cleanup(func() { oob.SetTransferConfig(oob.TransferConfig{}) })

	h := &holder{arrived: make(chan *tensorpb.Tensor, 2), release: make(chan struct{})}
	release := sync.OnceFunc(func() { close(h.release) })
	srv := rpc.NewServer()
	require.NoError(t, srv.RegisterName("Holder", h))
	opts := []gdrpc.Option{gdrpc.WithTransport(transport.ModeTCP), processEngine}
	lis, err := listener.Listen("127.0.0.1:0", opts...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, lis.Close()) })
	accepted := make(chan net.Conn, 1)
	go func() {
		defer close(accepted)
		if c, err := lis.Accept(); err == nil {
			accepted <- c
		}
	}()
	conn, err := dialer.New(opts...).DialContext(context.Background(), lis.Addr().String())
	require.NoError(t, err)
	client := gdrcodec.NewClientCodec(conn)
	// The duplicate goes through a codec of its own on the same conn: a
	// client codec keeps one request's payloads per seq, as net/rpc's client
	// never repeats one.
	duplicate := gdrcodec.NewClientCodec(conn)
	sc, ok := <-accepted
	require.True(t, ok, "no connection accepted")
	server := &headerErrors{ServerCodec: gdrcodec.NewServerCodec(sc), errs: make(chan error, 4)}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.ServeCodec(server)
	}()
	t.Cleanup(func() {
		release()
		client.Close()
		duplicate.Close() // the duplicate's payload leaves its outbox
		<-served
	})

	const n = 1 << 20
	send := func(c rpc.ClientCodec, seed uint32) {
		t.Helper()
		b := devicebuf.HostFromBytes(pattern(n, seed))
		req := &tensorpb.Tensor{Data: gdrcodec.New(b)}
		b.Release()
		require.NoError(t, c.WriteRequest(&rpc.Request{Seq: 7, ServiceMethod: "Holder.Hold"}, req))
		gdrcodec.ReleaseAll(req) // the outbox holds the payload until the reply
	}
	send(client, 1)
	var first *tensorpb.Tensor
	select {
	case first = <-h.arrived:
	case <-time.After(20 * time.Second):
		t.Fatal("the first request reached no handler")
	}
	buf, ok := gdrcodec.Buffer(first.Data)
	require.True(t, ok, "the first request arrived without its payload")

	send(duplicate, 2) // the same seq, while the first call runs
	select {
	case err := <-server.errs:
		require.ErrorContains(t, err, "seq 7")
	case <-h.arrived:
		t.Fatal("a second request with seq 7 reached a handler while the first one's runs")
	case <-time.After(20 * time.Second):
		t.Fatal("the second request with seq 7 was neither refused nor served")
	}
	_, ok = gdrcodec.Buffer(first.Data)
	require.True(t, ok, "the first handler's buffer was released while it runs")
	p, err := buf.HostBytes()
	require.NoError(t, err)
	requireBytes(t, pattern(n, 1), p)

	release()
	var resp rpc.Response
	require.NoError(t, client.ReadResponseHeader(&resp))
	require.Equal(t, uint64(7), resp.Seq)
	require.Empty(t, resp.Error)
	var sum tensorpb.Summary
	require.NoError(t, client.ReadResponseBody(&sum))
	require.Equal(t, uint64(n), sum.Bytes)
	require.Equal(t, tensor.ChecksumBytes(pattern(n, 1)), sum.Crc32C)
	require.Error(t, client.ReadResponseHeader(&resp), "the connection outlived the refused request")
	select {
	case <-served:
	case <-time.After(20 * time.Second):
		t.Fatal("the server kept serving the connection")
	}

	_, ok = gdrcodec.Buffer(first.Data)
	require.False(t, ok, "the first request's buffer outlived its reply")
	require.Empty(t, h.arrived, "the refused request reached a handler")
	pulls := 0
	for _, k := range pc.reset() {
		pulls += k
	}
	require.Equal(t, 1, pulls, "payloads pulled: the first request's alone")
}

// TestNetRPCUnpulledRepliesBounded: a net/rpc client that takes replies and
// never pulls their payloads (it decodes them into a message without the
// fields) has its next reply wait once what it left unpulled would go over
// oob.Limits.PeerUnpulledBytes, instead of pinning payloads call after
// call; its connection's close ends the wait and frees what it left.
func TestNetRPCUnpulledRepliesBounded(t *testing.T) {
	const size = 1 << 20
	oob.SetTransferConfig(oob.TransferConfig{Timeout: 20 * time.Second, Limits: oob.Limits{PeerUnpulledBytes: 2 * size}})
	peer := transport.LocalID() // the client is this process
	t.Cleanup(func() {
		// After netRPCPair's cleanup, which closes the client.
		require.Eventually(t, func() bool {
			st := oob.ReadStats()
			return oob.Unpulled(peer) == 0 && st.Offered == 0 && st.Waiting == 0
		}, 10*time.Second, time.Millisecond)
		oob.SetTransferConfig(oob.TransferConfig{})
	})
	client := netRPCPair(t, []gdrpc.Option{gdrpc.WithTransport(transport.ModeTCP), processEngine}, nil)

	for i := range 2 {
		require.NoError(t, client.Call("Tensors.Make", &tensorpb.Sized{Size: size, Seed: 4}, &emptypb.Empty{}), "call %d", i)
	}
	require.Equal(t, int64(2*size), oob.Unpulled(peer))
	call := client.Go("Tensors.Make", &tensorpb.Sized{Size: size, Seed: 4}, &emptypb.Empty{}, nil)
	require.Eventually(t, func() bool { return oob.ReadStats().Waiting == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, int64(2*size), oob.Unpulled(peer), "the third reply waits")
	select {
	case <-call.Done:
		t.Fatalf("the third call returned: %v", call.Error)
	default:
	}
}

// Mixed is a net/rpc service whose reply carries a payload out-of-band and
// another inline.
type Mixed struct{ data, blob int }

func (m *Mixed) Get(r *tensorpb.Sized, t *tensorpb.Tensor) error {
	b := devicebuf.HostFromBytes(pattern(m.data, r.Seed))
	defer b.Release()
	*t = tensorpb.Tensor{Data: gdrcodec.New(b), Blob: pattern(m.blob, r.Seed)}
	return nil
}

// A reply the server codec refuses before writing a byte of it (its inline
// payload makes its body over the bound, 4 MiB) gives back the receive space its
// other payload was written into: the client never learns of that write.
func TestNetRPCRefusedReplyGivesSpaceBack(t *testing.T) {
	requireUCX(t)
	require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
	const eager = 70 << 20
	gdrcodec.Register(gdrcodec.WithEagerThreshold(eager))
	t.Cleanup(func() { gdrcodec.Register() })
	counter := &advertisedCounter{}
	trusted := []gdrpc.Option{gdrpc.WithTransport(transport.ModeUCX), gdrpc.WithTrustPeers()}
	client := netRPCPairServing(t, &Mixed{data: 80 << 20, blob: 65 << 20}, trusted,
		append(trusted, gdrpc.WithReceiveSpace(256<<20), gdrpc.WithMetrics(counter)))

	var got tensorpb.Tensor
	require.NoError(t, client.Call("Tensors.Make", &tensorpb.Sized{Size: eager, Seed: 1}, &got), "pulled: it prompts the space")
	gdrcodec.ReleaseAll(&got)
	waitPeerSpace(t)
	err := client.Call("Mixed.Get", &tensorpb.Sized{Seed: 2}, &tensorpb.Tensor{})
	require.ErrorContains(t, err, "the reply could not be sent")
	require.Equal(t, int64(1), counter.pulled.Load())
	require.Zero(t, counter.landed.Load())
	require.Zero(t, oob.ReadStats().PeerTaken, "the refused reply's range is given back")

	const n = 200 << 20 // it fits only where the refused reply's 80 MiB went
	require.NoError(t, client.Call("Tensors.Make", &tensorpb.Sized{Size: n, Seed: 3}, &got))
	p, err := tensor.Bytes(got.Data)
	require.NoError(t, err)
	requireBytes(t, pattern(n, 3), p)
	gdrcodec.ReleaseAll(&got)
	require.Equal(t, int64(1), counter.landed.Load(), "the space had room for it")
}

// Crowded replies with a payload of data bytes, out-of-band, and
// MaxPayloads empty ones: one too many for the client.
type Crowded struct{ data int }

func (c *Crowded) Get(r *tensorpb.Sized, t *tensorpb.Tensor) error {
	b := devicebuf.HostFromBytes(pattern(c.data, r.Seed))
	defer b.Release()
	*t = tensorpb.Tensor{Data: gdrcodec.New(b), Parts: make([]*gdrv1.DeviceBuffer, gdrcodec.MaxPayloads)}
	for i := range t.Parts {
		t.Parts[i] = &gdrv1.DeviceBuffer{}
	}
	return nil
}

// Undecodable replies a Tensor whose data (field 3) lands in the client's
// receive space and whose blob (field 4) holds bytes that are not UTF-8.
type Undecodable struct{ data int }

func (u *Undecodable) Get(r *tensorpb.Sized, t *tensorpb.Tensor) error {
	b := devicebuf.HostFromBytes(pattern(u.data, r.Seed))
	defer b.Release()
	*t = tensorpb.Tensor{Data: gdrcodec.New(b), Blob: []byte{0xff, 0xfe}}
	return nil
}

// A reply the client refuses before decoding it (more than MaxPayloads
// payloads), or one that passes the precount but fails to decode (into
// nestedpb.Outer, whose field 3 is a DeviceBuffer and field 4 a string),
// gives back the receive space its payload was written into: net/rpc has no
// end of call that would, and its client, which stops reading at a body's
// error, leaves the session up until it is closed.
func TestNetRPCBadReplyGivesSpaceBack(t *testing.T) {
	for _, tc := range []struct {
		name, method string
		rcvr         any
		reply        proto.Message
		err          string
	}{
		{"refused", "Crowded.Get", &Crowded{data: 80 << 20}, &tensorpb.Tensor{}, "more than 4096 payloads"},
		{"undecodable", "Undecodable.Get", &Undecodable{data: 8 << 20}, &nestedpb.Outer{}, "UTF-8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			requireUCX(t)
			require.Eventually(t, func() bool { return transport.ReadStats().Sessions == 0 }, 10*time.Second, 5*time.Millisecond)
			trusted := []gdrpc.Option{gdrpc.WithTransport(transport.ModeUCX), gdrpc.WithTrustPeers()}
			client := netRPCPairServing(t, tc.rcvr, trusted, append(trusted, gdrpc.WithReceiveSpace(256<<20)))

			var got tensorpb.Tensor
			require.NoError(t, client.Call("Tensors.Make", &tensorpb.Sized{Size: 1 << 20, Seed: 1}, &got), "pulled: it prompts the space")
			gdrcodec.ReleaseAll(&got)
			waitPeerSpace(t)
			err := client.Call(tc.method, &tensorpb.Sized{Seed: 2}, tc.reply)
			require.ErrorContains(t, err, tc.err)
			require.NotZero(t, oob.ReadStats().PeerSpaces, "the session is still up")
			require.Eventually(t, func() bool { return oob.ReadStats().PeerTaken == 0 }, 10*time.Second, time.Millisecond,
				"the reply's range is given back: %+v", oob.ReadStats())
		})
	}
}
