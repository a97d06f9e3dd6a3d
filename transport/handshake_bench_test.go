package transport

import (
	"context"
	"net"
	"testing"
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
