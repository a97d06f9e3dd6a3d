package oob

import (
	"bytes"
	"context"
	"io"
	"runtime/trace"
	"testing"

	"github.com/stretchr/testify/require"
	xtrace "golang.org/x/exp/trace"

	"github.com/gdrpc/gdrpc/devicebuf"
)

// A pull that gives up while it waits for the owner's FIN ends its trace
// regions first: a trace whose goroutine ends an enclosing region before an
// inner one is refused whole by trace readers (gdrtrace among them).
func TestPullGivenUpEndsItsRegions(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout})
	_, victim, rtrs := silentOwner(t, 1)
	var buf bytes.Buffer
	require.NoError(t, trace.Start(&buf))
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		r := trace.StartRegion(ctx, "test.call") // the caller's own region around the pull
		d := Descriptor{Owner: victim.Peer().ID, Token: Token(newToken()), Length: 1 << 10, Kind: devicebuf.Host, Device: -1}
		_, err := FetchBytes(ctx, d, make([]byte, d.Length))
		r.End()
		errc <- err
	}()
	waitFor(t, rtrs, "the RTR at the owner")
	cancel()
	var te *TransferError
	require.ErrorAs(t, waitFor(t, errc, "the pull's end"), &te)
	require.Equal(t, TransferCanceled, te.Kind)
	trace.Stop()

	rd, err := xtrace.NewReader(&buf)
	require.NoError(t, err)
	waits := 0
	for {
		ev, err := rd.ReadEvent()
		if err == io.EOF {
			break
		}
		require.NoError(t, err, "the trace reader refused the trace")
		if ev.Kind() == xtrace.EventRegionEnd && ev.Region().Type == "gdrpc.wait-fin" {
			waits++
		}
	}
	require.Equal(t, 1, waits, "the wait for the FIN ended its region")
}
