package transport

import (
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/yamux"
)

// KeepAliveError is the cause of a session closed because its peer did not
// answer a ping in time.
type KeepAliveError struct {
	Interval, Timeout time.Duration
	Err               error // what the ping returned
}

func (e *KeepAliveError) Error() string {
	return fmt.Sprintf("gdrpc: peer did not answer keepalive within %v (interval %v): %v", e.Timeout, e.Interval, e.Err)
}

// Is makes errors.Is(err, ErrKeepAlive) true.
func (e *KeepAliveError) Is(target error) bool { return target == ErrKeepAlive }

func (e *KeepAliveError) Unwrap() error { return e.Err }

// keepalive pings the peer every interval; a ping not answered within the
// timeout (yamux's ConnectionWriteTimeout, set to it) closes the session. The
// peer's multiplexer answers pings by itself, so a live process always
// answers; a stopped, hung or unreachable one does not. gRPC's own TCP
// keepalive does nothing here: the session's conn is not a TCP conn.
func (s *Session) keepalive() {
	defer s.wg.Done()
	interval := s.cfg.kaInterval
	if interval < 0 {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
		}
		rtt, err := s.mux.Ping()
		if err != nil {
			if errors.Is(err, yamux.ErrSessionShutdown) {
				return
			}
			s.closeWith(&KeepAliveError{Interval: interval, Timeout: s.cfg.kaTimeout, Err: err})
			return
		}
		s.rtt.Store(int64(rtt))
	}
}
