package interop_test

import (
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/transport"
)

// TestKeepAliveAfterLoad: a server takes 1,000 concurrent calls with
// out-of-band payloads, then 64 client processes (16 dialing at once) each
// make a call and keep their sessions open for a keepalive period and
// timeout. The server holds
// many descriptors, as a busy one does: whatever the server does per
// connection in proportion to them must not keep its sessions from answering
// pings. No session of the server, of the loading client or of the 64
// clients may close because its peer did not answer keepalive, and every call
// must complete.
func TestKeepAliveAfterLoad(t *testing.T) {
	const (
		calls   = 1000
		clients = 64
		// clientWave is how many clients dial at once.
		clientWave = 16
		size       = gdrcodec.StreamEagerThreshold // out-of-band over every session
		interval   = time.Second
		timeout    = transport.DefaultKeepAliveTimeout
		// hold is how long the clients keep their sessions open once all
		// made their call: a ping sent while they connected is answered or
		// runs out its timeout meanwhile, and every session pings again.
		hold = interval + timeout
	)
	if testing.Short() {
		t.Skip("starts 65 processes")
	}
	for _, tc := range transportCases[:3] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			noSessions(t)
			ka := envKeepAlive + "=" + interval.String() + "," + timeout.String()
			losses := &sessionLosses{}
			opts := tc.options(t, transport.WithKeepAlive(interval, timeout), transport.WithMetrics(losses))
			testenv.OpenDescriptors(t, 15000)
			addr := startServer(t, opts, nil, bothServices).addr

			// The load: calls on one session at once.
			cc := dialClient(t, addr, opts, nil)
			client := tensorpb.NewTensorServiceClient(cc)
			ctx := callCtx(t)
			want := tensor.ChecksumBytes(pattern(size, 7))
			var done atomic.Int64
			errs := make(chan error, calls)
			var wg sync.WaitGroup
			for range calls {
				wg.Go(func() {
					src := devicebuf.HostFromBytes(pattern(size, 7))
					req := &tensorpb.Tensor{Name: "load", Data: gdrcodec.New(src)}
					src.Release()
					sum, err := client.Digest(ctx, req)
					gdrcodec.ReleaseAll(req)
					switch {
					case err != nil:
						errs <- err
					case sum.Crc32C != want || sum.Bytes != size:
						errs <- fmt.Errorf("digest: %d bytes crc %08x, want %d crc %08x", sum.Bytes, sum.Crc32C, size, want)
					default:
						done.Add(1)
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.EqualValues(t, calls, done.Load(), "calls of the load completed")

			// Right after it, the clients, in waves: Debian's UCX 1.13 can
			// abort a listener's process when many connection requests race
			// with closing sockets (README, Known limits), which no code of
			// gdrpc's can prevent, and this test is about keepalive.
			kids := make([]*child, 0, clients)
			for len(kids) < clients {
				wave := make([]*child, min(clientWave, clients-len(kids)))
				for i := range wave {
					wave[i] = startChild(t, "hold-client", nil, envUCX+"="+tc.ucx, ka, envAddr+"="+addr, envSize+"="+strconv.Itoa(size))
				}
				for _, k := range wave {
					k.waitLineFor("CALLED", holdClientTimeout) // after its call succeeded; fails on its FAIL
				}
				kids = append(kids, wave...)
			}
			time.Sleep(hold) // the span observed: the sessions stay open and ping

			lost := 0
			for _, k := range kids {
				require.NoError(t, k.stdin.Close())
				require.NoError(t, k.wait())
				n, err := strconv.Atoi(k.waitLine("LOST "))
				require.NoError(t, err)
				lost += n
			}
			require.Zero(t, lost, "client sessions lost to keepalive")
			require.Zero(t, losses.keepalive.Load(), "server and loading client sessions lost to keepalive")
		})
	}
}
