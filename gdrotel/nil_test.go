package gdrotel_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/gdrotel"
)

// A nil Option (an option chosen at run time, left unset) is skipped: it
// panicked New.
func TestNewNilOption(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	var opt gdrotel.Option // nil
	require.NotPanics(t, func() {
		rec, err := gdrotel.New(provider, opt, gdrotel.WithMaxReasons(4), gdrotel.WithMaxReasons(8))
		require.NoError(t, err)
		require.NotNil(t, rec)
	})
}

// ObservePool refuses a nil *devicebuf.Pool in its Pool interface as it does
// a nil pool: it got through, and the panic came later, inside the SDK's
// collection (a PeriodicReader's goroutine in a real process: the whole
// process went down, far from the call that caused it).
func TestObservePoolTypedNil(t *testing.T) {
	h := newHarness(t)
	var pool *devicebuf.Pool // e.g. a pool made only when a GPU is present
	unregister, err := h.rec.ObservePool("cuda:0", pool)
	require.Error(t, err)
	require.Nil(t, unregister)
	require.NotPanics(t, func() {
		var rm metricdata.ResourceMetrics
		_ = h.reader.Collect(context.Background(), &rm)
	})
}
