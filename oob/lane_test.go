package oob

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

// TestBulkLaneFrames: pieces on the bulk lane land in the destination of the
// pull their transfer names, interleaved with other transfers' pieces. A
// transfer for no pull, or too long for its pull's destination (which fails),
// is dropped; an aborted transfer fails its pull. The session lives on.
func TestBulkLaneFrames(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	piece := func(p *pull, req uint64, total int, off int, body string) {
		t.Helper()
		if p != nil {
			req = p.req
		}
		f := laneFrame{kind: laneData, req: req, total: uint64(total), off: uint64(off), n: uint64(len(body))}
		require.NoError(t, stateOf(cs).link.WriteLaneFrame(context.Background(), f.total, f.marshal(), []byte(body)))
	}
	p1, p2, p3, p4 := newPull(5), newPull(4), newPull(3), newPull(6)
	piece(nil, 1<<62, 8, 0, "nobo") // no such pull: dropped
	piece(p1, 0, 5, 0, "he")        // p1 begins
	piece(p3, 0, 3, 0, "e")         // p3 begins between p1's pieces
	piece(p2, 0, 8, 0, "too ")      // longer than p2's destination: p2 fails
	piece(nil, 1<<62, 8, 4, "dy's") // the rest of the dropped transfer
	piece(p1, 0, 5, 2, "llo")       // p1 done
	piece(p4, 0, 6, 0, "abc")       // p4 begins...
	piece(p2, 0, 8, 4, "long")      // dropped
	f := laneFrame{kind: laneAbort, req: p4.req, total: 6, off: 3}
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(context.Background(), f.total, f.marshal())) // ...and is given up
	piece(p3, 0, 3, 1, "nd")                                                                        // p3 done
	require.NoError(t, bulkResult(t, p1))
	require.ErrorContains(t, bulkResult(t, p2), "announces 8 bytes, destination holds 4")
	require.NoError(t, bulkResult(t, p3))
	require.ErrorContains(t, bulkResult(t, p4), "gave the transfer up")
	for p, want := range map[*pull]string{p1: "hello", p3: "end"} {
		b, err := p.dst.HostBytes()
		require.NoError(t, err)
		require.Equal(t, want, string(b))
	}
	requireLive(t, ss)
}

// TestBulkLaneBroken: a piece that does not continue its transfer breaks the
// lane; the transfers under way fail and the session ends.
func TestBulkLaneBroken(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	p := newPull(8)
	f := laneFrame{kind: laneData, req: p.req, total: 8, n: 4}
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(context.Background(), f.total, f.marshal(), []byte("1234")))
	f.off = 6 // a gap
	f.n = 2
	// The server drops the lane on reading the header, so the body's write
	// may fail or not.
	_ = stateOf(cs).link.WriteLaneFrame(context.Background(), f.total, f.marshal(), []byte("78"))
	require.ErrorContains(t, bulkResult(t, p), "lane closed mid-transfer")
	requireEnds(t, ss, "which is at 4 of 8")
}

// TestBulkLaneSettleBetweenFrames: a pull given up between two frames of
// its transfer settles at once (the reader holds the destination only while
// it reads a frame); the transfer's later frames are dropped, and the lane
// carries on.
func TestBulkLaneSettleBetweenFrames(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	ctx := context.Background()
	p := newPull(8)
	f := laneFrame{kind: laneData, req: p.req, total: 8, n: 4}
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(ctx, f.total, f.marshal(), []byte("1234")))
	settled := make(chan struct{})
	go func() {
		p.settled()
		close(settled)
	}()
	select {
	case <-settled:
	case <-time.After(20 * time.Second):
		t.Fatal("settling waits for the rest of the transfer")
	}
	f.off = 4
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(ctx, f.total, f.marshal(), []byte("5678")))
	next := newPull(3)
	g := laneFrame{kind: laneData, req: next.req, total: 3, n: 3}
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(ctx, g.total, g.marshal(), []byte("end")))
	require.NoError(t, bulkResult(t, next))
	b, err := next.dst.HostBytes()
	require.NoError(t, err)
	require.Equal(t, "end", string(b))
	select {
	case err := <-p.bulk:
		t.Fatalf("a settled pull got an outcome: %v", err)
	default:
	}
	requireLive(t, ss)
}

// TestBulkLaneStalledTransferHoldsNoDestination: a transfer the owner began
// on the bulk lane and then left (a FIN that failed the pull, or nothing at
// all) stays open on the reader until its next frame or the lane's end; the
// settled pull's destination does not stay with it, so a peer cannot keep
// received memory alive past the bounds that no longer count it.
func TestBulkLaneStalledTransferHoldsNoDestination(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	ctx := context.Background()
	// Go memory, as a pull for a []byte field gets: only references keep it.
	p, w := func() (*pull, weak.Pointer[byte]) {
		buf := make([]byte, 1<<20)
		return makePull(ss, devicebuf.HostFromBytes(buf)), weak.Make(&buf[0])
	}()
	p.list()
	f := laneFrame{kind: laneData, req: p.req, total: 1 << 20, n: 1}
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(ctx, f.total, f.marshal(), []byte("x")))
	// Frames are read in order: once the next transfer is in, so is the piece.
	next := newPull(3)
	g := laneFrame{kind: laneData, req: next.req, total: 3, n: 3}
	require.NoError(t, stateOf(cs).link.WriteLaneFrame(ctx, g.total, g.marshal(), []byte("end")))
	require.NoError(t, bulkResult(t, next))
	p.settled()
	require.Eventually(t, func() bool {
		runtime.GC()
		return w.Value() == nil
	}, 10*time.Second, 10*time.Millisecond, "the lane reader keeps a settled pull's destination")
	requireLive(t, ss)
}

// TestBulkLaneTooManyOpen: a peer that opens more transfers than the reader
// keeps breaks the lane and ends the session.
func TestBulkLaneTooManyOpen(t *testing.T) {
	ss, cs, _ := bulkLanePair(t)
	ctx := context.Background()
	for i := range maxLaneTransfers + 1 {
		f := laneFrame{kind: laneData, req: 1<<40 + uint64(i), total: 2, n: 1}
		if stateOf(cs).link.WriteLaneFrame(ctx, f.total, f.marshal(), []byte("x")) != nil {
			break // the server dropped the lane already
		}
	}
	requireEnds(t, ss, "more than 4096 transfers open")
}

// TestPushLane: a transfer longer than a frame arrives whole in pieces; a
// source shorter or longer than the transfer, or a context that ended, stops
// it with an abort that fails the receiver's pull, and the lane carries on.
func TestPushLane(t *testing.T) {
	ss, cs, newPull := bulkLanePair(t)
	ctx := context.Background()
	want := bytes.Repeat([]byte("0123456789abcdef"), (2*laneFrameMax+100)/16)
	p := newPull(len(want))
	require.NoError(t, pushLane(ctx, cs, stateOf(cs).link, &rtr{Req: p.req, Length: uint64(len(want))}, Source{Bytes: want}, &sourceUse{}))
	require.NoError(t, bulkResult(t, p))
	got, err := p.dst.HostBytes()
	require.NoError(t, err)
	require.Equal(t, want, got)

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		src  string
		err  string
	}{
		{"short source", ctx, "abc", "the source holds 3 bytes, the transfer 5"},
		{"long source", ctx, "abcdefg", "the source holds 7 bytes, the transfer 5"},
		{"context ended", canceled, "abcde", context.Canceled.Error()},
	} {
		p := newPull(5)
		err := pushLane(tc.ctx, cs, stateOf(cs).link, &rtr{Req: p.req, Length: 5}, Source{Bytes: []byte(tc.src)}, &sourceUse{})
		require.ErrorContains(t, err, tc.err, tc.name)
		require.ErrorContains(t, bulkResult(t, p), "gave the transfer up", tc.name)
	}
	requireLive(t, ss)
}

// bulkLanePair returns the two sessions of a TCP session with lanes, once
// the server has its bulk lane, and a function making pulls on the server.
func bulkLanePair(t *testing.T) (ss, cs *transport.Session, newPull func(n int) *pull) {
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	_, cs, ss, _, _ = lanePair(t, opts, opts)
	require.NotNil(t, stateOf(cs).link.Lane(), "the client has a bulk lane")
	return ss, cs, func(n int) *pull {
		dst, err := devicebuf.NewHostAllocator().Alloc(n)
		require.NoError(t, err)
		p := makePull(ss, dst)
		p.list()
		t.Cleanup(p.settled)
		return p
	}
}

// bulkResult waits for the outcome of p's bulk transfer.
func bulkResult(t *testing.T, p *pull) error {
	t.Helper()
	select {
	case err := <-p.bulk:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("no outcome for the pull")
	}
	return nil
}

// A buffer a lane write broke off from part-way (a UCX send cut short by
// its deadline may still read it) is given back only once the session's
// connections are released; any other is given back at once.
func TestAfterLaneWaitsForRelease(t *testing.T) {
	_, ss := pipePair(t)
	var now, later atomic.Bool
	afterLane(ss, nil, func() { now.Store(true) })
	require.True(t, now.Load(), "nothing in flight: given back at once")
	afterLane(ss, fmt.Errorf("push: %w", errLaneBroken), func() { later.Store(true) })
	require.False(t, later.Load(), "given back while the broken lane's send may read it")
	require.NoError(t, ss.Close())
	<-ss.Released()
	require.Eventually(t, later.Load, 10*time.Second, time.Millisecond, "given back once the session is released")
}
