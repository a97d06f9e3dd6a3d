//go:build !cgo || nordma

package rdma

import (
	"context"
	"fmt"
	"net"
	"time"
)

var errBuild = fmt.Errorf("%w: built without UCX (cgo disabled or the nordma tag)", ErrNotSupported)

// Available reports why UCX cannot be used: this build has no UCX.
func Available() error { return errBuild }

// DirectCopiesOff says that this build makes no direct copies.
func DirectCopiesOff() string { return errBuild.Error() }

// Context is a UCX context. In this build it cannot be created.
type Context struct{}

// NewContext reports ErrNotSupported in this build.
func NewContext(opts ...Option) (*Context, error) { return nil, errBuild }

// Default reports ErrNotSupported in this build.
func Default() (*Context, error) { return nil, errBuild }

func (c *Context) Info() Info                                    { return Info{} }
func (c *Context) Worker() *Worker                               { return nil }
func (c *Context) NewWorker() (*Worker, error)                   { return nil, errBuild }
func (c *Context) Alloc(n int) (*Memory, error)                  { return nil, errBuild }
func (c *Context) Map(uintptr, int, MemoryType) (*Memory, error) { return nil, errBuild }
func (c *Context) MapCUDA(uintptr, int, int) (*Memory, error)    { return nil, errBuild }
func (c *Context) UseCUDA(CUDA, int) error                       { return errBuild }
func (c *Context) CanMap(MemoryType) bool                        { return false }
func (c *Context) Close() error                                  { return nil }

// Worker is a UCX worker. In this build it cannot be created.
type Worker struct{}

func (w *Worker) Listen(addr string) (*Listener, error)                    { return nil, errBuild }
func (w *Worker) Dial(ctx context.Context, addr string) (*Endpoint, error) { return nil, errBuild }
func (c *Context) DialApart(ctx context.Context, addr string) (*Endpoint, error) {
	return nil, errBuild
}
func (w *Worker) Flush(ctx context.Context) error { return errBuild }
func (w *Worker) Close() error                    { return nil }

// Listener accepts UCX connection requests. In this build it cannot be created.
type Listener struct{}

func (l *Listener) Addr() net.Addr                                { return &Addr{} }
func (l *Listener) Accept(ctx context.Context) (*Endpoint, error) { return nil, errBuild }
func (l *Listener) SetFilter(func(remote net.Addr) bool)          {}
func (l *Listener) IsolateClients()                               {}
func (l *Listener) Close() error                                  { return nil }

// Endpoint is a connection to a peer worker. In this build it cannot be created.
type Endpoint struct{}

var _ net.Conn = (*Endpoint)(nil)

func (e *Endpoint) Read(p []byte) (int, error)         { return 0, errBuild }
func (e *Endpoint) Write(p []byte) (int, error)        { return 0, errBuild }
func (e *Endpoint) SetDeadline(t time.Time) error      { return errBuild }
func (e *Endpoint) SetReadDeadline(t time.Time) error  { return errBuild }
func (e *Endpoint) SetWriteDeadline(t time.Time) error { return errBuild }
func (e *Endpoint) TransportInfo() string              { return "" }
func (e *Endpoint) LocalAddr() net.Addr                { return &Addr{} }
func (e *Endpoint) RemoteAddr() net.Addr               { return &Addr{} }
func (e *Endpoint) Close() error                       { return nil }
func (e *Endpoint) Abort() error                       { return nil }
func (e *Endpoint) Done() <-chan struct{}              { return closedChan }
func (e *Endpoint) Err() error                         { return errBuild }
func (e *Endpoint) OnError(func(error))                {}
func (e *Endpoint) UnpackKey(packed []byte) (*RemoteKey, error) {
	if _, err := decodeKey(packed); err != nil {
		return nil, err
	}
	return nil, errBuild
}
func (e *Endpoint) UnpackForeignKey(packed []byte) (*RemoteKey, error) { return e.UnpackKey(packed) }
func (e *Endpoint) KeyDomains(packed []byte) ([]string, error) {
	if _, err := decodeKey(packed); err != nil {
		return nil, err
	}
	return nil, errBuild
}
func (e *Endpoint) RMADomains() ([]string, error) { return nil, errBuild }
func (e *Endpoint) Put(ctx context.Context, src *Memory, srcOff, n int, remote uint64, key *RemoteKey) error {
	return errBuild
}
func (e *Endpoint) PutBytes(ctx context.Context, p []byte, remote uint64, key *RemoteKey) error {
	return errBuild
}
func (e *Endpoint) Get(ctx context.Context, dst *Memory, dstOff, n int, remote uint64, key *RemoteKey) error {
	return errBuild
}
func (e *Endpoint) Flush(ctx context.Context) error { return errBuild }

// Memory is a registered memory region. In this build it cannot be created.
type Memory struct{}

func (m *Memory) Addr() uintptr            { return 0 }
func (m *Memory) Len() int                 { return 0 }
func (m *Memory) Type() MemoryType         { return MemoryHost }
func (m *Memory) Bytes() []byte            { return nil }
func (m *Memory) PackKey() ([]byte, error) { return nil, errBuild }
func (m *Memory) Close() error             { return nil }

// RemoteKey is a peer's unpacked remote key. In this build it cannot be created.
type RemoteKey struct{}

func (k *RemoteKey) Close() error { return nil }

// Direct reports false: there are no direct copies in this build.
func (k *RemoteKey) Direct() bool { return false }

// Domains returns nil in this build.
func (k *RemoteKey) Domains() []string { return nil }

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()
