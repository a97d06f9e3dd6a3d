package gdrcodec_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
	"github.com/gdrpc/gdrpc/transport"
)

// TestProtoCodecCallsBindNothing: calls over a gdrpc session that use the
// proto codec (a client made with the dialer alone, or one that forces its
// codec) get their payloads inline and leave no response bound to a
// destination. Only the gdr codec's marshal takes a binding: one made for
// another codec's call kept the call's context, its whole server stream,
// until the binding's lease ended.
func TestProtoCodecCallsBindNothing(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	ctx := context.Background()
	protoCodec := grpc.ForceCodecV2(grpcProto)
	before := gdrcodec.DestinationsForTest()
	payload := pattern(4096, 7)
	for i := range 8 {
		got, err := r.client.Echo(ctx, &tensorpb.Tensor{Name: "p", Data: &gdrv1.DeviceBuffer{Length: uint64(len(payload)), Inline: payload}}, protoCodec)
		require.NoError(t, err, "call %d", i)
		require.Equal(t, payload, got.GetData().GetInline(), "call %d", i)
		require.Equal(t, before, gdrcodec.DestinationsForTest(), "call %d left a binding", i)
	}
	st, err := r.client.Download(ctx, &tensorpb.Sized{Size: 4096, Seed: 3}, protoCodec)
	require.NoError(t, err)
	for i := range uint32(4) {
		got, err := st.Recv()
		require.NoError(t, err, "message %d", i)
		want := make([]byte, 4096)
		tensor.Fill(want, 3+i)
		require.Equal(t, want, got.GetData().GetInline(), "message %d", i)
	}
	_, err = st.Recv()
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, before, gdrcodec.DestinationsForTest(), "the stream's messages left bindings")

	// The gdr codec's calls, alongside, take theirs.
	got, err := r.client.Make(ctx, &tensorpb.Sized{Size: 4096, Seed: 5})
	require.NoError(t, err)
	buf, ok := gdrcodec.Buffer(got.GetData())
	require.True(t, ok)
	arrived, err := buf.HostBytes()
	require.NoError(t, err)
	want := make([]byte, 4096)
	tensor.Fill(want, 5)
	require.Equal(t, want, arrived)
	gdrcodec.ReleaseAll(got)
	// At most as many as before: its binding's put may also sweep out an
	// earlier test's expired ones.
	require.LessOrEqual(t, gdrcodec.DestinationsForTest(), before)
}

// A call with several content-type headers is decoded with the codec of the
// last, as gRPC picks it: a gdr header followed by a plain one makes a call
// of the proto codec, which binds nothing, so a peer sending such calls
// leaves no binding (and no call context) behind until a lease ends. The
// other order makes a gdr call, whose marshal takes its binding.
func TestContentTypeHeadersBindNothing(t *testing.T) {
	r := newRig(t, transport.ModeTCP, nil)
	addr := strings.TrimPrefix(r.cc.Target(), "passthrough:///")
	d := dialer.New(gdrpc.WithTransport(transport.ModeTCP), processEngine)
	t.Cleanup(func() { d.Close() })
	for _, cts := range [][]string{
		{"application/grpc+gdr", "application/grpc"},
		{"application/grpc", "application/grpc+gdr"},
		{"application/grpc+gdr", "application/grpc+proto"},
	} {
		t.Run(strings.Join(cts, ","), func(t *testing.T) {
			before := gdrcodec.DestinationsForTest()
			for i := range 4 {
				conn, err := d.DialContext(context.Background(), addr)
				require.NoError(t, err)
				code := rawUnary(t, conn, "/gdrpc.examples.tensor.TensorService/Make", &tensorpb.Sized{Size: 4096, Seed: uint32(i)}, cts)
				require.NoError(t, conn.Close())
				require.Equal(t, codes.OK, code, "call %d", i)
				require.LessOrEqual(t, gdrcodec.DestinationsForTest(), before, "call %d left a binding", i)
			}
		})
	}
}

// rawUnary makes one unary call over conn, a gdrpc session's gRPC conn, in
// HTTP/2 frames of its own, with the content-type headers given, and returns
// the call's status code once its trailers came.
func rawUnary(t *testing.T, conn net.Conn, method string, req proto.Message, contentTypes []string) codes.Code {
	t.Helper()
	require.NoError(t, conn.SetDeadline(time.Now().Add(time.Minute)))
	_, err := conn.Write([]byte(http2.ClientPreface))
	require.NoError(t, err)
	fr := http2.NewFramer(conn, conn)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	require.NoError(t, fr.WriteSettings())
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	fields := [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", method}, {":authority", "x"}, {"te", "trailers"}}
	for _, ct := range contentTypes {
		fields = append(fields, [2]string{"content-type", ct})
	}
	for _, f := range fields {
		require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
	}
	require.NoError(t, fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true}))
	body, err := proto.Marshal(req)
	require.NoError(t, err)
	msg := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(body)))
	require.NoError(t, fr.WriteData(1, true, append(msg, body...)))
	for {
		f, err := fr.ReadFrame()
		require.NoError(t, err)
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				require.NoError(t, fr.WriteSettingsAck())
			}
		case *http2.MetaHeadersFrame:
			if !f.StreamEnded() {
				continue
			}
			if st := f.PseudoValue("status"); st != "" {
				require.Equal(t, "200", st) // a trailers-only response
			}
			for _, hf := range f.RegularFields() {
				if hf.Name == "grpc-status" {
					var c uint32
					_, err := fmt.Sscan(hf.Value, &c)
					require.NoError(t, err)
					return codes.Code(c)
				}
			}
			t.Fatal("trailers without grpc-status")
		case *http2.RSTStreamFrame, *http2.GoAwayFrame:
			t.Fatalf("call failed: %v", f)
		}
	}
}
