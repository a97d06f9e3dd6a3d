package transporttest

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/gdrpc/gdrpc/transport"
)

// Timeout bounds the handshakes these helpers run.
const Timeout = 10 * time.Second

// Pair returns a connected client and server session over an in-memory pipe
// (net.Pipe), both with opts. Both announce the same process id (this
// process's, unless opts say otherwise), so SessionsTo(transport.LocalID())
// finds both. The sessions are closed when the test ends.
func Pair(tb testing.TB, opts ...transport.Option) (client, server *transport.Session) {
	tb.Helper()
	return PairWith(tb, opts, opts)
}

// PairWith is Pair with separate options per side; give each side its own
// transport.WithIdentity(transport.NewIdentity()) to emulate two processes.
func PairWith(tb testing.TB, clientOpts, serverOpts []transport.Option) (client, server *transport.Session) {
	tb.Helper()
	c1, c2 := net.Pipe()
	return PairOver(tb, c1, c2, clientOpts, serverOpts)
}

// TCPPair is Pair over a TCP loopback connection.
func TCPPair(tb testing.TB, opts ...transport.Option) (client, server *transport.Session) {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("transporttest: listen: %v", err)
	}
	defer l.Close()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := l.Accept()
		ch <- res{c, err}
	}()
	c1, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		tb.Fatalf("transporttest: dial: %v", err)
	}
	r := <-ch
	if r.err != nil {
		_ = c1.Close()
		tb.Fatalf("transporttest: accept: %v", r.err)
	}
	return PairOver(tb, c1, r.c, opts, opts)
}

// PairOver runs the handshake over two ends of a connection and returns the
// sessions; they own the conns and are closed when the test ends.
func PairOver(tb testing.TB, c1, c2 net.Conn, clientOpts, serverOpts []transport.Option) (client, server *transport.Session) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	type res struct {
		s   *transport.Session
		err error
	}
	ch := make(chan res, 1)
	go func() {
		s, err := transport.NewServerSession(ctx, c2, serverOpts...)
		ch <- res{s, err}
	}()
	client, err := transport.NewClientSession(ctx, c1, clientOpts...)
	r := <-ch
	if err != nil || r.err != nil {
		if client != nil {
			_ = client.Close()
		}
		if r.s != nil {
			_ = r.s.Close()
		}
		tb.Fatalf("transporttest: handshake: client: %v, server: %v", err, r.err)
	}
	server = r.s
	tb.Cleanup(func() {
		_ = client.Close()
		_ = server.Close()
	})
	return client, server
}

// Conns returns the gRPC stream conns of a session pair: the client opens
// its end, the server accepts it.
func Conns(tb testing.TB, client, server *transport.Session) (clientConn, serverConn net.Conn) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	cc, err := client.Conn(ctx)
	if err != nil {
		tb.Fatalf("transporttest: client conn: %v", err)
	}
	sc, err := server.Conn(ctx)
	if err != nil {
		tb.Fatalf("transporttest: server conn: %v", err)
	}
	return cc, sc
}

// MakePipe returns a nettest.MakePipe-shaped function over Pair's gRPC stream
// conns.
func MakePipe(opts ...transport.Option) func() (c1, c2 net.Conn, stop func(), err error) {
	return func() (net.Conn, net.Conn, func(), error) {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		defer cancel()
		p1, p2 := net.Pipe()
		type res struct {
			s   *transport.Session
			err error
		}
		ch := make(chan res, 1)
		go func() {
			s, err := transport.NewServerSession(ctx, p2, opts...)
			ch <- res{s, err}
		}()
		cs, err := transport.NewClientSession(ctx, p1, opts...)
		r := <-ch
		if err != nil || r.err != nil {
			if cs != nil {
				_ = cs.Close()
			}
			if r.s != nil {
				_ = r.s.Close()
			}
			if err == nil {
				err = r.err
			}
			return nil, nil, nil, err
		}
		stop := func() {
			_ = cs.Close()
			_ = r.s.Close()
		}
		c1, err := cs.Conn(ctx)
		if err != nil {
			stop()
			return nil, nil, nil, err
		}
		c2, err := r.s.Conn(ctx)
		if err != nil {
			stop()
			return nil, nil, nil, err
		}
		return c1, c2, stop, nil
	}
}

// NoSessions fails the test if the registry still holds sessions.
func NoSessions(tb testing.TB) {
	tb.Helper()
	if n := transport.ReadStats().Sessions; n != 0 {
		tb.Errorf("transporttest: %d sessions still registered", n)
	}
}
