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

// Dialer makes gdrpc sessions for gRPC. The zero Dialer is New() with no
// options.
type Dialer struct {
	opts []transport.Option // nil: New()'s, made at the first dial

	mu sync.Mutex
	// sessions are those it made, with their conns, until Close or their
	// release, which closes them (pruned, which Close waits for: a released
	// session's handlers may still run).
	sessions map[*transport.Session]net.Conn
	pruned   sync.WaitGroup
	closed   bool
	dialing  sync.WaitGroup // dials under way, which Close cancels and waits for
	// stop, made at the first dial (d.mu held) and cancelled by Close, is
	// what the dials under way are cancelled by.
	stop      context.Context
	stopDials context.CancelFunc
	closeOnce sync.Once
	// ended is closed once the sessions are; cut, by a Shutdown whose
	// context ended, to close them without waiting for their linger.
	// Made by ends.
	ended, cut chan struct{}
	cutOnce    sync.Once
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
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, errClosed
	}
	if d.opts == nil {
		d.opts = face.SessionOptions(nil)
	}
	opts := d.opts
	d.dialing.Add(1) // before Close's Wait: Close sets closed first
	if d.stop == nil {
		d.stop, d.stopDials = context.WithCancel(context.Background())
	}
	stop := d.stop
	d.mu.Unlock()
	defer d.dialing.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(stop, cancel)()
	c, err := transport.DialConn(ctx, addr, opts...)
	if err != nil {
		if stop.Err() != nil {
			return nil, fmt.Errorf("%w (the dial under way: %w)", errClosed, err)
		}
		return nil, err
	}
	s := transport.SessionOf(c)
	d.mu.Lock()
	if d.closed {
		_, cut := d.endsLocked()
		d.mu.Unlock()
		transport.CloseGracefully(c, cut)
		return nil, errClosed
	}
	if d.sessions == nil {
		d.sessions = map[*transport.Session]net.Conn{}
	}
	d.sessions[s] = c
	d.mu.Unlock()
	s.AfterRelease(func() { d.forget(s) })
	return c, nil
}

// forget drops s, a session of d that was released, and closes it. Once
// Close took the sessions it has nothing to do: Close closes them.
func (d *Dialer) forget(s *transport.Session) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.sessions[s]; !ok {
		return
	}
	delete(d.sessions, s)
	d.pruned.Go(func() { _ = s.Close() }) // before Close's Wait: Close takes d.mu first
}

// errClosed is what a Dialer's dials return once it was closed.
var errClosed = fmt.Errorf("gdrpc: dialer closed: %w", net.ErrClosed)

// Close closes the connections of the Dialer's sessions that gRPC has not
// closed yet, and returns once every session it made is closed and its
// goroutines ended; later dials fail, and a dial under way is cancelled
// and closes what it made before Close returns. gRPC's
// ClientConn.Close does not wait for its connection to close: a client
// process that exits right after it cuts its sessions short (a UCX session's
// server then sees its peer lost rather than closed). Closing the
// ClientConns, then the Dialer, ends them cleanly: a session closes as its
// connection's close closes it, once its out-of-band transfers are over
// (LingerIdle, 500 ms, after the last one, at most the transfer timeout)
// and the peer read what was sent (at most 2 s more). The sessions close
// concurrently; a Close called meanwhile returns with the first.
func (d *Dialer) Close() error { return d.Shutdown(context.Background()) }

// Shutdown is Close bounded by ctx: once ctx is done, the sessions still
// closing are closed at once, out-of-band transfers under way on them fail,
// and Shutdown returns ctx's error once they are closed (a UCX session whose
// peer does not answer takes up to 4 s: 2 s for its lanes, closed together,
// and 2 s for its first endpoint; a gRPC lane already closing gracefully
// when ctx ended takes up to 2 s before that; a TCP session whose orderly
// close the peer answered waits up to 1 s for the peer's end of its
// connections, so that bytes still on their way are not answered with a
// reset). A Close or Shutdown called meanwhile returns with the first, or
// at its own context's end, which cuts the sessions short for both. Dials
// under way are cancelled (they fail with an error wrapping net.ErrClosed)
// and waited for.
func (d *Dialer) Shutdown(ctx context.Context) error {
	d.mu.Lock()
	d.closed = true
	if d.stopDials != nil {
		d.stopDials()
	}
	ended, cut := d.endsLocked()
	d.mu.Unlock()
	d.closeOnce.Do(func() { go d.closeAll(ended, cut) })
	select {
	case <-ended:
		return nil // closed already: nothing to cut, whatever ctx says
	default:
	}
	select {
	case <-ended:
		return nil
	case <-ctx.Done():
	}
	d.cutOnce.Do(func() { close(cut) })
	<-ended
	return ctx.Err()
}

// endsLocked returns d.ended and d.cut, made at the first call (d.mu held).
func (d *Dialer) endsLocked() (ended, cut chan struct{}) {
	if d.ended == nil {
		d.ended, d.cut = make(chan struct{}), make(chan struct{})
	}
	return d.ended, d.cut
}

// closeAll waits for the dials under way, closes the sessions concurrently,
// and closes ended once all are closed.
func (d *Dialer) closeAll(ended, cut chan struct{}) {
	defer close(ended)
	d.dialing.Wait()
	d.mu.Lock()
	sessions := d.sessions
	d.sessions = nil
	d.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range sessions {
		wg.Go(func() { transport.CloseGracefully(c, cut) })
	}
	wg.Wait()
	d.pruned.Wait()
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
