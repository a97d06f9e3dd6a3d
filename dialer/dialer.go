package dialer

import (
	"context"
	"fmt"
	"net"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/gdrcodec"
	"github.com/gdrpc/gdrpc/internal/face"
	"github.com/gdrpc/gdrpc/transport"
)

// Dialer makes gdrpc sessions for gRPC.
type Dialer struct {
	opts []transport.Option

	mu       sync.Mutex
	sessions map[*transport.Session]struct{} // those it made, until Close; released ones are pruned at each dial
	closed   bool
}

// New returns a Dialer whose sessions and transfers follow opts (package
// gdrpc's options: trust, transport, logging, metrics, limits and the rest).
func New(opts ...gdrpc.Option) *Dialer {
	return &Dialer{opts: face.SessionOptions(opts)}
}

// DialContext dials a gdrpc session to addr (host:port) and returns the conn
// gRPC runs on. Closing the conn closes the session. It has the signature of
// grpc.WithContextDialer. It fails once Close was called.
func (d *Dialer) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	if d.isClosed() {
		return nil, errClosed
	}
	c, err := transport.DialConn(ctx, addr, d.opts...)
	if err != nil {
		return nil, err
	}
	s := transport.SessionOf(c)
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		_ = c.Close()
		_ = s.Close()
		return nil, errClosed
	}
	for o := range d.sessions {
		select {
		case <-o.Released():
			delete(d.sessions, o)
		default:
		}
	}
	if d.sessions == nil {
		d.sessions = map[*transport.Session]struct{}{}
	}
	d.sessions[s] = struct{}{}
	d.mu.Unlock()
	return c, nil
}

// errClosed is what a Dialer's dials return once it was closed.
var errClosed = fmt.Errorf("gdrpc: dialer closed: %w", net.ErrClosed)

func (d *Dialer) isClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed
}

// Close closes the sessions this Dialer made that are still up, and the
// connections of ClientConns on them, and returns once they are closed and
// released; later dials fail. gRPC's ClientConn.Close does not wait for its
// connection to close: a client process that exits right after it cuts its
// sessions short (a UCX session's server then sees its peer lost rather than
// closed). Closing the ClientConns, then the Dialer, ends them cleanly. A
// session whose peer does not answer takes up to 2 s to close; the sessions
// close at once.
func (d *Dialer) Close() error {
	d.mu.Lock()
	d.closed = true
	sessions := d.sessions
	d.sessions = nil
	d.mu.Unlock()
	var wg sync.WaitGroup
	for s := range sessions {
		wg.Go(func() { _ = s.Close() })
	}
	wg.Wait()
	return nil
}

// DialOptions returns the options a gRPC client needs to run over gdrpc: the
// dialer; transport credentials (creds wrapped so that handlers find the
// session; nil creds means no security); buffer sizes and HTTP/2 windows
// suited to a message transport; and the out-of-band codec
// (gdrcodec.DialOptions: the gdr codec for every call of the ClientConn and
// the interceptors that keep request payloads available until the call ends;
// it registers nothing with gRPC). codecOpts (gdrcodec.WithReceiveAllocator,
// WithMaxReceivePayload, ...) apply to the calls of this ClientConn alone, in
// place of all of gdrcodec.Register's (what they leave out takes its
// default); without them the codec follows gdrcodec.Register's. The AuthInfo of a
// call's peer (grpc.Peer) is creds' own, and gdrpc.SessionFromPeer finds the
// session.
func (d *Dialer) DialOptions(creds credentials.TransportCredentials, codecOpts ...gdrcodec.Option) []grpc.DialOption {
	return append([]grpc.DialOption{
		grpc.WithContextDialer(d.DialContext),
		grpc.WithTransportCredentials(transport.NewCredentials(creds)),
		grpc.WithWriteBufferSize(transport.GRPCBufferSize),
		grpc.WithReadBufferSize(transport.GRPCReadBufferSize),
		grpc.WithInitialWindowSize(transport.DefaultWindow),
		grpc.WithInitialConnWindowSize(transport.DefaultWindow),
	}, gdrcodec.DialOptions(codecOpts...)...)
}
