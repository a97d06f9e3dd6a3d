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
