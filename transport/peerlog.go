package transport

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"
)

// peerLog logs what anyone who reaches a listener can cause once per
// connection (a failed handshake, a refused lane, an endpoint closed): each
// kind of line at its level at most once per every, the others of that kind
// at Debug, and the next one logged at its level says how many were held
// back. A peer then cannot fill the log at the rate it opens connections,
// while an operator still sees each kind of failure and how often it came.
type peerLog struct {
	log   *slog.Logger
	every time.Duration

	mu    sync.Mutex
	kinds map[string]*peerLogKind // by message (and class of error): a fixed set
}

type peerLogKind struct {
	at   time.Time // when one was last logged at its level
	held int       // logged at Debug since
}

// peerLogEvery is how often a listener logs each kind of per-connection
// failure at its level.
const peerLogEvery = 10 * time.Second

func newPeerLog(log *slog.Logger, every time.Duration) *peerLog {
	return &peerLog{log: log, every: every, kinds: map[string]*peerLogKind{}}
}

func (p *peerLog) Warn(msg string, args ...any) { p.logAt(slog.LevelWarn, msg, msg, args...) }
func (p *peerLog) Info(msg string, args ...any) { p.logAt(slog.LevelInfo, msg, msg, args...) }

// WarnErr is Warn for a failure err, each class of error (errClass) a kind
// of its own: a flood of junk does not hide an honest client's version or
// identity rejects, nor this side's own faults.
func (p *peerLog) WarnErr(msg string, err error, args ...any) {
	p.logAt(slog.LevelWarn, msg+"\x00"+errClass(err), msg, append(args, "err", err)...)
}

// errClass names the class of a handshake or lane error.
func errClass(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, ErrPeerGone):
		return "peer gone"
	case errors.Is(err, ErrVersion):
		return "version"
	case errors.Is(err, ErrIdentity):
		return "identity"
	case errors.Is(err, ErrMalformed), errors.Is(err, ErrNotGDRPC):
		return "malformed"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "other"
}

func (p *peerLog) logAt(level slog.Level, kind, msg string, args ...any) {
	p.logTo(p.log, level, kind, msg, args...)
}

// logTo is logAt to log, whose lines of kind share p's bound.
func (p *peerLog) logTo(log *slog.Logger, level slog.Level, kind, msg string, args ...any) {
	now := time.Now()
	p.mu.Lock()
	k := p.kinds[kind]
	if k == nil {
		k = &peerLogKind{}
		p.kinds[kind] = k
	}
	if !k.at.IsZero() && now.Sub(k.at) < p.every {
		k.held++
		p.mu.Unlock()
		log.Debug(msg, args...)
		return
	}
	held, since := k.held, k.at
	k.at, k.held = now, 0
	p.mu.Unlock()
	if held > 0 {
		args = append(args, "more_at_debug", held, "since", since.Format(time.RFC3339))
	}
	log.Log(context.Background(), level, msg, args...)
}
