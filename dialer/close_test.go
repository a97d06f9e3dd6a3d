package dialer_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	testpb "google.golang.org/grpc/interop/grpc_testing"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

// A client process that closes its ClientConn, then its Dialer, before it
// exits ends its session cleanly: its server logs the session closed by its
// peer, at debug level, not lost (ClientConn.Close alone does not wait for
// the session, and a UCX session cut short by the exit looks lost).
func TestDialerCloseEndsSessions(t *testing.T) {
	for _, tc := range []transportCase{transportCases[0], transportCases[2]} {
		t.Run(tc.name, func(t *testing.T) {
			var logs testenv.LogBuffer
			logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			lis, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(tc.options(t)...), gdrpc.WithLogger(logger))
			require.NoError(t, err)
			srv := grpc.NewServer(listener.ServerOptions(nil)...)
			testpb.RegisterTestServiceServer(srv, testService{})
			go func() { _ = srv.Serve(lis) }()
			defer srv.Stop()

			_, line := startChild(t, nil, "grpc-client", "GDRPC_TEST_ADDR="+lis.Addr().String(), "GDRPC_TEST_UCX="+tc.ucx, "GDRPC_TEST_DIALER_CLOSE=1")
			require.Equal(t, "OK transport="+tc.want()+" samehost=true", line)
			// The child printed its line once its Dialer was closed.
			require.Eventually(t, func() bool {
				return strings.Contains(logs.String(), "session closed") || strings.Contains(logs.String(), "session lost")
			},
				testTimeout, time.Millisecond)
			require.NotContains(t, logs.String(), "session lost", "the server's log")
		})
	}
}

// A closed Dialer dials no more, and closes a second time as it did the
// first.
func TestDialerClosed(t *testing.T) {
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP))
	require.NoError(t, d.Close())
	_, err := d.DialContext(t.Context(), "127.0.0.1:1")
	require.ErrorContains(t, err, "dialer closed")
	require.NoError(t, d.Close())
}
