package dialer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
)

// Pool is a grpc.ClientConnInterface over several ClientConns to one target,
// each on a session of its own. A ClientConn to one address carries all its
// calls over one HTTP/2 transport, with one writer and one reader on each
// side, so calls that move large payloads out of band queue behind each
// other's messages there; a pool spreads them. Each call or stream goes over
// the connection with the fewest calls and streams in flight, ties taken in
// turn, passing over connections that are closed or failing to connect
// (TRANSIENT_FAILURE) while another is not. Generated clients take a Pool
// where they take a *grpc.ClientConn:
//
//	d := dialer.New(gdrpc.WithTrustPeers())
//	pool, err := dialer.NewPool("passthrough:///host:50051", 4, d.DialOptions(nil)...)
//	...
//	client := tensorpb.NewTensorServiceClient(pool)
//
// Each session has its own receive spaces (gdrpc.WithReceiveSpaceLimit), so
// a pool of n connections may set aside up to n times a session's space.
//
// Only NewPool makes a Pool that carries calls: the zero Pool fails them.
type Pool struct {
	conns []*grpc.ClientConn
	busy  []atomic.Int64 // calls and streams in flight on conns[i]
	next  atomic.Uint64  // turns among connections equally busy
	close struct {
		once sync.Once
		err  error
	}
}

// NewPool makes n ClientConns to target with opts, each as grpc.NewClient
// makes one: opts are typically a Dialer's DialOptions and the caller's own.
// Like grpc.NewClient, it connects nothing yet: each connection dials its
// session when a call first goes over it (or on Conns()[i].Connect()).
func NewPool(target string, n int, opts ...grpc.DialOption) (*Pool, error) {
	if n < 1 {
		return nil, fmt.Errorf("dialer: a pool of %d connections: want at least 1", n)
	}
	p := &Pool{busy: make([]atomic.Int64, n)}
	for range n {
		cc, err := grpc.NewClient(target, opts...)
		if err != nil {
			_ = p.Close()
			return nil, err
		}
		p.conns = append(p.conns, cc)
	}
	return p, nil
}

// Conns returns the pool's connections (a copy of its list), to watch their
// state or connect them ahead of the first calls. The pool passes over one
// closed here.
func (p *Pool) Conns() []*grpc.ClientConn { return slices.Clone(p.conns) }

// Close closes every connection of the pool; it is idempotent. A connection
// closed already (through Conns) is not an error.
func (p *Pool) Close() error {
	p.close.once.Do(func() {
		var errs []error
		for _, cc := range p.conns {
			if err := cc.Close(); status.Code(err) != codes.Canceled {
				errs = append(errs, err) // Canceled: it was closing already
			}
		}
		p.close.err = errors.Join(errs...)
	})
	return p.close.err
}

// errNoConns fails the calls of a Pool not made by NewPool.
var errNoConns = status.Error(codes.FailedPrecondition, "dialer: a Pool not made by NewPool has no connections")

// pick returns the connection with the fewest calls in flight among those
// that can carry a call now, counted as taken; connections equally busy
// take calls in turn. A closed connection fails its calls at once, and one
// in TRANSIENT_FAILURE fails those that do not wait for ready, so both look
// idle: they take calls only when every connection is in such a state.
func (p *Pool) pick() (int, error) {
	if len(p.conns) == 0 {
		return 0, errNoConns
	}
	var buf [16]int
	tied := buf[:0] // the least busy so far
	least, usable := int64(0), false
	for j, cc := range p.conns {
		st := cc.GetState()
		ok := st != connectivity.TransientFailure && st != connectivity.Shutdown
		if usable && !ok {
			continue
		}
		b := p.busy[j].Load()
		switch {
		case ok && !usable, len(tied) == 0, b < least:
			tied, least, usable = append(tied[:0], j), b, usable || ok
		case b == least:
			tied = append(tied, j)
		}
	}
	i := tied[p.next.Add(1)%uint64(len(tied))]
	p.busy[i].Add(1)
	return i, nil
}

// Invoke makes a unary call over the least busy connection.
func (p *Pool) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	i, err := p.pick()
	if err != nil {
		return err
	}
	defer p.busy[i].Add(-1)
	return p.conns[i].Invoke(ctx, method, args, reply, opts...)
}

// NewStream opens a stream over the least busy connection. The stream counts
// as in flight until gRPC finishes it (grpc.OnFinish: its end read, an
// error, its context done, the connection closed), or, should an interceptor
// drop that call option, until RecvMsg returns an error or a stream without
// server streaming its response, or SendMsg fails.
func (p *Pool) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	i, err := p.pick()
	if err != nil {
		return nil, err
	}
	ps := &poolStream{busy: &p.busy[i], one: !desc.ServerStreams}
	opts = append(opts[:len(opts):len(opts)], grpc.OnFinish(func(error) { ps.end() }))
	st, err := p.conns[i].NewStream(ctx, desc, method, opts...)
	if err != nil {
		ps.end()
		return nil, err
	}
	ps.ClientStream = st
	return ps, nil
}

// poolStream is a stream of a Pool: it gives its connection's count back once
// it ended.
type poolStream struct {
	grpc.ClientStream
	busy  *atomic.Int64 // its connection's count
	one   bool          // one response: the stream ends with it
	ended atomic.Bool
}

func (s *poolStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err != nil || s.one {
		s.end()
	}
	return err
}

// SendMsg ends the stream on an error other than io.EOF, as gRPC does (io.EOF
// says the stream ended, its status for RecvMsg to tell).
func (s *poolStream) SendMsg(m any) error {
	err := s.ClientStream.SendMsg(m)
	if err != nil && err != io.EOF {
		s.end()
	}
	return err
}

// end gives the count back, once.
func (s *poolStream) end() {
	if s.ended.CompareAndSwap(false, true) {
		s.busy.Add(-1)
	}
}

var _ grpc.ClientConnInterface = (*Pool)(nil)
