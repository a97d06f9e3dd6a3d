package transport_test

import (
	"context"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

func reportLatency(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// benchConn is a conn pair to benchmark: the gdrpc conn over each
// transport, a raw TCP conn (the baseline) and a raw UCX endpoint (what the
// gdrpc conn runs on over UCX, without the multiplexer).
type benchConn struct {
	name string
	make func(b *testing.B) (c1, c2 net.Conn)
}

func tcpPair(b *testing.B) (net.Conn, net.Conn) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	ch := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		ch <- c
	}()
	c1, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	c2 := <-ch
	if c2 == nil {
		b.Fatal("accept failed")
	}
	b.Cleanup(func() {
		_ = c1.Close()
		_ = c2.Close()
	})
	return c1, c2
}

func endpointPair(b *testing.B, tls string) (net.Conn, net.Conn) {
	rc := ucxContext(b, tls)
	w2, err := rc.NewWorker()
	if err != nil {
		b.Fatal(err)
	}
	l, err := w2.Listen("127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	ch := make(chan *rdma.Endpoint, 1)
	go func() {
		e, _ := l.Accept(ctx)
		ch <- e
	}()
	c1, err := rc.Worker().Dial(ctx, l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	c2 := <-ch
	if c2 == nil {
		b.Fatal("accept failed")
	}
	b.Cleanup(func() {
		_ = c1.Close()
		_ = c2.Close()
		_ = w2.Close()
	})
	return c1, c2
}

func benchConns() []benchConn {
	out := []benchConn{{name: "raw-tcp", make: tcpPair}}
	for _, tc := range transportCases {
		out = append(out, benchConn{name: "gdrpc-" + tc.name, make: func(b *testing.B) (net.Conn, net.Conn) {
			p := dialPair(b, tc.options(b))
			return p.cc, p.sc
		}})
	}
	// The same session over UCX shm with its gRPC stream multiplexed by
	// yamux rather than on a lane: what the lanes save.
	shm := transportCases[1]
	out = append(out, benchConn{name: "gdrpc-" + shm.name + "-yamux", make: func(b *testing.B) (net.Conn, net.Conn) {
		p := dialPair(b, shm.options(b, transport.WithLanes(false)))
		return p.cc, p.sc
	}})
	for _, tc := range transportCases[1:] {
		out = append(out, benchConn{name: "raw-" + tc.name, make: func(b *testing.B) (net.Conn, net.Conn) {
			return endpointPair(b, tc.ucx)
		}})
	}
	return out
}

// pingPong sends 64 bytes on c and reads them back, b.N times, and reports
// the latencies (the far end echoes).
func pingPong(b *testing.B, c net.Conn) {
	buf := make([]byte, 64)
	lat := make([]time.Duration, 0, 4096)
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	reportLatency(b, lat)
}

// BenchmarkConnPingPong: a 64-byte message there and back on one conn.
func BenchmarkConnPingPong(b *testing.B) {
	for _, bc := range benchConns() {
		b.Run("transport="+bc.name+"/size=64B", func(b *testing.B) {
			c1, c2 := bc.make(b)
			go func() { _, _ = io.Copy(c2, c2) }()
			pingPong(b, c1)
		})
	}
}

// BenchmarkConnPingPongProcesses: BenchmarkConnPingPong with the echoing end
// in another process, as in a deployment: raw TCP, and gdrpc sessions over
// each transport (a gRPC stream conn).
func BenchmarkConnPingPongProcesses(b *testing.B) {
	type pcase struct {
		name string
		dial func(b *testing.B) net.Conn
	}
	cases := []pcase{{name: "raw-tcp", dial: func(b *testing.B) net.Conn {
		_, addr := startChild(b, "tcp-echo-server")
		c, err := net.Dial("tcp", addr)
		require.NoError(b, err)
		b.Cleanup(func() { _ = c.Close() })
		return c
	}}}
	for _, tc := range transportCases {
		cases = append(cases, pcase{name: "gdrpc-" + tc.name, dial: func(b *testing.B) net.Conn {
			if tc.ucx != "" {
				requireUCX(b)
			}
			_, addr := startChild(b, "echo-server", childEnvFor(tc)...)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			s, err := transport.Dial(ctx, addr, tc.options(b)...)
			require.NoError(b, err)
			b.Cleanup(func() { _ = s.Close() })
			c, err := s.Conn(ctx)
			require.NoError(b, err)
			return c
		}})
	}
	for _, pc := range cases {
		b.Run("transport="+pc.name+"/size=64B", func(b *testing.B) {
			c := pc.dial(b)
			pingPong(b, c)
		})
	}
}

// BenchmarkConnStream: one-way throughput in 1 MiB writes.
func BenchmarkConnStream(b *testing.B) {
	const size = 1 << 20
	for _, bc := range benchConns() {
		b.Run("transport="+bc.name+"/size=1MiB", func(b *testing.B) {
			c1, c2 := bc.make(b)
			done := make(chan int64, 1)
			go func() {
				n, _ := io.Copy(io.Discard, c2)
				done <- n
			}()
			buf := make([]byte, size)
			b.SetBytes(size)
			b.ReportAllocs()
			n := int64(0)
			for b.Loop() {
				if _, err := c1.Write(buf); err != nil {
					b.Fatal(err)
				}
				n += size
			}
			_ = c1.Close()
			if got := <-done; got != n {
				b.Fatalf("received %d bytes, want %d", got, n)
			}
		})
	}
}
