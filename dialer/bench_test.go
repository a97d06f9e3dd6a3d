package dialer_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	testpb "google.golang.org/grpc/interop/grpc_testing"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
)

// benchCases: gdrpc over each transport, and plain gRPC over TCP (the
// baseline) in the same run; and UCX shm with the gRPC stream multiplexed by
// yamux instead of on a lane, to show what the lanes save.
func benchCases() []transportCase {
	shm := transportCases[0]
	shm.name, shm.noLanes = shm.name+"-yamux", true
	return append(append([]transportCase{plainCase}, transportCases...), shm)
}

// reportLatency reports the median and 99th percentile of the samples.
func reportLatency(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// BenchmarkUnary: one unary call with a 1 KiB request and response.
func BenchmarkUnary(b *testing.B) {
	for _, tc := range benchCases() {
		b.Run("transport="+tc.name+"/size=1KiB", func(b *testing.B) { benchUnary(b, serve(b, tc)) })
	}
}

// BenchmarkUnaryProcesses: BenchmarkUnary with the server in another
// process, as in a deployment.
func BenchmarkUnaryProcesses(b *testing.B) {
	for _, tc := range append([]transportCase{plainCase}, transportCases...) {
		b.Run("transport="+tc.name+"/size=1KiB", func(b *testing.B) {
			role, dopts := "plain-grpc-server", []grpc.DialOption{grpc.WithTransportCredentials(insecureCreds())}
			if !tc.plain {
				role, dopts = "grpc-server", dialer.New(gdrpc.WithSessionOptions(tc.options(b)...)).DialOptions(nil)
			}
			_, line := startChild(b, nil, role, "GDRPC_TEST_LISTEN=127.0.0.1:0", "GDRPC_TEST_UCX="+tc.ucx)
			addr, ok := strings.CutPrefix(line, "ADDR ")
			require.True(b, ok, line)
			cc, err := grpc.NewClient("passthrough:///"+addr, dopts...)
			require.NoError(b, err)
			b.Cleanup(func() { _ = cc.Close() })
			benchUnary(b, cc)
		})
	}
}

func benchUnary(b *testing.B, cc *grpc.ClientConn) {
	c := testpb.NewTestServiceClient(cc)
	ctx := context.Background()
	req := &testpb.SimpleRequest{Payload: &testpb.Payload{Body: pattern(1024)}}
	if _, err := c.UnaryCall(ctx, req); err != nil { // connect outside the timing
		b.Fatal(err)
	}
	b.SetBytes(1024)
	b.ReportAllocs()
	lat := make([]time.Duration, 0, 1024)
	for b.Loop() {
		start := time.Now()
		resp, err := c.UnaryCall(ctx, req)
		lat = append(lat, time.Since(start))
		if err != nil || len(resp.GetPayload().GetBody()) != 1024 {
			b.Fatal(err)
		}
	}
	reportLatency(b, lat)
}

// BenchmarkStream: client streaming of 1 MiB messages (throughput).
func BenchmarkStream(b *testing.B) {
	const size = 1 << 20
	for _, tc := range benchCases() {
		b.Run("transport="+tc.name+"/size=1MiB", func(b *testing.B) {
			c := testpb.NewTestServiceClient(serve(b, tc))
			ctx := context.Background()
			st, err := c.StreamingInputCall(ctx)
			if err != nil {
				b.Fatal(err)
			}
			msg := &testpb.StreamingInputCallRequest{Payload: &testpb.Payload{Body: pattern(size)}}
			if err := st.Send(msg); err != nil { // warm up
				b.Fatal(err)
			}
			n := 1
			b.SetBytes(size)
			b.ReportAllocs()
			for b.Loop() {
				if err := st.Send(msg); err != nil {
					b.Fatal(err)
				}
				n++
			}
			r, err := st.CloseAndRecv()
			if err != nil {
				b.Fatal(err)
			}
			if int(r.GetAggregatedPayloadSize()) != n*size {
				b.Fatalf("server got %d bytes, want %d", r.GetAggregatedPayloadSize(), n*size)
			}
		})
	}
}
