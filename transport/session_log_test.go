package transport_test

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/transport"
)

// TestLogsShowTransport: the debug log of a new session names its transport,
// its peer and its session id.
func TestLogsShowTransport(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			var buf testenv.LogBuffer
			logger := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
			dialPair(t, tc.options(t, transport.WithLogger(logger)))
			var up []string
			for _, line := range strings.Split(buf.String(), "\n") {
				if strings.Contains(line, `msg="session up"`) {
					up = append(up, line)
				}
			}
			require.Len(t, up, 2, buf.String())
			for _, line := range up {
				require.Contains(t, line, "transport="+tc.want())
				require.Contains(t, line, "peer="+transport.LocalID().String())
				require.Contains(t, line, "component=gdrpc/transport")
			}
			require.Contains(t, strings.Join(up, "\n"), "role=client")
			require.Contains(t, strings.Join(up, "\n"), "role=server")
		})
	}
}
