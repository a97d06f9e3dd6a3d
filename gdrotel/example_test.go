package gdrotel_test

import (
	"context"
	"fmt"
	"log"
	"slices"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/gdrotel"
	"github.com/gdrpc/gdrpc/listener"
)

// A Recorder is a gdrpc.Metrics: the listener and the dialer take it with
// gdrpc.WithMetrics. This process is both server and client of one call
// whose 1 MiB payload moves out-of-band, so the metrics show both ends: the
// server sent the payload, the client received it.
func Example() {
	// An application gives New its own MeterProvider, whose reader exports;
	// this one is read by hand below.
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer provider.Shutdown(context.Background())
	rec, err := gdrotel.New(provider)
	if err != nil {
		log.Fatal(err)
	}

	gdrcodec.Register()
	lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithMetrics(rec))
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(listener.ServerOptions(nil)...)
	tensorpb.RegisterTensorServiceServer(srv, &tensor.Server{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	d := dialer.New(gdrpc.WithMetrics(rec))
	defer d.Close() // after cc.Close: it ends the sessions the dialer made
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), d.DialOptions(nil)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	t, err := tensorpb.NewTensorServiceClient(cc).Make(context.Background(), &tensorpb.Sized{Size: 1 << 20, Seed: 1})
	if err != nil {
		log.Fatal(err)
	}
	gdrcodec.ReleaseAll(t)

	printMetrics(reader, "gdrpc.session.active", "gdrpc.transfer.io", "gdrpc.transfer.duration")
	// Output:
	// gdrpc.session.active{side=client,transport=tcp} 1
	// gdrpc.session.active{side=server,transport=tcp} 1
	// gdrpc.transfer.io{advertised=false,direction=receive,memory=host,outcome=ok,path=stream,route=stream} 1048576
	// gdrpc.transfer.io{advertised=false,direction=send,memory=host,outcome=ok,path=stream,route=stream} 1048576
	// gdrpc.transfer.duration{advertised=false,direction=receive,memory=host,outcome=ok,path=stream,route=stream} count=1
	// gdrpc.transfer.duration{advertised=false,direction=send,memory=host,outcome=ok,path=stream,route=stream} count=1
}

// A pool's counters are read at each collection: how much registered memory
// it holds, how much is handed out, and how often an allocation found a
// registered block (a hit) or made a new region (a miss).
func ExampleRecorder_ObservePool() {
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer provider.Shutdown(context.Background())
	rec, err := gdrotel.New(provider)
	if err != nil {
		log.Fatal(err)
	}

	pool, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 16 << 20})
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	unregister, err := rec.ObservePool("staging", pool)
	if err != nil {
		log.Fatal(err)
	}
	defer unregister()

	b, _ := pool.Alloc(100 << 10) // a miss: the pool makes a region of the 128 KiB class
	b.Release()
	b, _ = pool.Alloc(120 << 10) // a hit: a block of that region
	defer b.Release()

	printMetrics(reader, "gdrpc.pool.allocations", "gdrpc.pool.buffer.count", "gdrpc.pool.buffer.usage", "gdrpc.pool.region.usage")
	// Output:
	// gdrpc.pool.allocations{pool=staging,result=exhausted} 0
	// gdrpc.pool.allocations{pool=staging,result=hit} 1
	// gdrpc.pool.allocations{pool=staging,result=miss} 1
	// gdrpc.pool.buffer.count{pool=staging} 1
	// gdrpc.pool.buffer.usage{pool=staging} 131072
	// gdrpc.pool.region.usage{pool=staging} 4194304
}

// printMetrics collects reader and prints the data points of the named
// metrics, in the order of names and then of their attributes: the value of a
// sum, the count of a histogram.
func printMetrics(reader sdkmetric.Reader, names ...string) {
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		log.Fatal(err)
	}
	byName := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			byName[m.Name] = m.Data
		}
	}
	for _, name := range names {
		var lines []string
		switch data := byName[name].(type) {
		case metricdata.Sum[int64]:
			for _, dp := range data.DataPoints {
				lines = append(lines, fmt.Sprintf("%s{%s} %d", name, dp.Attributes.Encoded(attribute.DefaultEncoder()), dp.Value))
			}
		case metricdata.Histogram[float64]:
			for _, dp := range data.DataPoints {
				lines = append(lines, fmt.Sprintf("%s{%s} count=%d", name, dp.Attributes.Encoded(attribute.DefaultEncoder()), dp.Count))
			}
		}
		slices.Sort(lines)
		for _, l := range lines {
			fmt.Println(l)
		}
	}
}
