package transport

import (
	"context"
	"net"
	"testing"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
)

// BenchmarkHandshake measures a whole session setup over an in-memory pipe:
// both sides of the handshake, the multiplexer and the control stream, then
// the close of both sessions.
func BenchmarkHandshake(b *testing.B) {
	ctx := context.Background()
	opts := []Option{WithKeepAlive(-1, 0)}
	b.ReportAllocs()
	for b.Loop() {
		c1, c2 := net.Pipe()
		srv := make(chan *Session, 1)
		go func() {
			s, err := NewServerSession(ctx, c2, opts...)
			if err != nil {
				b.Error(err)
			}
			srv <- s
		}()
		c, err := NewClientSession(ctx, c1, opts...)
		s := <-srv
		if err != nil || s == nil {
			b.Fatalf("handshake: %v", err)
		}
		_ = c.Close()
		_ = s.Close()
	}
}

// BenchmarkSessionSetup measures what a gRPC client's dial costs, both ends
// in one process over loopback: the handshake, the move to UCX where the
// mode asks for it, the session's lanes, up to the conn gRPC runs on and the
// server's end of it; then both sessions close.
func BenchmarkSessionSetup(b *testing.B) {
	for _, mode := range []Mode{ModeTCP, ModeUCX} {
		b.Run("transport="+string(mode), func(b *testing.B) {
			if mode == ModeUCX {
				testenv.Need(b, "ucx", rdma.Available())
			}
			opts := []Option{WithEngine(testEngine{}), WithMode(mode), WithTrustPeers(true), WithKeepAlive(-1, 0)}
			l, err := Listen("127.0.0.1:0", opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				c, err := DialConn(ctx, l.Addr().String(), opts...)
				if err != nil {
					b.Fatal(err)
				}
				sc, err := l.Accept()
				if err != nil {
					b.Fatal(err)
				}
				_ = c.Close()
				_ = sc.Close()
			}
		})
	}
}
