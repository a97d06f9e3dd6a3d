package oob

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"github.com/gdrpc/gdrpc/transport"
)

// Engine returns the out-of-band engine with the process's configuration
// (SetTransferConfig), as sessions take it (transport.WithEngine).
func Engine() transport.Engine { return engine{} }

// New returns the out-of-band engine with configuration c for the transfers
// over the sessions it is given to (packages dialer and listener make one per
// Dialer and Listener). What a payload's owner does before any session is
// involved (Offer) and the host pool follow the process's configuration. All
// engines of a process share its outbox, its pulls and the process-wide limit
// (Limits.TotalPullBytes): descriptors name the process, whatever session
// carries them.
func New(c TransferConfig) transport.Engine { return engine{c: c.withDefaults()} }

// engine is a transport.Engine; its configuration is c, or the process's
// when c is nil.
type engine struct{ c *TransferConfig }

func (e engine) config() *TransferConfig {
	if e.c != nil {
		return e.c
	}
	return cfg()
}

// codecs are the codecs whose transfers the engine serves: gdr (package
// gdrcodec). Shared by every Codecs call, and never modified.
var codecs = []string{"gdr"}

// Codecs: the engine serves the transfers of the gdr codec.
func (engine) Codecs() []string { return codecs }

func (e engine) Attach(s *transport.Session, link *transport.Link) transport.Handler {
	a := &attached{s: s, link: link, eng: e, cutLinger: make(chan struct{})}
	sessions.Store(s, a)
	return a
}

// attached is the engine's state of one session it serves.
type attached struct {
	s      *transport.Session
	link   *transport.Link // nil for closedState
	eng    engine
	bounds sessionBounds
	act    activity
	space  spaceState

	// lingering: the session's gRPC conn closed and Linger runs.
	lingering atomic.Bool
	// callEnds are the CALL-ENDEDs waiting to go over the session.
	callEnds callEnds
	// cutLinger is closed when the linger must end now: too many sessions
	// to the peer or its host linger (Limits.PeerLingeringSessions,
	// HostLingeringSessions).
	cutLinger chan struct{}
	// openCalls are this side's client calls whose messages may still name
	// payloads to pull over the session (Receiving); receives is set once
	// this side made one (it is the gRPC client, whichever side dialed).
	openCalls atomic.Int64
	receives  atomic.Bool
	// peerLinger is the peer's latest ctlHold or ctlRelease: its sequence
	// number shifted left by one, the low bit set for a hold.
	peerLinger atomic.Uint64
	// lingerSeq numbers this side's ctlHold and ctlRelease.
	lingerSeq atomic.Uint64
}

// peerHolds reports whether the peer's latest word is a hold. A side that
// made calls over the session takes no word from its peer, which serves
// them: a hold recorded before the first call counts no more.
func (a *attached) peerHolds() bool { return !a.receives.Load() && a.peerLinger.Load()&1 == 1 }

// sessions maps the sessions the engine serves, until they close, to their
// state.
var sessions sync.Map // *transport.Session -> *attached

// closedState stands for a session the engine does not serve (any more): it
// sends nothing, starts nothing and its context has ended.
var closedState = func() *attached {
	a := &attached{}
	a.bounds.closing = true
	a.space.stopped = true
	a.bounds.ctx, a.bounds.cancel = context.WithCancel(context.Background())
	a.bounds.cancel()
	return a
}()

// stateOf returns the engine's state of s, closedState when it does not serve s.
func stateOf(s *transport.Session) *attached {
	if a, ok := sessions.Load(s); ok {
		return a.(*attached)
	}
	return closedState
}

// cfgOf returns the configuration of the transfers over s.
func cfgOf(s *transport.Session) *TransferConfig { return stateOf(s).eng.config() }

// dropControl logs a control message from the peer of s that this side
// drops (malformed, or naming what it does not hold), bounded as the
// transport bounds its own lines about what peers send (Link.WarnPeer): a
// peer can send such messages as fast as it writes.
func dropControl(s *transport.Session, err error) {
	a := stateOf(s)
	log := a.eng.config().Logger
	if a.link == nil {
		log.Debug("dropping control message", "session", s.ID(), "err", err)
		return
	}
	a.link.WarnPeer(log, "dropping control message", "session", s.ID(), "err", err)
}

// served reports whether the engine serves s.
func served(s *transport.Session) bool {
	_, ok := sessions.Load(s)
	return ok
}

// Control messages by type, and the bulk stream handler; tests replace
// them under controlMu.
var (
	controlMu       sync.RWMutex
	controlHandlers = map[byte]func(s *transport.Session, payload []byte){
		ctlRTR:            queueRTR,
		ctlFIN:            handleFIN,
		ctlChunk:          handleChunk,
		ctlSpace:          handleSpace,
		ctlSpaceFree:      handleSpaceFree,
		ctlSpaceWithdraw:  handleSpaceWithdraw,
		ctlSpaceWithdrawn: handleSpaceWithdrawn,
		ctlCallEnded:      handleCallEnded,
		ctlWritesEnded:    handleWritesEnded,
		ctlHold:           handleHold,
		ctlRelease:        handleRelease,
	}
	bulkHandler = serveBulk
	laneHandler = serveBulkLane
)

func (a *attached) Control(typ byte, payload []byte) {
	controlMu.RLock()
	fn := controlHandlers[typ]
	controlMu.RUnlock()
	if fn != nil {
		fn(a.s, payload)
		return
	}
	a.eng.config().Logger.Debug("control message of unknown type dropped", "session", a.s.ID(), "type", typ, "len", len(payload))
}

func (a *attached) Bulk(c net.Conn) {
	controlMu.RLock()
	fn := bulkHandler
	controlMu.RUnlock()
	fn(a.s, c)
}

func (a *attached) Lane(c net.Conn) error {
	controlMu.RLock()
	fn := laneHandler
	controlMu.RUnlock()
	return fn(a.s, c)
}
func (a *attached) Linger() {
	lingerForTransfers(a)
	withdrawSpace(a)
}
func (a *attached) Join() { a.bounds.join() }

func (a *attached) Closed() {
	sessions.Delete(a.s)
	endSpaces(a)
	dropRemoteKeys(a.s)
	endBounds(a)
	releaseSentTo(a.s)
}

// sendControl sends a control message on s, failing as a closed session does
// when the engine does not serve s.
func sendControl(ctx context.Context, s *transport.Session, typ byte, payload []byte) error {
	a := stateOf(s)
	if a.link == nil {
		return fmt.Errorf("%w: %w", transport.ErrNoLaneTurn, closedErr(s))
	}
	return a.link.SendControl(ctx, typ, payload)
}

// closedErr is the error of a call on s once it closed.
func closedErr(s *transport.Session) error {
	if a := stateOf(s); a.link != nil {
		return a.link.ClosedErr()
	}
	if err := s.Err(); err != nil {
		return err
	}
	return transport.ErrSessionClosed
}

// sessionContext returns a context that ends with s.
func sessionContext(s *transport.Session) context.Context {
	a := stateOf(s)
	if a.link == nil {
		return a.bounds.ctx
	}
	return a.link.Context()
}

// abort ends s with cause.
func abort(s *transport.Session, cause error) {
	if a := stateOf(s); a.link != nil {
		a.link.Abort(cause)
	}
}
