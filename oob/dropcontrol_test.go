package oob

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/transport"
)

// A peer that sends malformed control messages as fast as it writes gets
// one Warn line for them; the others go to Debug, and the session stays up.
func TestDroppedControlLogBounded(t *testing.T) {
	var logs testenv.LogBuffer
	setTransferConfig(t, TransferConfig{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	_, cs, ss, _, _ := lanePair(t, opts, opts)

	const n = 500
	for range n {
		require.NoError(t, sendControl(context.Background(), cs, ctlFIN, nil)) // a FIN of no bytes
	}
	count := func(level string) int {
		k := 0
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "dropping control message") && strings.Contains(line, "level="+level) {
				k++
			}
		}
		return k
	}
	require.Eventually(t, func() bool { return count("WARN")+count("DEBUG") == n }, 10*time.Second, time.Millisecond)
	require.Equal(t, 1, count("WARN"))
	require.NoError(t, ss.Err(), "the server's session")
}
