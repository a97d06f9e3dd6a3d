package transport_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// A Shutdown called after the first one returned reports the first's
// result (nil) whatever its own context, as the Dialer's does (a select on
// both, ready together, returned ctx's error about half the time).
func TestShutdownAfterShutdownReturnsNil(t *testing.T) {
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP))
	require.NoError(t, err)
	require.NoError(t, l.Shutdown(context.Background()))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	bad := 0
	for range 200 {
		if l.Shutdown(ctx) != nil {
			bad++
		}
	}
	require.Zero(t, bad, "of 200 Shutdowns after a completed one with a done context, %d returned ctx's error", bad)
}
