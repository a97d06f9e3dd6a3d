package gdrcodec_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// sharedOrder makes two calls that send one message overlap so that call
// "a" ends after call "b" marshaled the message and before b's server
// pulled it: a's server handler waits until b's message went out (bSent),
// b's server waits until the test saw a return (aDone) to read it.
type sharedOrder struct {
	tensor.Server
	aIn, bSent, aDone, stop chan struct{}
	sentOnce                sync.Once
	// numbers has what Digest saw of each call's number: its header's
	// (the joining call's) and the one the server's record holds.
	mu      sync.Mutex
	numbers map[string]callSeen
}

func newSharedOrder() *sharedOrder {
	return &sharedOrder{aIn: make(chan struct{}), bSent: make(chan struct{}), aDone: make(chan struct{}), stop: make(chan struct{})}
}

func which(md metadata.MD) string {
	if v := md.Get("x-which"); len(v) > 0 {
		return v[0]
	}
	return ""
}

// wait returns nil once c is closed, or an error once the test is over.
func (o *sharedOrder) wait(c chan struct{}) error {
	select {
	case <-c:
		return nil
	case <-o.stop:
		return status.Error(codes.Aborted, "test over")
	}
}

func (o *sharedOrder) Digest(ctx context.Context, t *tensorpb.Tensor) (*tensorpb.Summary, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	noted, call := gdrcodec.CallNotedForTest(ctx)
	o.mu.Lock()
	if o.numbers == nil {
		o.numbers = map[string]callSeen{}
	}
	o.numbers[which(md)] = callSeen{number: md.Get(oob.CallHeader), noted: noted, call: call}
	o.mu.Unlock()
	if which(md) == "a" {
		close(o.aIn)
		if err := o.wait(o.bSent); err != nil {
			return nil, err
		}
	}
	return o.Server.Digest(ctx, t)
}

func (o *sharedOrder) Upload(st tensorpb.TensorService_UploadServer) error {
	if err := o.wait(o.aDone); err != nil { // b's messages are pulled as they are read
		return err
	}
	return o.Server.Upload(st)
}

// serverStats, a server's stats handler that runs before gdrpc's, holds a
// unary call "b" after gRPC decoded its request and before gdrpc's handler
// pulls its payload, until a returned.
type serverStats struct{ o *sharedOrder }

func (s serverStats) HandleRPC(ctx context.Context, rs stats.RPCStats) {
	if _, ok := rs.(*stats.InPayload); !ok {
		return
	}
	if md, _ := metadata.FromIncomingContext(ctx); which(md) == "b" {
		s.o.wait(s.o.aDone) // the test over: the call goes on and fails
	}
}
func (serverStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (serverStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (serverStats) HandleConn(context.Context, stats.ConnStats)                       {}

// HandleRPC, a client's stats handler, closes bSent once b's request went.
func (o *sharedOrder) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.OutPayload); !ok {
		return
	}
	if md, _ := metadata.FromOutgoingContext(ctx); which(md) == "b" {
		o.sentOnce.Do(func() { close(o.bSent) })
	}
}
func (o *sharedOrder) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (o *sharedOrder) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (o *sharedOrder) HandleConn(context.Context, stats.ConnStats)                       {}

// One request message sent on two calls at once: gRPC marshals it for each,
// naming neither call, so the payloads of both are kept by the call that
// began first. Its end must not take from the outbox what the other call's
// server has yet to pull: b gets its bytes, byte-exact, after a returned,
// and once both ended nothing is left offered.
func TestSameMessageOnTwoCalls(t *testing.T) {
	const n = 1 << 20
	for _, mode := range []transport.Mode{transport.ModeTCP, transport.ModeUCX} {
		for _, second := range []string{"unary", "stream"} {
			t.Run("transport="+string(mode)+"/second="+second, func(t *testing.T) {
				o := newSharedOrder()
				r := newRigWith(t, mode, o, []grpc.ServerOption{grpc.StatsHandler(serverStats{o})})
				t.Cleanup(func() { close(o.stop) }) // before the rig's: nothing stays blocked
				d := dialer.New(gdrpc.WithTransport(mode), processEngine)
				cc, err := grpc.NewClient(r.cc.Target(), append(d.DialOptions(insecure.NewCredentials()), grpc.WithStatsHandler(o))...)
				require.NoError(t, err)
				t.Cleanup(func() { cc.Close() })
				c := tensorpb.NewTensorServiceClient(cc)

				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				as := metadata.AppendToOutgoingContext(ctx, "x-which", "a")
				bs := metadata.AppendToOutgoingContext(ctx, "x-which", "b")
				req := tensorOf(n, 7)
				defer func() {
					// released once neither call holds it: nothing of it stays offered
					require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond)
				}()
				defer gdrcodec.ReleaseAll(req)
				want := tensor.ChecksumBytes(pattern(n, 7))

				aErr := make(chan error, 1)
				go func() {
					sum, err := c.Digest(as, req)
					if err == nil && (sum.Bytes != n || sum.Crc32C != want) {
						err = status.Errorf(codes.DataLoss, "a: %d bytes, crc %08x", sum.Bytes, sum.Crc32C)
					}
					aErr <- err
				}()
				require.NoError(t, o.wait(o.aIn), "a's handler runs: a's request is sent and held")

				bErr := make(chan error, 1)
				go func() {
					var sum *tensorpb.Summary
					var err error
					if second == "unary" {
						sum, err = c.Digest(bs, req)
					} else {
						var st grpc.ClientStreamingClient[tensorpb.Tensor, tensorpb.Summary]
						if st, err = c.Upload(bs); err == nil {
							if err = st.Send(req); err == nil {
								sum, err = st.CloseAndRecv()
							}
						}
					}
					if err == nil && (sum.Bytes != n || sum.Crc32C != want) {
						err = status.Errorf(codes.DataLoss, "b: %d bytes, crc %08x", sum.Bytes, sum.Crc32C)
					}
					bErr <- err
				}()
				require.NoError(t, <-aErr, "a")
				close(o.aDone)
				require.NoError(t, <-bErr, "b: its payload outlived a's end")
				if second == "unary" {
					// a's marshals name a's number in the body, b's too
					// (they find a's hold): b names its own in a header,
					// which the server takes first.
					o.mu.Lock()
					a, b := o.numbers["a"], o.numbers["b"]
					o.mu.Unlock()
					require.Empty(t, a.number, "the first call's number went in a header")
					require.Len(t, b.number, 1, "the joining call named no number of its own")
					n, err := strconv.ParseUint(b.number[0], 16, 64)
					require.NoError(t, err)
					require.Equal(t, n, b.call, "the server took the body's number over the header's")
					require.NotZero(t, a.call)
					require.NotEqual(t, a.call, b.call, "both calls took one number")
				}
			})
		}
	}
}

// Many calls sending one message, unary and streams mixed, all get its bytes,
// and once they ended nothing of it is left offered.
func TestSameMessageOnManyCalls(t *testing.T) {
	const n, rounds = 1 << 20, 40
	r := newRig(t, transport.ModeTCP, nil)
	req := tensorOf(n, 9)
	defer gdrcodec.ReleaseAll(req)
	want := tensor.ChecksumBytes(pattern(n, 9))
	var wg sync.WaitGroup
	errs := make(chan error, 3*rounds)
	for g := range 3 {
		wg.Go(func() {
			for range rounds {
				var sum *tensorpb.Summary
				var err error
				if g == 2 {
					var st grpc.ClientStreamingClient[tensorpb.Tensor, tensorpb.Summary]
					if st, err = r.client.Upload(context.Background()); err == nil {
						if err = st.Send(req); err == nil {
							sum, err = st.CloseAndRecv()
						}
					}
				} else {
					sum, err = r.client.Digest(context.Background(), req)
				}
				if err == nil && (sum.Bytes != n || sum.Crc32C != want) {
					err = status.Errorf(codes.DataLoss, "%d bytes, crc %08x", sum.Bytes, sum.Crc32C)
				}
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return oob.ReadStats().Offered == 0 }, 10*time.Second, time.Millisecond)
}
