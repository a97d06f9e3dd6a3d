package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/listener"
)

// serveInProcess serves the gdrpc service on 127.0.0.1:PORT and the plain
// gRPC one on PORT+1 in this process, as gdrperf -server does, the latter
// implemented by plain, and returns the address to give -connect.
func serveInProcess(t *testing.T, o *options, plain func(*payloads) baselineServer) string {
	t.Helper()
	alloc, cuda, err := o.allocators()
	require.NoError(t, err)
	unregister, err := registerCodec(o, cuda)
	require.NoError(t, err)
	t.Cleanup(unregister)
	p := newPayloads(alloc, cuda)
	t.Cleanup(p.Close)
	var lis, bl net.Listener
	for attempt := 0; ; attempt++ {
		port, err := freePort("127.0.0.1")
		require.NoError(t, err)
		if bl, err = net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1)); err == nil {
			if lis, err = listener.Listen(fmt.Sprintf("127.0.0.1:%d", port), o.listenerOptions()...); err == nil {
				break
			}
			bl.Close()
		}
		require.Less(t, attempt, 20, "no two free ports in a row: %v", err)
	}
	gs := grpc.NewServer(append(listener.ServerOptions(insecure.NewCredentials()), grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg))...)
	tensorpb.RegisterTensorServiceServer(gs, &perfServer{p: p})
	bs := grpc.NewServer(grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg))
	bs.RegisterService(&baselineDesc, plain(p))
	var wg sync.WaitGroup
	wg.Go(func() { _ = gs.Serve(lis) })
	wg.Go(func() { _ = bs.Serve(bl) })
	t.Cleanup(func() {
		gs.Stop()
		bs.Stop()
		wg.Wait()
	})
	return lis.Addr().String()
}

// corruptBaseline is the plain gRPC service with a byte of each payload it
// sends changed, and a checksum off by one for each it verifies.
type corruptBaseline struct{ baseline }

func (c corruptBaseline) Make(ctx context.Context, r *wrapperspb.UInt64Value) (*wrapperspb.BytesValue, error) {
	out, err := c.baseline.Make(ctx, r)
	if err != nil {
		return nil, err
	}
	p := bytes.Clone(out.GetValue())
	p[len(p)/2]++
	return wrapperspb.Bytes(p), nil
}

func (c corruptBaseline) Push(ctx context.Context, r *wrapperspb.BytesValue) (*wrapperspb.UInt64Value, error) {
	out, err := c.baseline.Push(ctx, r)
	if err != nil || !verify(ctx) {
		return out, err
	}
	return wrapperspb.UInt64(out.GetValue() + 1), nil
}

// downBaseline is a plain gRPC service whose calls all fail.
type downBaseline struct{ baseline }

func (downBaseline) Make(context.Context, *wrapperspb.UInt64Value) (*wrapperspb.BytesValue, error) {
	return nil, status.Error(codes.Unavailable, "the baseline is down")
}

func (downBaseline) Push(context.Context, *wrapperspb.BytesValue) (*wrapperspb.UInt64Value, error) {
	return nil, status.Error(codes.Unavailable, "the baseline is down")
}

// A baseline's payload that differs from the one sent fails the run, with
// the message; a baseline call that fails is only a note.
func TestBaselineMismatchFails(t *testing.T) {
	for _, tc := range []struct {
		name  string
		op    string
		plain func(*payloads) baselineServer
		code  int
		msg   string // on stderr (code 1) or in a note (code 0)
	}{
		{name: "pull differs", op: "pull", plain: func(p *payloads) baselineServer { return corruptBaseline{baseline{p}} }, code: 1,
			msg: "256KiB (1 in flight): grpc-tcp: call 0: received payload of 262144 bytes differs from the 262144 bytes sent"},
		{name: "push differs", op: "push", plain: func(p *payloads) baselineServer { return corruptBaseline{baseline{p}} }, code: 1,
			msg: "256KiB (1 in flight): grpc-tcp: call 0: the server's CRC-32C is"},
		{name: "pull down", op: "pull", plain: func(p *payloads) baselineServer { return downBaseline{baseline{p}} }, code: 0,
			msg: "# note: 256KiB: grpc-tcp: call 0: rpc error: code = Unavailable desc = the baseline is down"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"-sizes", "256KiB", "-iters", "2", "-warmup", "1", "-transport", "tcp", "-perftest", "none", "-op", tc.op}
			o, err := parseFlags(args, io.Discard)
			require.NoError(t, err)
			addr := serveInProcess(t, o, tc.plain)
			var out, errb bytes.Buffer
			code := realMain(append(args, "-connect", addr), strings.NewReader(""), &out, &errb)
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
			require.Regexp(t, `(?m)^\s*256KiB\s+stream\s+[0-9.,]+\s`, out.String(), "gdrpc measured")
			if tc.code == 0 {
				require.Contains(t, out.String(), tc.msg)
				require.Empty(t, errb.String())
				return
			}
			require.Contains(t, errb.String(), "gdrperf: "+tc.msg)
		})
	}
}

// An interrupted table run prints the rows it measured before the signal.
func TestTableInterrupted(t *testing.T) {
	// The header comes with the first row measured: the signal then.
	s := runInterrupted(t, []string{"-sizes", "4KiB,256KiB", "-iters", "2", "-warmup", "0", "-transport", "tcp", "-perftest", "none"}, "# gdrperf op=")
	require.Regexp(t, `(?m)^\s*size\s+path\s+gdrpc MiB/s`, s)
	require.Regexp(t, `(?m)^\s*4KiB\s+inline\s+[0-9.,]+\s`, s, "the row measured before the signal")
	require.NotRegexp(t, `(?m)^\s*256KiB\s`, s)
}

// A row whose gdrpc figures are missing has them null in JSON, as the other
// missing figures, where the table prints "-".
func TestFailedRowJSON(t *testing.T) {
	port, err := freePort("127.0.0.1") // nothing listens there
	require.NoError(t, err)
	var out, errb bytes.Buffer
	code := realMain([]string{"-format", "json", "-connect", fmt.Sprintf("127.0.0.1:%d", port), "-sizes", "1MiB", "-iters", "1", "-warmup", "0",
		"-transport", "tcp", "-perftest", "none", "-call-timeout", "5s"}, strings.NewReader(""), &out, &errb)
	require.Equal(t, 1, code, "stdout:\n%s", out.String())
	var row map[string]any
	require.NoError(t, json.Unmarshal(bytes.TrimSpace(out.Bytes()), &row))
	for _, k := range []string{"gdrpc_mib_s", "transfer_mib_s", "call_us", "xfer_vs_ucx_perftest"} {
		require.Contains(t, row, k)
		require.Nil(t, row[k], k)
	}
}

// The verified call comes before the warm-up and the measured calls, out
// of the time measured, whatever -warmup is; -warmup counts the unverified
// calls after it, on each goroutine. The ready hook (waiting for the receive
// space the verified call set going) runs before the warm-up, whose calls
// then take the measured calls' path.
func TestVerifiedCallFirst(t *testing.T) {
	for _, tc := range []struct {
		name             string
		warmup, inflight int
	}{
		{name: "no warm-up", warmup: 0, inflight: 1},
		{name: "warm-up", warmup: 2, inflight: 1},
		{name: "no warm-up, in flight", warmup: 0, inflight: 3},
		{name: "warm-up, in flight", warmup: 2, inflight: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const iters = 4
			b := &bench{o: &options{warmup: tc.warmup, iters: iters, inflight: tc.inflight, check: "every", callLimit: time.Minute}}
			var mu sync.Mutex
			var seq []string
			add := func(s string) {
				mu.Lock()
				seq = append(seq, s)
				mu.Unlock()
			}
			call := func(_ context.Context, _ int, first bool) (*followUp, error) {
				if first {
					add("verified")
				} else {
					add("call")
				}
				return nil, nil
			}
			_, err := b.timeCalls(t.Context(), 1<<10, call, func() { add("ready") }, func() { add("measuring") })
			require.NoError(t, err)
			want := []string{"verified", "ready"}
			for range tc.warmup * tc.inflight {
				want = append(want, "call")
			}
			want = append(want, "measuring")
			for range iters * tc.inflight {
				want = append(want, "call")
			}
			require.Equal(t, want, seq)
		})
	}
}
