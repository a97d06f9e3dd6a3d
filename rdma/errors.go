package rdma

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
)

// ErrNotSupported reports that UCX cannot be used: the build has no UCX (no cgo,
// or the nordma tag), UCX failed to initialise, or UCX cannot do what was asked
// (for example register CUDA memory). It is wrapped with the reason.
var ErrNotSupported = errors.New("rdma: not supported")

// ErrIPv6 reports an IPv6 address given to Listen or Dial. UCX's sockaddr
// connections are made over IPv4 alone: with Debian's UCX 1.13 an endpoint
// over IPv6 loopback was rejected by its peer and the process's heap was
// found corrupted when its worker was destroyed (glibc aborted), so no IPv6
// address reaches UCX.
var ErrIPv6 = errors.New("rdma: IPv6 addresses are not supported (UCX endpoints are made over IPv4)")

// ErrRejected reports a connection request the listener turned away
// (UCS_ERR_REJECTED): a dial returns it wrapped.
var ErrRejected = errors.New("rdma: connection rejected by the listener")

// UCX status codes this package looks at (values from ucs/type/status.h).
const (
	statusOK                  = 0
	statusInProgress          = 1
	statusNoMemory            = -4
	statusInvalid             = -5
	statusBusy                = -15
	statusCanceled            = -16
	statusUnsupported         = -22
	statusRejected            = -23
	statusConnReset           = -25
	statusIOError             = -3
	statusUnreachable         = -6
	statusNotConnected        = -24
	statusFirstLinkFailure    = -40
	statusLastEndpointFailure = -89
)

// StatusError is a UCX status other than success, with the operation that
// returned it.
type StatusError struct {
	Op     string // the UCX operation, e.g. "ucp_put_nbx"
	Status int    // the ucs_status_t value
	Msg    string // ucs_status_string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("rdma: %s: %s (status %d)", e.Op, e.Msg, e.Status)
}

// Is reports UCS_ERR_UNSUPPORTED as ErrNotSupported, UCS_ERR_REJECTED as
// ErrRejected, and UCS_ERR_CONNECTION_RESET and UCS_ERR_NOT_CONNECTED as
// syscall.ECONNRESET and syscall.ENOTCONN (a peer that aborted its
// endpoint, after or while it was connected).
func (e *StatusError) Is(target error) bool {
	return target == ErrNotSupported && e.Status == statusUnsupported ||
		target == ErrRejected && e.Status == statusRejected ||
		target == syscall.ECONNRESET && e.Status == statusConnReset ||
		target == syscall.ENOTCONN && e.Status == statusNotConnected
}

// EndpointError reports that an endpoint failed: the peer died, the connection
// was reset or timed out. Every pending and later operation on the endpoint
// returns it.
type EndpointError struct {
	Status int
	Msg    string
	err    error // the *StatusError
}

func (e *EndpointError) Error() string {
	return fmt.Sprintf("rdma: endpoint failed: %s (status %d)", e.Msg, e.Status)
}

func (e *EndpointError) Unwrap() error { return e.err }

func newEndpointError(op string, status int, msg string) *EndpointError {
	return &EndpointError{Status: status, Msg: msg, err: &StatusError{Op: op, Status: status, Msg: msg}}
}

// timeoutError is returned when a deadline passes. It is a net.Error with
// Timeout() true and unwraps to os.ErrDeadlineExceeded.
type timeoutError struct{ op string }

func (e *timeoutError) Error() string   { return "rdma: " + e.op + ": i/o timeout" }
func (e *timeoutError) Timeout() bool   { return true }
func (e *timeoutError) Temporary() bool { return true }
func (e *timeoutError) Unwrap() error   { return os.ErrDeadlineExceeded }

var _ net.Error = (*timeoutError)(nil)

// errPeerClosed ends an endpoint whose peer closed it: Read returns io.EOF.
var errPeerClosed = fmt.Errorf("rdma: peer closed the endpoint: %w", io.EOF)

// closedError wraps net.ErrClosed with what was closed.
func closedError(what string) error {
	return fmt.Errorf("rdma: %s: %w", what, net.ErrClosed)
}
