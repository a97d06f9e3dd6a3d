package dialer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
)

// Pool is a grpc.ClientConnInterface over several ClientConns to one target,
// each on a session of its own. One ClientConn carries all its calls over one
// HTTP/2 transport, with one writer and one reader on each side, so calls that
// move large payloads out of band queue behind each other's messages there; a
// pool spreads them. Each call or stream goes over the connection with the
// fewest calls and streams in flight, ties taken in turn. Generated clients
// take a Pool where they take a *grpc.ClientConn:
//
//	d := dialer.New(gdrpc.WithTrustPeers())
//	pool, err := dialer.NewPool("passthrough:///host:50051", 4, d.DialOptions(nil)...)
//	...
//	client := tensorpb.NewTensorServiceClient(pool)
//
// Each session has its own receive spaces (gdrpc.WithReceiveSpaceLimit), so
// a pool of n connections may set aside up to n times a session's space.
type Pool struct {
	conns []*grpc.ClientConn
	busy  []atomic.Int64 // calls and streams in flight on conns[i]
	next  atomic.Uint64  // where the search for the least busy starts
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

// Conns returns the pool's connections, to watch their state or connect them
// ahead of the first calls. Closing one fails the calls that go over it.
func (p *Pool) Conns() []*grpc.ClientConn { return p.conns }

// Close closes every connection of the pool.
func (p *Pool) Close() error {
	var errs []error
	for _, cc := range p.conns {
		errs = append(errs, cc.Close())
	}
	return errors.Join(errs...)
}

// pick returns the connection with the fewest calls in flight, counted as
// taken: the search starts one connection further each time, so connections
// equally busy take calls in turn.
func (p *Pool) pick() int {
	n := uint64(len(p.conns))
	start := p.next.Add(1) % n
	best, least := start, p.busy[start].Load()
	for i := uint64(1); i < n && least > 0; i++ {
		j := (start + i) % n
		if b := p.busy[j].Load(); b < least {
			best, least = j, b
		}
	}
	p.busy[best].Add(1)
	return int(best)
}

// Invoke makes a unary call over the least busy connection.
func (p *Pool) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	i := p.pick()
	defer p.busy[i].Add(-1)
	return p.conns[i].Invoke(ctx, method, args, reply, opts...)
}

// NewStream opens a stream over the least busy connection. The stream counts
// as in flight until RecvMsg returns an error (io.EOF at its end included) or
// ctx is done, gRPC's own rules for when a stream's resources are released.
func (p *Pool) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	i := p.pick()
	st, err := p.conns[i].NewStream(ctx, desc, method, opts...)
	if err != nil {
		p.busy[i].Add(-1)
		return nil, err
	}
	ps := &poolStream{ClientStream: st, busy: &p.busy[i]}
	stop := context.AfterFunc(ctx, ps.end)
	ps.mu.Lock()
	ps.stop = stop
	ps.mu.Unlock()
	return ps, nil
}

// poolStream is a stream of a Pool: it gives its connection's count back once
// it ended.
type poolStream struct {
	grpc.ClientStream
	busy *atomic.Int64 // its connection's count

	mu    sync.Mutex
	ended bool
	stop  func() bool // stops the watch on the stream's context
}

func (s *poolStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err != nil {
		s.end()
	}
	return err
}

// end gives the count back, once. It may run on the context's watch before
// NewStream has stored stop, hence the lock.
func (s *poolStream) end() {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	stop := s.stop
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
	s.busy.Add(-1)
}

var _ grpc.ClientConnInterface = (*Pool)(nil)
