package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/transport"
)

// firstCallSize is the payload of the call a new connection makes first
// (-connects): a small call, whose time is mostly the connection's setup.
const firstCallSize = 1 << 10

// connectsResult is what -connects measured: the time from a new ClientConn
// to its first call's response, over a gdrpc connection (the session's
// handshake, its move to UCX and its lanes included) and over plain gRPC on
// TCP, the two alternating.
type connectsResult struct {
	Connects   int      `json:"connects"`
	Transport  string   `json:"transport"` // of the gdrpc sessions, as the last one ran
	GDRPCMs    float64  `json:"gdrpc_first_call_ms"`
	GDRPCP90Ms float64  `json:"gdrpc_first_call_p90_ms"`
	GRPCMs     float64  `json:"grpc_tcp_first_call_ms"`
	GRPCP90Ms  float64  `json:"grpc_tcp_first_call_p90_ms"`
	XGRPC      *float64 `json:"x_grpc,omitempty"` // gdrpc's median over plain gRPC's
}

// measureConnects makes b.o.connects new connections each way, one at a
// time, alternating which way goes first, each closed once its first call
// returned.
func (b *bench) measureConnects(ctx context.Context) (*connectsResult, error) {
	pat := pattern(firstCallSize)
	d := dialer.New(b.o.faceOptions()...)
	gdrpcOpts := append(d.DialOptions(insecure.NewCredentials()), limits)
	plainOpts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), limits}
	var gdr, plain []time.Duration
	res := &connectsResult{Connects: b.o.connects}
	viaGDRPC := func() error {
		took, err := firstCall(ctx, b.info.GDRPC, gdrpcOpts, func(cctx context.Context, cc *grpc.ClientConn) error {
			var p peer.Peer
			t, err := tensorpb.NewTensorServiceClient(cc).Make(cctx, &tensorpb.Sized{Size: firstCallSize, Seed: 0}, grpc.Peer(&p)) // variant 0: pattern(size)
			if err == nil {
				err = checkTensor(t, pat)
			}
			gdrcodec.ReleaseAll(t)
			res.Transport = "not gdrpc"
			if s := transport.SessionFromPeer(&p); s != nil {
				res.Transport = s.Transport()
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("gdrpc connection: %w", err)
		}
		gdr = append(gdr, took)
		return nil
	}
	viaPlain := func() error {
		took, err := firstCall(ctx, b.info.GRPC, plainOpts, func(cctx context.Context, cc *grpc.ClientConn) error {
			out := new(wrapperspb.BytesValue)
			err := cc.Invoke(cctx, methodMake, wrapperspb.UInt64(firstCallSize), out)
			if err == nil && len(out.GetValue()) != firstCallSize {
				err = mismatch("%d bytes arrived, want %d", len(out.GetValue()), firstCallSize)
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("plain gRPC connection: %w", err)
		}
		plain = append(plain, took)
		return nil
	}
	for i := range b.o.connects {
		ways := []func() error{viaGDRPC, viaPlain}
		if i%2 == 1 {
			ways[0], ways[1] = ways[1], ways[0]
		}
		for _, way := range ways {
			if err := way(); err != nil {
				return nil, err
			}
		}
	}
	// The median as the table's (median), the p90 the nearest rank.
	ms := func(ds []time.Duration) (med, p90 float64) {
		xs := make([]float64, len(ds))
		for i, d := range ds {
			xs[i] = float64(d) / 1e6
		}
		slices.Sort(xs)
		return median(xs), xs[int(0.9*float64(len(xs)-1)+0.5)]
	}
	res.GDRPCMs, res.GDRPCP90Ms = ms(gdr)
	res.GRPCMs, res.GRPCP90Ms = ms(plain)
	res.XGRPC = ratio(&res.GDRPCMs, &res.GRPCMs)
	return res, nil
}

// firstCall times a new ClientConn to addr, made with opts, up to the end of
// its first call (call), and closes it.
func firstCall(ctx context.Context, addr string, opts []grpc.DialOption, call func(context.Context, *grpc.ClientConn) error) (time.Duration, error) {
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	start := time.Now()
	cc, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		return 0, err
	}
	defer cc.Close()
	if err := call(cctx, cc); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// writeConnects reports r: a line under the table, or a JSON object.
func writeConnects(w io.Writer, format string, r *connectsResult) error {
	if format == "json" {
		return json.NewEncoder(w).Encode(r)
	}
	_, err := fmt.Fprintf(w, "# first call on a new connection (-connects %d, alternating; 1 KiB Make): gdrpc %.2f ms median, p90 %.2f (session over %s), plain gRPC over TCP %.2f ms, p90 %.2f: %s plain gRPC's time\n",
		r.Connects, r.GDRPCMs, r.GDRPCP90Ms, r.Transport, r.GRPCMs, r.GRPCP90Ms, rat(r.XGRPC))
	return err
}
