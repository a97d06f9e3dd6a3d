package gdrotel_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/gdrotel"
	"github.com/gdrpc/gdrpc/internal/face"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// TestWithTransport wires a Recorder into real sessions and the out-of-band
// engine, as an application does, and reads what a pull, a failed pull and
// the sessions' end recorded.
func TestWithTransport(t *testing.T) {
	h := newHarness(t)
	// As packages dialer and listener wire their options into sessions.
	metrics := notifyingMetrics{Recorder: h.rec, down: make(chan bool, 2)}
	client, server := transporttest.Pair(t, face.SessionOptions([]gdrpc.Option{gdrpc.WithMetrics(metrics)})...)
	require.Equal(t, client.Transport(), server.Transport())
	session := "transport=" + client.Transport()
	r := h.collect(t)
	require.Equal(t, map[string]int64{"side=client," + session: 1, "side=server," + session: 1},
		r.sum(t, "gdrpc.session.active", "{session}", false))

	payload := bytes.Repeat([]byte("gdrpc"), 100<<10)
	d := oob.Offer(oob.Source{Bytes: payload}, oob.OfferOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), transporttest.Timeout)
	defer cancel()
	got := make([]byte, len(payload))
	path, err := oob.FetchBytes(ctx, d, got)
	require.NoError(t, err)
	require.Equal(t, payload, got)

	stale := d // its entry left after the pull
	_, err = oob.FetchBytes(ctx, stale, got)
	var te *oob.TransferError
	require.ErrorAs(t, err, &te)
	require.Equal(t, oob.TransferNotFound, te.Kind)

	route := "path=" + path.String() + ",route=" + oob.TransferInfo{Path: path}.Route()
	r = h.collect(t)
	require.Equal(t, map[string]int64{ // the failed pull moved nothing: no bytes
		"advertised=false,direction=receive,memory=host,outcome=ok," + route: int64(len(payload)),
		"advertised=false,direction=send,memory=host,outcome=ok," + route:    int64(len(payload)),
	}, r.sum(t, "gdrpc.transfer.io", "By", true))
	require.Equal(t, map[string]int64{ // the failed pull counts as one, of its kind
		"advertised=false,direction=receive,memory=host,outcome=ok," + route:                                     1,
		"advertised=false,direction=send,memory=host,outcome=ok," + route:                                        1,
		"advertised=false,direction=receive,error.type=not_found,memory=host,outcome=error,path=none,route=none": 1,
	}, r.sum(t, "gdrpc.transfers", "{transfer}", true))

	require.NoError(t, client.Close())
	timeout := time.After(transporttest.Timeout)
	for range 2 { // the client's end, and the server's when it notices
		select {
		case <-metrics.down:
		case <-timeout:
			t.Fatal("the server session outlived its peer")
		}
	}
	require.True(t, errors.Is(server.Err(), transport.ErrPeerGone), "server: %v", server.Err())
	r = h.collect(t)
	require.Equal(t, map[string]int64{"side=client," + session: 0, "side=server," + session: 0},
		r.sum(t, "gdrpc.session.active", "{session}", false))
	require.Equal(t, map[string]int64{
		"outcome=closed,side=client," + session:    1,
		"outcome=peer_gone,side=server," + session: 1,
	}, r.sum(t, "gdrpc.session.closed", "{session}", true))
	transporttest.NoSessions(t)
}

// notifyingSessions passes session events on and then reports each
// SessionDown on down: a session's Done closes before its SessionDown runs.
type notifyingMetrics struct {
	*gdrotel.Recorder
	down chan bool
}

func (n notifyingMetrics) SessionDown(transportName string, client bool, err error) {
	n.Recorder.SessionDown(transportName, client, err)
	n.down <- client
}
