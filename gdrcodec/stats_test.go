package gdrcodec

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/stats"

	"github.com/gdrpc/gdrpc/devicebuf"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// A server call keeps, until it ends, only what its received messages still
// have attached: a long stream whose handler releases each message holds a
// bounded list, and the call's end releases what the handler kept.
func TestServerCallKeepsWhatIsAttached(t *testing.T) {
	attached := Attached()
	h := &serverStats{}
	ctx := h.TagRPC(context.Background(), &stats.RPCTagInfo{FullMethodName: "/gdrpc.test.Service/Upload"})
	h.HandleRPC(ctx, &stats.Begin{IsClientStream: true})
	c := ctx.Value(callKey{}).(*callMessages)
	kept := 0
	for i := range 20 * maxNoted {
		db := &gdrv1.DeviceBuffer{}
		setAttachment(db, devicebuf.HostFromBytes([]byte{byte(i)})) // as a decode does
		h.HandleRPC(ctx, &stats.InPayload{Payload: db})
		if i%100 == 0 {
			kept++ // the handler keeps this one
			continue
		}
		ReleaseAll(db)
	}
	c.mu.Lock()
	held := len(c.held)
	c.mu.Unlock()
	require.LessOrEqual(t, held, 2*maxNoted, "what a call keeps is bounded by what its handler holds")
	require.Equal(t, attached+kept, Attached())
	h.HandleRPC(ctx, &stats.End{})
	require.Equal(t, attached, Attached(), "the call's end releases what the handler kept")
}

// The second of a server's two sets of gdrpc options leaves a call to the
// first (TagRPC returns the first's record), but a call whose context
// derives from another call's that began (a server run under a handler's
// context) gets a record of its own, owned by its own handler.
func TestServerStatsTagsDerivedCall(t *testing.T) {
	h1, h2 := &serverStats{}, &serverStats{}
	info := &stats.RPCTagInfo{FullMethodName: "/gdrpc.test.Service/Echo"}
	ctx := h1.TagRPC(context.Background(), info)
	first := ctx.Value(callKey{}).(*callMessages)
	require.Same(t, first, h2.TagRPC(ctx, info).Value(callKey{}).(*callMessages), "the same call's second handler")
	h1.HandleRPC(ctx, &stats.Begin{})
	defer h1.HandleRPC(ctx, &stats.End{})
	derived := h2.TagRPC(ctx, info).Value(callKey{}).(*callMessages)
	require.NotSame(t, first, derived, "a call under another call's context")
	require.Same(t, h2, derived.owner)
}
