package oob

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime/trace"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// DefaultTransferTimeout bounds one out-of-band transfer when the caller's context
// has no earlier deadline.
const DefaultTransferTimeout = time.Minute

// DefaultStagingChunk is the chunk size of staged GPU transfers.
const DefaultStagingChunk = 4 << 20

// Metrics receives out-of-band transfer events. Implementations must be cheap and
// safe for concurrent use.
type Metrics interface {
	// Transfer reports one finished transfer, on both sides.
	Transfer(TransferInfo)
	// Fallback reports that a better path was not taken, and why.
	Fallback(wanted, took Path, reason string)
}

// TransferInfo describes one finished transfer.
type TransferInfo struct {
	// Path is the path the transfer took; PathNone for one that failed
	// before it took any.
	Path Path
	// Bytes is the payload's length as its descriptor gives it: what moved
	// when Err is nil, and otherwise only what the peer claimed.
	Bytes int64
	// Elapsed is the transfer's time on this side: from the receiver's
	// request (or its taking a payload that landed in its space), or the
	// owner's first write, to the end.
	Elapsed time.Duration
	// Err is nil for a transfer that completed. On the receiver's side a
	// failure is a *TransferError, whose Kind says what went wrong.
	Err error
	// Pull is true on the receiver's side (the bytes arrived here), false on the
	// owner's (the bytes left from here).
	Pull bool
	// Memory is the kind of this side's buffer: the destination on the
	// receiver's side, the source on the owner's.
	Memory devicebuf.Kind
	// Advertised is true when the payload went into receive space the
	// receiver advertised, with no rendezvous: the owner wrote it while it
	// marshaled the message, and the receiver took it from there.
	Advertised bool
	// Queued is true for an advertised payload whose copy (CUDA IPC, GPU to
	// GPU) the owner queued on the device without waiting for it: the
	// message went while it ran, and a receiver's event marks its end.
	Queued bool
}

// kindOf returns b's kind, Host when there is no buffer (yet).
func kindOf(b *devicebuf.Buffer) devicebuf.Kind {
	if b == nil {
		return devicebuf.Host
	}
	return b.Kind()
}

// Route names the path with what it means for this side's memory: "rdma/cuda"
// is an RDMA transfer straight from or into GPU memory (GPUDirect RDMA, or
// UCX's own CUDA transports), "rdma" one from or into host memory.
func (i TransferInfo) Route() string {
	if i.Path == PathRDMA && i.Memory == devicebuf.CUDA {
		return "rdma/cuda"
	}
	return i.Path.String()
}

type nopMetrics struct{}

func (nopMetrics) Transfer(TransferInfo)       {}
func (nopMetrics) Fallback(Path, Path, string) {}

// TransferConfig tunes the out-of-band engine of this process.
type TransferConfig struct {
	// Timeout bounds one transfer. If zero, DefaultTransferTimeout.
	Timeout time.Duration
	// StagingChunk is the chunk size of staged (GPU via host) transfers. If zero,
	// DefaultStagingChunk.
	StagingChunk int
	// PoolBytes bounds the registered host memory kept for destinations
	// and staging: the process's host pool, so only SetTransferConfig's, set
	// before the pool's first use, counts. A destination the full pool cannot give
	// comes from Go memory, and staging falls back to the stream path. If
	// zero, 2 GiB.
	PoolBytes int64
	// Paths limits the paths transfers may take (PathCUDAIPC|PathRDMA; the
	// stream path is always allowed, and PathRDMA covers staged GPU transfers).
	// If zero, all.
	Paths Path
	// Logger receives one debug record per transfer (path and reason). If nil,
	// nothing is logged.
	Logger *slog.Logger
	// Metrics receives transfer events. If nil, none are reported.
	Metrics Metrics
	// Limits bound what one peer's session may hold; their zero fields take
	// the defaults Limits documents.
	Limits Limits
	// ReceiveSpace is the receive space advertised to each trusted peer
	// (space.go): payloads it sends over the session land there without a
	// rendezvous. Above zero, one space of that size per session; negative,
	// none. If zero, the spaces grow with the payloads within
	// ReceiveSpaceLimit: room for four payloads of the size of the pull that
	// prompts one (at least DefaultReceiveSpace or a quarter of the limit,
	// whichever is less), and another whenever the session's spaces cannot
	// hold two payloads of a pull's size, up to four spaces.
	ReceiveSpace int
	// ReceiveSpaceLimit bounds the growing spaces of a session (ReceiveSpace
	// zero), all of them together. If zero, DefaultReceiveSpaceLimit on a
	// client's sessions, and none on a server's (its sessions advertise
	// space for requests' payloads, OfferRequest, only when configured to:
	// a size, or a limit); negative, none. A limit above zero applies to
	// the sessions of both sides that use this configuration: an engine
	// shared by clients and servers sets space aside for requests too. The
	// spaces of all sessions together stay within Limits.SpaceBytes.
	ReceiveSpaceLimit int
	// StreamOrdered hands out a payload that landed in GPU receive space
	// while the owner's copy into it may still run: the buffer is Pending
	// (devicebuf.Buffer.Wait, WaitOn) instead of the receive waiting for the
	// copy. Off, the receive returns once the bytes are in place.
	StreamOrdered bool
}

var oobConfig atomic.Pointer[TransferConfig]

// SetTransferConfig replaces the engine's configuration for transfers that start
// afterwards.
func SetTransferConfig(c TransferConfig) { oobConfig.Store(c.withDefaults()) }

// withDefaults returns c with its zero fields set to their defaults.
func (c TransferConfig) withDefaults() *TransferConfig {
	if c.Timeout <= 0 {
		c.Timeout = DefaultTransferTimeout
	}
	if c.StagingChunk <= 0 {
		c.StagingChunk = DefaultStagingChunk
	}
	if c.PoolBytes <= 0 {
		c.PoolBytes = 2 << 30
	}
	if c.Paths == 0 {
		c.Paths = PathCUDAIPC | PathRDMA
	}
	c.Paths |= PathStream
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = nopMetrics{}
	}
	if c.Limits.SpaceBytes <= 0 {
		// A session's configured space is never refused by the default
		// bound of all of them.
		c.Limits.SpaceBytes = max(DefaultSpaceBytes, int64(c.ReceiveSpace), int64(c.ReceiveSpaceLimit))
	}
	c.Limits = c.Limits.withDefaults(c.Timeout)
	return &c
}

var defaultConfig = sync.OnceValue(TransferConfig{}.withDefaults)

// cfg returns the engine's configuration.
func cfg() *TransferConfig {
	if c := oobConfig.Load(); c != nil {
		return c
	}
	return defaultConfig()
}

// TransferError is a failed out-of-band transfer.
type TransferError struct {
	Token Token
	// Unavailable: no live session to the owner, or the session died.
	// NotFound: the owner does not (or no longer) hold the token.
	// Timeout: the transfer did not finish in time.
	// Exhausted: a limit (Limits) refused the transfer.
	Kind TransferErrorKind
	Err  error
}

// TransferErrorKind classifies a TransferError.
type TransferErrorKind int

const (
	TransferFailed TransferErrorKind = iota
	TransferUnavailable
	TransferNotFound
	TransferTimeout
	TransferInvalid
	TransferCanceled
	TransferExhausted
)

func (e *TransferError) Error() string {
	return fmt.Sprintf("out-of-band transfer of token %v: %v", e.Token, e.Err)
}

func (e *TransferError) Unwrap() error { return e.Err }

// Timeout reports whether the transfer ran out of time.
func (e *TransferError) Timeout() bool { return e.Kind == TransferTimeout }

// ---- lingering ------------------------------------------------------------------

// LingerIdle is how long each end of a session between two gdrpc processes
// must see no out-of-band transfer, after the session's gRPC conn closed,
// before it lets the session close (lingerForTransfers): gRPC
// closes a connection as soon as its last stream ended (GOAWAY,
// MaxConnectionAge, idleness), which can be before the application decoded
// the last response and pulled its payloads through the session.
const LingerIdle = 500 * time.Millisecond

// lingerPoll is how often a lingering session looks again whether the calls
// that keep it up ended.
const lingerPoll = 20 * time.Millisecond

// lingerers are the sessions lingering, by peer and by remote host, oldest
// first.
var lingerers = struct {
	sync.Mutex
	byPeer map[transport.ID][]*attached
	byHost map[netip.Prefix][]*attached
}{byPeer: map[transport.ID][]*attached{}, byHost: map[netip.Prefix][]*attached{}}

// startLinger files a among its peer's and its host's lingering sessions,
// and ends the linger of the oldest of either once they are more than a's
// session's Limits.PeerLingeringSessions or Limits.HostLingeringSessions.
func startLinger(a *attached) {
	lim := cfgOf(a.s).Limits
	lingerers.Lock()
	defer lingerers.Unlock()
	if cut := fileLinger(lingerers.byPeer, a.s.PeerID(), a, lim.PeerLingeringSessions); cut != nil {
		dropLinger(lingerers.byHost, cut.s.RemoteHost(), cut)
		close(cut.cutLinger)
		if cut == a {
			return // the peer's others are all kept up by this side's calls
		}
	}
	if cut := fileLinger(lingerers.byHost, a.s.RemoteHost(), a, lim.HostLingeringSessions); cut != nil {
		dropLinger(lingerers.byPeer, cut.s.PeerID(), cut)
		close(cut.cutLinger)
	}
}

// endLinger takes a out of the lingering sessions.
func endLinger(a *attached) {
	lingerers.Lock()
	defer lingerers.Unlock()
	dropLinger(lingerers.byPeer, a.s.PeerID(), a)
	dropLinger(lingerers.byHost, a.s.RemoteHost(), a)
}

// fileLinger appends a to m[k] and, where that makes them more than bound,
// takes out and returns the oldest that no call of this side's own keeps
// up, whose linger the caller ends (nil: none).
func fileLinger[K comparable](m map[K][]*attached, k K, a *attached, bound int) (cut *attached) {
	l := append(m[k], a)
	if len(l) > bound {
		if i := slices.IndexFunc(l, func(o *attached) bool { return o.openCalls.Load() == 0 }); i >= 0 {
			cut = l[i]
			l = slices.Delete(l, i, i+1)
		}
	}
	m[k] = l
	return cut
}

// dropLinger takes a out of m[k], if there.
func dropLinger[K comparable](m map[K][]*attached, k K, a *attached) {
	l := m[k]
	if i := slices.Index(l, a); i >= 0 {
		l = slices.Delete(l, i, i+1)
	}
	if len(l) == 0 {
		delete(m, k)
	} else {
		m[k] = l
	}
}

// activity is a session's out-of-band use.
type activity struct {
	inflight atomic.Int64 // pulls and pushes under way
	last     atomic.Int64 // unix nanos of the last start or end of one
}

func activityOf(s *transport.Session) *activity { return &stateOf(s).act }

// busy marks a transfer on s under way until the returned function runs.
func busy(s *transport.Session) func() {
	a := activityOf(s)
	a.inflight.Add(1)
	a.last.Store(time.Now().UnixNano())
	return func() {
		a.last.Store(time.Now().UnixNano())
		a.inflight.Add(-1)
	}
}

// lingerForTransfers keeps a's session up after its gRPC conn closed for as
// long as either side may still pull over it, and returns when:
//   - this side saw no out-of-band transfer for LingerIdle, has no open call
//     (Receiving), and the peer does not hold the session;
//   - the session died;
//   - more than Limits.PeerLingeringSessions sessions to the peer, or
//     Limits.HostLingeringSessions to its host, linger, and a is the oldest
//     of them that no call of this side's keeps up;
//   - or the transfer timeout ran out, whatever the peer says or keeps doing.
//
// A side with open calls asks the peer to hold the session (ctlHold) and
// releases it (ctlRelease) once they ended: only the receiver knows whether
// the descriptors it was sent may still be decoded, and the owner would
// otherwise close the session under a client whose stream's last messages
// wait unread in gRPC's buffers. Sessions whose peer does not speak the gdr
// codec close at once.
func lingerForTransfers(a *attached) {
	s := a.s
	if !s.Speaks("gdr") {
		return
	}
	if !a.lingering.CompareAndSwap(false, true) {
		return // lingering already
	}
	startLinger(a)
	defer endLinger(a)
	act := &a.act
	act.last.Store(max(act.last.Load(), time.Now().UnixNano()))
	deadline := time.Now().Add(cfgOf(s).Timeout)
	t := time.NewTimer(LingerIdle)
	defer t.Stop()
	held := false // this side asked the peer to hold the session
	for {
		if !held && a.openCalls.Load() > 0 {
			held = true
			if sendLinger(a, ctlHold, deadline) != nil {
				return // the session is going anyway
			}
		}
		select {
		case <-s.Done():
			return
		case <-a.cutLinger:
			cfgOf(s).Logger.Debug("session's linger cut: more sessions to its peer, or its host, linger", "session", s.ID(),
				"max_peer", cfgOf(s).Limits.PeerLingeringSessions, "max_host", cfgOf(s).Limits.HostLingeringSessions)
			return
		case <-t.C:
		}
		now := time.Now()
		if now.After(deadline) {
			return
		}
		idle := now.Sub(time.Unix(0, act.last.Load()))
		wait := max(LingerIdle-idle, 10*time.Millisecond)
		if act.inflight.Load() == 0 && idle >= LingerIdle {
			open := a.openCalls.Load() > 0
			if !open && held {
				held = false
				if sendLinger(a, ctlRelease, deadline) != nil {
					return
				}
			}
			if !open && !a.peerHolds() {
				return
			}
			wait = lingerPoll
		}
		t.Reset(min(wait, max(time.Until(deadline), time.Millisecond)))
	}
}

// sendLinger sends the peer of a's session a ctlHold or ctlRelease, numbered.
func sendLinger(a *attached, typ byte, deadline time.Time) error {
	ctx, cancel := context.WithDeadline(sessionContext(a.s), deadline)
	defer cancel()
	return sendControl(ctx, a.s, typ, lingerMsg(a.lingerSeq.Add(1)))
}

// handleHold and handleRelease record the peer's ctlHold and ctlRelease,
// unless a later one of the two was recorded already (their handlers may
// run in any order). A peer that holds a session it never releases keeps it
// up no longer than the transfer timeout after the conn closed.
func handleHold(s *transport.Session, payload []byte)    { recordLinger(s, payload, 1) }
func handleRelease(s *transport.Session, payload []byte) { recordLinger(s, payload, 0) }

func recordLinger(s *transport.Session, payload []byte, hold uint64) {
	if !served(s) {
		return
	}
	if a := stateOf(s); a.receives.Load() {
		// Only a client's calls hold a session (Receiving), and this side
		// makes them: the peer serves them, and its word would keep the
		// session up for nothing.
		cfgOf(s).Logger.Debug("dropping a server's linger word", "session", s.ID())
		return
	}
	seq, err := parseLinger(payload)
	if err != nil {
		dropControl(s, err)
		return
	}
	a := stateOf(s)
	word := seq<<1 | hold
	for {
		old := a.peerLinger.Load()
		if word>>1 <= old>>1 || a.peerLinger.CompareAndSwap(old, word) {
			return
		}
	}
}

// Receiving marks a client call whose received messages may still name
// payloads to pull over s (gRPC holds them until the application reads
// them) as open, until Received(s) is called for it, once: if gRPC closes
// the session's conn meanwhile (GOAWAY, MaxConnectionAge), the session stays
// up, bounded by the transfer timeout, so that the call can still pull.
func Receiving(s *transport.Session) { addOpenCalls(s, 1) }

// Received ends the mark of one call Receiving made on s.
func Received(s *transport.Session) { addOpenCalls(s, -1) }

func addOpenCalls(s *transport.Session, n int64) {
	if a, ok := sessions.Load(s); ok {
		if n > 0 {
			a.(*attached).receives.Store(true)
		}
		a.(*attached).openCalls.Add(n)
	}
}

// ---- receiver side -------------------------------------------------------------

// errRTRNotSent marks a pull whose session closed before any of its RTR was
// written: the owner cannot have it, so another session may carry the pull
// into the same destination.
var errRTRNotSent = errors.New("RTR not sent")

type pull struct {
	req uint64
	s   *transport.Session
	dst *devicebuf.Buffer // retained until settled
	fin chan *fin         // FIN from the owner (buffered 1)
	// chunks receives staged-chunk notices [off, off+n) when the destination is
	// GPU memory behind host staging; nil otherwise.
	chunks     chan [2]uint64
	chunksGone chan struct{} // closed when the reader of chunks stopped
	bulk       chan error    // the bulk stream's outcome (buffered 1)

	offers Path // the paths the RTR offered
	// answered: the owner's FIN came, so it writes into dst no more (a
	// stream's bytes go through a reader the pull controls): a caller that
	// gives up now leaves nothing to wait for.
	answered bool
	settle   sync.Once
	after    []func()      // run once the owner can no longer write into dst
	claimed  bool          // a bulk reader took the pull; guarded by pulls
	reading  chan struct{} // while a bulk reader writes into dst: closed when it stops; guarded by pulls
	detached bool          // settled, or given up (stopReads): no bulk reader may write into dst; guarded by pulls
	// bounce is a bulk lane reader's host buffer for a GPU dst, between
	// two frames of the transfer too; it goes when the pull settles at the
	// latest, so an owner that stops sending mid-transfer pins nothing
	// past the pull's life.
	bounce atomic.Pointer[devicebuf.Buffer]
	// released is closed once dst went back, its registration for the owner
	// undone (release).
	released chan struct{}
}

var pulls = struct {
	sync.Mutex
	next uint64
	m    map[uint64]*pull
}{m: make(map[uint64]*pull)}

// makePull makes the pull of a payload into dst through s; dst is released
// when the pull settles.
func makePull(s *transport.Session, dst *devicebuf.Buffer) *pull {
	return &pull{s: s, dst: dst, fin: make(chan *fin, 1), bulk: make(chan error, 1), released: make(chan struct{})}
}

// list registers p under a fresh request id, for the owner's FIN and bulk
// frames to find it.
func (p *pull) list() {
	pulls.Lock()
	pulls.next++
	p.req = pulls.next
	pulls.m[p.req] = p
	pulls.Unlock()
}

// settled ends p once no bulk reader writes into its destination any more,
// waiting for the one under way: dst, its staging and its reservation go.
func (p *pull) settled() {
	p.settle.Do(func() {
		if reading := p.detach(); reading != nil {
			<-reading // bounded: a read into dst has a deadline and dies with the session
		}
		p.dropBounce()
		if p.exposed() {
			select {
			case <-p.s.Done():
				// The session ended before the owner answered: a put it
				// began may still land in dst until the session's
				// endpoint is released (UCX copies what arrives to the
				// address it names), so dst goes back only then.
				go func() {
					<-p.s.Released()
					p.release()
				}()
				return
			default:
			}
		}
		p.release()
	})
}

// release gives back p's destination and what the pull held for it.
func (p *pull) release() {
	defer close(p.released)
	for i := len(p.after) - 1; i >= 0; i-- {
		p.after[i]()
	}
	p.dst.Release()
	// A frame lane's reader keeps the transfers the owner began and left
	// until their next frame or the lane's end, and with them p: p must
	// not keep what it no longer counts (Go memory lives while referenced).
	pulls.Lock()
	p.dst, p.after = nil, nil
	pulls.Unlock()
}

// detach takes p off the list, so that no bulk reader begins to write into
// its destination, and returns the channel closed when the read under way
// stops, or nil when none is.
func (p *pull) detach() chan struct{} {
	pulls.Lock()
	defer pulls.Unlock()
	delete(pulls.m, p.req)
	p.detached = true
	return p.reading
}

// stopReads keeps any bulk reader from writing into p's destination from
// now on (claimBulk and beginRead refuse it, and a stream reader stops at
// its next piece), while p stays listed for its FIN, and returns the read
// under way, if any.
func (p *pull) stopReads() chan struct{} {
	pulls.Lock()
	defer pulls.Unlock()
	p.detached = true
	return p.reading
}

// wanted reports whether a bulk reader may still write into p's
// destination (stopReads, detach).
func (p *pull) wanted() bool {
	pulls.Lock()
	defer pulls.Unlock()
	return !p.detached
}

// letGo settles p at once unless a bulk reader is writing into its
// destination: then a goroutine of the session settles it once the reader
// stopped (abandon), which the reader's deadline bounds, not the caller's,
// and letGo reports false: dst is not the caller's to hand out. An owner
// that stalls a stream mid-transfer and answers with a FIN cannot hold the
// caller past its context that way.
func (p *pull) letGo() bool {
	pulls.Lock()
	idle := p.reading == nil
	if idle {
		delete(pulls.m, p.req)
		p.detached = true // no reader begins now: settled waits for none
	}
	pulls.Unlock()
	if !idle {
		p.abandon()
		return false
	}
	p.settled()
	return true
}

// dropBounce frees the pull's bulk lane bounce buffer, if it has one.
func (p *pull) dropBounce() {
	if b := p.bounce.Swap(nil); b != nil {
		b.Release()
	}
}

// Fetch pulls the payload d names into dst (d.Length bytes) and returns the path
// it took. It blocks until the bytes are in place, ctx ends, the transfer
// timeout passes, or the session to the owner dies. On an error it returns
// once the owner can no longer write into dst: where the owner answered
// while bytes it began to send still arrive, once they stopped (past ctx's
// end or the transfer timeout, and a grace of up to a second for bytes that
// trail the answer, the session to the owner is ended, which stops them),
// an answer for the stream path among them; where the session died before
// the owner answered, once its
// endpoints are released (up to their close's linger); or at ctx's end:
// after ctx's end, as after its timeout, a put the owner began by RDMA may
// still land, but nothing of the stream path (this process's bulk reader
// stops at its next piece, and where the owner stalls it mid-piece the
// session ends after that grace).
func Fetch(ctx context.Context, d Descriptor, dst *devicebuf.Buffer) (Path, error) {
	if uint64(dst.Len()) != d.Length {
		return PathNone, &TransferError{Token: d.Token, Kind: TransferInvalid,
			Err: fmt.Errorf("destination of %d bytes for a payload of %d", dst.Len(), d.Length)}
	}
	ctx = context.WithValue(ctx, callerDstKey{}, true)
	b, path, err := FetchNew(ctx, d, func(int) (*devicebuf.Buffer, error) { return dst.Retain(), nil })
	if err != nil {
		return path, err
	}
	defer b.Release()
	if b != dst {
		// The payload was in this process's receive space already: copy it
		// into dst once it is there (stream-ordered, it may still be
		// arriving); the release gives the range back.
		if err := b.Await(ctx); err != nil {
			return path, &TransferError{Token: d.Token, Kind: waitKind(err, TransferFailed), Err: fmt.Errorf("the payload's arrival in receive space: %w", err)}
		}
		if err := devicebuf.Copy(dst, b); err != nil {
			return path, &TransferError{Token: d.Token, Err: fmt.Errorf("copy from receive space: %w", err)}
		}
	}
	return path, nil
}

type serverRequestKey struct{}

// ForServerRequest returns ctx marking pulls made with it as a server's, of
// a request it is decoding without the call's session (a unary request,
// decoded before any interceptor runs): they then prefer the server's end of
// a connection to this very process.
func ForServerRequest(ctx context.Context) context.Context {
	return context.WithValue(ctx, serverRequestKey{}, true)
}

// FetchBytes pulls the payload d names into p (Go memory, d.Length bytes),
// as Fetch.
func FetchBytes(ctx context.Context, d Descriptor, p []byte) (Path, error) {
	dst := devicebuf.HostFromBytes(p)
	defer dst.Release()
	return Fetch(ctx, d, dst)
}

// FetchNew pulls the payload d names into a destination that alloc makes, and
// returns it with the path it took. alloc runs only once the pull may go
// ahead: a live session to the owner has room for it under Limits (or the
// owner is this process). A 0-byte payload lands in an empty host buffer
// without calling alloc. A payload already in this process's receive space
// (Descriptor.Space) is returned from there, without calling alloc.
// Otherwise as Fetch.
func FetchNew(ctx context.Context, d Descriptor, alloc func(n int) (*devicebuf.Buffer, error)) (*devicebuf.Buffer, Path, error) {
	return fetchNew(ctx, d, alloc, nil)
}

// callerDstKey marks the context of a Fetch: its destination is the
// caller's, who may reuse it as soon as Fetch returns.
type callerDstKey struct{}

func callerOwnsDst(ctx context.Context) bool {
	owns, _ := ctx.Value(callerDstKey{}).(bool)
	return owns
}

// FetchFrom is FetchNew with a receive allocator: the destination comes from
// a, and a session to a trusted owner that the pull took may set aside more
// of a's memory as receive space for the owner's later payloads
// (TransferConfig.ReceiveSpace).
func FetchFrom(ctx context.Context, d Descriptor, a devicebuf.Allocator) (*devicebuf.Buffer, Path, error) {
	return fetchNew(ctx, d, a.Alloc, a)
}

// fetchNew is FetchNew; space, if not nil, may make receive space.
func fetchNew(ctx context.Context, d Descriptor, alloc func(n int) (*devicebuf.Buffer, error), space devicebuf.Allocator) (*devicebuf.Buffer, Path, error) {
	if err := d.Validate(); err != nil {
		return nil, PathNone, &TransferError{Token: d.Token, Kind: TransferInvalid, Err: err}
	}
	arrived := transport.SessionFromContext(ctx)
	if d.Space != 0 {
		// A context without a session (a caller of this package's own, or
		// a client without the dialer's stats handler) takes the range on
		// the descriptor's word, checked against the owner it names: a
		// response written into space has no token to pull by. The codec
		// passes a call's context, whose session must be the owner's.
		if arrived != nil && arrived.PeerID() != d.Owner {
			// Only the owner writes into the space this process advertised
			// to it, and only its own messages name what it wrote there: a
			// space id that reached another peer must not let that peer
			// take the owner's payloads.
			return nil, PathNone, &TransferError{Token: d.Token, Kind: TransferInvalid,
				Err: fmt.Errorf("the descriptor names receive space %#x, written by %v, and came from %v", d.Space, d.Owner, arrived.PeerID())}
		}
		b, path, err := takeLanded(ctx, d)
		if err == nil || !errors.Is(err, errNotInSpace) {
			return b, path, err
		}
		// A request gRPC replayed: its owner holds it under its token.
		b, path, perr := fetchNew(ctx, d.withoutSpace(), alloc, space)
		var te *TransferError
		if errors.As(perr, &te) {
			te.Err = fmt.Errorf("%v; pulled by token instead: %w", err, te.Err)
		}
		return b, path, perr
	}
	var dst *devicebuf.Buffer
	allocate := func() error {
		if dst != nil {
			return nil
		}
		var err error
		if d.Length == 0 {
			dst = devicebuf.HostFromBytes(nil)
		} else if dst, err = alloc(int(d.Length)); err != nil {
			if dst = beyondPool(space, int(d.Length), err); dst == nil {
				return exhausted(d.Token, "no memory for a %d-byte payload: %w", d.Length, err)
			}
		}
		return nil
	}
	fail := func(path Path, err error) (*devicebuf.Buffer, Path, error) {
		if dst != nil {
			dst.Release()
		}
		return nil, path, err
	}
	sessions := liveSessions(d.Owner)
	if d.Owner == transport.LocalID() {
		// Both ends of a connection to this process are sessions to it: the
		// end of the side that receives first, whose pulls advertise its
		// receive space (space.go): the client's, or the server's for a
		// server's request (ForServerRequest).
		server := ctx.Value(serverRequestKey{}) != nil
		slices.SortStableFunc(sessions, func(a, b *transport.Session) int {
			return cmpBool(a.IsClient() == server, b.IsClient() == server)
		})
	}
	// payer is the session whose bounds a pull through another is charged
	// to: the one the message came over, when it names a third party's
	// payload (Limits.PullBytes).
	var payer *transport.Session
	if arrived != nil {
		// The call's own session first (a server's request, a client stream's
		// response): its engine's configuration and its peer's bounds apply.
		if i := slices.Index(sessions, arrived); i > 0 {
			copy(sessions[1:i+1], sessions[:i])
			sessions[0] = arrived
		}
		if arrived.PeerID() != d.Owner && served(arrived) {
			payer = arrived
		}
	}
	if len(sessions) == 0 {
		if d.Owner != transport.LocalID() {
			return nil, PathNone, &TransferError{Token: d.Token, Kind: TransferUnavailable,
				Err: fmt.Errorf("no live session to owner %v", d.Owner)}
		}
		made := func() (*devicebuf.Buffer, error) {
			err := allocate()
			return dst, err
		}
		if payer != nil {
			// A peer's message naming this process's own payload: its copy
			// is charged to the session the message came over, as a pull
			// through another session would be, within its timeout.
			ctx, cancel := context.WithTimeout(ctx, cfgOf(payer).Timeout)
			defer cancel()
			release, err := reservePull(ctx, payer, payer, d.Token, d.Length)
			if err != nil {
				return nil, PathNone, err
			}
			defer release()
		}
		if path, err := fetchLocal(d, made); err != nil {
			return fail(path, err)
		}
		return dst, PathLocal, nil
	}
	c := cfgOf(sessions[0])
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	start := time.Now()
	var s *transport.Session
	var path Path
	var err error
	ctx, endTask := traceTask(ctx, "gdrpc.pull")
	defer endTask()
	for _, s = range sessions {
		var release func()
		if release, err = reservePull(ctx, cmp.Or(payer, s), s, d.Token, d.Length); err != nil {
			continue // another session to the owner may have room
		}
		r := trace.StartRegion(ctx, "gdrpc.allocate")
		err = allocate()
		r.End()
		if err != nil {
			release()
			break
		}
		// A session that closes before the RTR left it never reached the owner:
		// the next one may.
		if path, err = fetchVia(ctx, s, d, dst, release); !errors.Is(err, errRTRNotSent) {
			break
		}
	}
	c.Metrics.Transfer(TransferInfo{Path: path, Bytes: int64(d.Length), Elapsed: time.Since(start), Err: err, Pull: true, Memory: kindOf(dst)})
	if err != nil {
		return fail(path, err)
	}
	if dst.Kind() == devicebuf.CUDA && path == PathRDMA {
		// An RDMA write straight into GPU memory is visible to the GPU only after a
		// flush on devices whose ordering attribute requires it.
		if err := devicebuf.FlushRDMAWrites(dst.Device()); err != nil {
			return fail(path, &TransferError{Token: d.Token, Err: fmt.Errorf("flush GPUDirect RDMA writes: %w", err)})
		}
	}
	c.Logger.Debug("out-of-band pull", "session", s.ID(), "path", path.String(), "bytes", d.Length, "elapsed", time.Since(start))
	if space != nil {
		maybeAdvertise(s, path, dst, space)
	}
	return dst, path, nil
}

// beyondPool returns Go memory for an n-byte destination that the host pool
// a refused with err because it is full, and nil otherwise. The pool is
// shared by every peer's pulls, and those of an owner that never answers
// hold theirs until the caller gives up, or until Limits.Abandoned where the
// owner could write into them: a full pool must not fail another peer's
// calls, whose destinations then come from memory outside it (unregistered:
// the pull may take a slower path). What pulls reserve is bounded all the
// same (Limits.PullBytes, TotalPullBytes). An allocator that is not a host
// pool, or another error, is left to the caller.
func beyondPool(a devicebuf.Allocator, n int, err error) *devicebuf.Buffer {
	p, ok := a.(*devicebuf.Pool)
	if !ok || p.Kind() != devicebuf.Host || !errors.Is(err, devicebuf.ErrExhausted) {
		return nil
	}
	cfg().Logger.Debug("host pool full: a destination in Go memory", "bytes", n, "err", err)
	return devicebuf.HostFromBytes(make([]byte, n))
}

// waitKind is the kind of a failed wait for a payload in receive space: a
// timeout (the owner's copy did not complete in time), the end of the caller
// or its call, or otherwise.
func waitKind(err error, otherwise TransferErrorKind) TransferErrorKind {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return TransferTimeout
	case errors.Is(err, errCallEnded), errors.Is(err, context.Canceled):
		return TransferCanceled
	}
	return otherwise
}

// takeLanded returns the payload d names in this process's receive space,
// noting the range in the Call of ctx.
func takeLanded(ctx context.Context, d Descriptor) (*devicebuf.Buffer, Path, error) {
	start := time.Now()
	dst, sp, err := fetchLanded(ctx, d, callOf(ctx))
	if err != nil {
		return nil, d.SpacePath, &TransferError{Token: d.Token, Kind: waitKind(err, TransferInvalid), Err: err}
	}
	if dst.Kind() == devicebuf.CUDA && d.SpacePath == PathRDMA {
		if err := devicebuf.FlushRDMAWrites(dst.Device()); err != nil {
			dst.Release()
			return nil, d.SpacePath, &TransferError{Token: d.Token, Err: fmt.Errorf("flush GPUDirect RDMA writes: %w", err)}
		}
	}
	cfgOf(sp.s).Metrics.Transfer(TransferInfo{Path: d.SpacePath, Bytes: int64(d.Length), Elapsed: time.Since(start), Pull: true, Memory: dst.Kind(), Advertised: true, Queued: d.SpaceEvent != 0})
	return dst, d.SpacePath, nil
}

// traceTask starts a task of the execution trace while one is being taken
// (go tool trace groups a transfer's regions under it); otherwise it costs
// nothing.
func traceTask(ctx context.Context, name string) (context.Context, func()) {
	if !trace.IsEnabled() {
		return ctx, func() {}
	}
	ctx, t := trace.NewTask(ctx, name)
	return ctx, t.End
}

// Reachable reports whether a payload owned by owner can be pulled now: a live
// session to it exists, or it is this process. Receivers ask before they
// allocate a destination for a descriptor.
func Reachable(owner transport.ID) error {
	if owner == transport.LocalID() || len(liveSessions(owner)) > 0 {
		return nil
	}
	return &TransferError{Kind: TransferUnavailable, Err: fmt.Errorf("no live session to owner %v", owner)}
}

// liveSessions returns the live sessions to owner, those over UCX first and
// those whose gRPC conn closed (lingering, about to go) last.
func liveSessions(owner transport.ID) []*transport.Session {
	var ucx, other, lingering []*transport.Session
	for _, s := range transport.SessionsTo(owner) {
		a, ok := sessions.Load(s)
		if !ok {
			continue
		}
		select {
		case <-s.Done():
			continue
		default:
		}
		switch {
		case a.(*attached).lingering.Load():
			lingering = append(lingering, s)
		case s.Endpoint() != nil:
			ucx = append(ucx, s)
		default:
			other = append(other, s)
		}
	}
	return append(append(ucx, other...), lingering...)
}

// fetchLocal serves a payload this process owns itself, with no session to
// itself: a plain copy into the destination that made makes once the token
// is known to be this process's, with the length asked (a descriptor a peer
// made up that names this process allocates nothing).
func fetchLocal(d Descriptor, made func() (*devicebuf.Buffer, error)) (Path, error) {
	e, u, st, err := box.checkout(d.Token, d.Length, nil)
	if err != nil {
		return PathNone, finError(d.Token, &fin{Status: st, Msg: err.Error()})
	}
	dst, err := made()
	if err != nil {
		box.checkin(d.Token, e, u, false)
		return PathNone, err
	}
	err = u.read(func() error { return copyFromSource(dst, e.src, nil) })
	if !box.checkin(d.Token, e, u, err == nil) && err == nil {
		err = errWithdrawn
	}
	if err != nil {
		return PathLocal, &TransferError{Token: d.Token, Err: err}
	}
	return PathLocal, nil
}

func copyFromSource(dst *devicebuf.Buffer, src Source, stream *devicebuf.Stream) error {
	b := src.Buffer
	if b == nil {
		b = devicebuf.HostFromBytes(src.Bytes)
		defer b.Release()
	}
	if stream == nil {
		return devicebuf.Copy(dst, b)
	}
	if err := devicebuf.CopyAsync(stream, dst, b); err != nil {
		return err
	}
	return stream.Synchronize()
}

// fetchVia pulls d into dst through s. release gives back the pull's
// reservation (reservePull) once dst is settled.
func fetchVia(ctx context.Context, s *transport.Session, d Descriptor, dst *devicebuf.Buffer, release func()) (path Path, err error) {
	defer busy(s)()
	p := makePull(s, dst.Retain())
	p.after = append(p.after, release)
	m := &rtr{Token: d.Token, Length: d.Length, Offers: PathStream}
	r := trace.StartRegion(ctx, "gdrpc.offer")
	staging, err := offerDestination(s, d, p, m)
	r.End()
	if err != nil {
		p.settled()
		return PathNone, &TransferError{Token: d.Token, Err: err}
	}
	var staged *stagedCopier
	if staging != nil && m.Offers&PathRDMA != 0 {
		m.Offers |= PathStaged
		staged = newStagedCopier(dst, staging, p)
		defer staged.stop()
		p.after = append(p.after, staged.stop) // runs before staging goes back
	}
	p.list()
	m.Req = p.req
	p.offers = m.Offers
	// Every exit from here lets go of p once, by letGo unless a branch says
	// otherwise: a pull that succeeded but whose destination a bulk reader
	// still writes into fails. A destination the caller gave (Fetch) is the
	// caller's again as soon as Fetch returns, to reuse as it likes: where
	// the owner answered while a bulk reader still writes into it (a frame
	// or stream it stalled, then a FIN), Fetch returns once the reader
	// stopped. The reader's deadline runs from the frame's or stream's
	// start, which the owner chooses: at the end of ctx the session ends,
	// which stops the reader.
	letGo := p.letGo
	gaveUp := false
	defer func() {
		if letGo() {
			return
		}
		if err == nil {
			err = &TransferError{Token: d.Token, Kind: TransferInvalid,
				Err: fmt.Errorf("bulk data still arriving for a transfer the owner answered by %v", path)}
		}
		if !callerOwnsDst(ctx) {
			return
		}
		done := p.released
		if gaveUp {
			// Unanswered: the owner may write into dst by RDMA until it
			// answers (Fetch's contract), but this process's own bulk
			// reader writes no more once Fetch returned. It stops at its
			// next piece; one the owner stalls mid-piece ends with the
			// session, after the grace.
			if done = p.stopReads(); done == nil {
				return
			}
		} else {
			select {
			case <-done:
				return
			case <-ctx.Done():
			}
		}
		// An honest owner's last bytes may trail its FIN (the FIN on the
		// control stream, the bytes on the bulk lane) or the caller's end:
		// a grace before the session ends.
		grace := time.NewTimer(finGrace(cfgOf(s).Timeout))
		defer grace.Stop()
		select {
		case <-done:
		case <-grace.C:
			abort(s, fmt.Errorf("%w: %w", transport.ErrPeerGone, errOwnerStalled))
			<-done
		}
	}()
	// The caller gave up: the pull settles on a goroutine of the session.
	giveUp := func() bool { gaveUp = true; p.abandon(); return false }
	// Nothing more is read into dst, and the read under way ends now (the
	// session died, or the reader handed dst over): settled waits for it.
	// Where the session died before the owner answered, a put it began may
	// still land in dst until the session's endpoints are released and
	// dst's registration undone (settled waits for both on a goroutine):
	// a dst the caller gave (Fetch) is the caller's again only then, or at
	// the end of the caller's context, as when it gives up. A dst the pull
	// made, or one behind staging, is the pull's until then anyway.
	settleNow := func() bool {
		p.settled()
		if p.exposed() && staging == nil && callerOwnsDst(ctx) {
			select {
			case <-p.released:
			case <-ctx.Done():
			}
		}
		return true
	}

	r = trace.StartRegion(ctx, "gdrpc.rtr")
	err = sendControl(ctx, s, ctlRTR, m.marshal())
	r.End()
	if err != nil {
		if !errors.Is(err, transport.ErrNoLaneTurn) {
			// The write failed, and the session with it, but the RTR may
			// have reached the owner all the same, which may then write
			// into dst: as when the session dies after the RTR went, no
			// other session gets dst, and a dst the caller gave is the
			// caller's again only once this session can write no more.
			letGo = settleNow
		} else if ctx.Err() == nil {
			select {
			case <-s.Done():
				return PathNone, fmt.Errorf("%w: %w", errRTRNotSent, sessionError(d.Token, s, ctx, err))
			default:
			}
		}
		return PathNone, sessionError(d.Token, s, ctx, err)
	}
	var f *fin
	var ended error // the pull's context or session ended first
	r = trace.StartRegion(ctx, "gdrpc.wait-fin")
	select {
	case f = <-p.fin:
		p.answered = true
	case <-ctx.Done():
		letGo, ended = giveUp, ctx.Err()
	case <-s.Done():
		letGo, ended = settleNow, s.Err()
	}
	// Ended before any return: a trace reader refuses a goroutine's
	// regions that end out of order.
	r.End()
	if ended != nil {
		return PathNone, sessionError(d.Token, s, ctx, ended)
	}
	if f.Status != finOK {
		return f.Path, finError(d.Token, f)
	}
	if err := checkFINPath(m, f.Path); err != nil {
		return f.Path, &TransferError{Token: d.Token, Kind: TransferInvalid, Err: err}
	}
	if f.Path == PathStream {
		select {
		case err = <-p.bulk:
		case <-ctx.Done():
			// The owner answered: the reader writing into dst is its
			// stream's or frame's, which it may hold until its own
			// deadline. letGo stays p.letGo, so that a dst the caller gave
			// is the caller's again only once that reader stopped (the
			// deferred wait above ends the session after a grace).
			return f.Path, sessionError(d.Token, s, ctx, ctx.Err())
		case <-s.Done():
			letGo = settleNow
			return f.Path, sessionError(d.Token, s, ctx, s.Err())
		}
		if err != nil {
			return f.Path, &TransferError{Token: d.Token, Err: fmt.Errorf("bulk stream: %w", err)}
		}
		letGo = settleNow
	}
	if staged != nil && f.Path == PathStaged {
		// The chunks' copies to the GPU started as they landed; wait for the last.
		if err := staged.wait(ctx, s); err != nil {
			if ctx.Err() != nil {
				letGo = giveUp
			}
			return f.Path, &TransferError{Token: d.Token, Err: fmt.Errorf("copy from staging: %w", err)}
		}
	} else if staging != nil && (f.Path == PathRDMA || f.Path == PathStaged) {
		// The owner wrote into host staging in one piece: move it to the GPU.
		if err := devicebuf.Copy(dst, staging); err != nil {
			return f.Path, &TransferError{Token: d.Token, Err: fmt.Errorf("copy from staging: %w", err)}
		}
		return PathStaged, nil // staged on this side, whatever the owner's source was
	}
	return f.Path, nil
}

// offerDestination fills m with the destinations this receiver accepts for dst.
// It returns a host staging buffer when the bytes land there first (GPU
// destinations that UCX cannot write into).
func offerDestination(s *transport.Session, d Descriptor, p *pull, m *rtr) (*devicebuf.Buffer, error) {
	allowed := cfgOf(s).Paths
	// A trusted owner writes what its FIN says it wrote: the destination needs
	// no clearing (on one GPU a clear costs a switch between the two
	// processes' contexts, more than a 1 MiB copy; see the README).
	cleared := s.TrustsPeer() // p.dst
	ep, rc := s.Endpoint(), s.RDMAContext()
	if dst := p.dst; ipcAllowed(s) && allowed&PathCUDAIPC != 0 && dst.Kind() == devicebuf.CUDA && d.HostID == transport.LocalHostID() && d.Kind == devicebuf.CUDA &&
		!ucxSameDevice(d, dst, ep, rc, allowed) {
		h, off, err := devicebuf.ExportIPC(dst)
		if err == nil && !cleared {
			err = clearDestination(dst)
			cleared = err == nil
		}
		if err == nil {
			m.Offers |= PathCUDAIPC
			m.IPC, m.IPCOffset, m.IPCDevice = h, uint64(off), dst.DeviceUUID()
		} else {
			cfgOf(s).Metrics.Fallback(PathCUDAIPC, PathRDMA, "export IPC handle: "+err.Error())
		}
	}
	if ep == nil || rc == nil || d.Length == 0 || allowed&PathRDMA == 0 {
		return nil, nil
	}
	if streamFirst(s, d.Length, d.Kind == devicebuf.Host && p.dst.Kind() == devicebuf.Host) {
		// Between hosts, puts over this UCX's tcp transport are slower than
		// the stream path there.
		return nil, nil
	}
	if m.Offers&PathCUDAIPC != 0 {
		// With CUDA IPC on offer the owner will not need a UCX destination: it
		// copies device to device itself (faster than UCX's cuda_ipc lane), and
		// falls back to the stream if IPC fails. A registration, or host staging
		// for a UCX without CUDA, would cost this pull for nothing.
		return nil, nil
	}
	target := p.dst
	var staging *devicebuf.Buffer
	if target.Kind() == devicebuf.CUDA && !gpuDirect(rc, ep) {
		b, err := HostPool(rc).Alloc(int(d.Length))
		if err != nil {
			cfgOf(s).Metrics.Fallback(PathRDMA, PathStream, "no host staging: "+err.Error())
			return nil, nil
		}
		staging = b
		p.after = append(p.after, func() { b.Release() })
		target = b
	}
	if (target != p.dst && !s.TrustsPeer()) || !cleared {
		if err := clearDestination(target); err != nil {
			cfgOf(s).Metrics.Fallback(PathRDMA, PathStream, "clear destination: "+err.Error())
			return staging, nil
		}
	}
	r := trace.StartRegion(context.Background(), "gdrpc.expose")
	mem, off, release, err := exposeDestination(rc, target, s.TrustsPeer())
	r.End()
	if err != nil {
		cfgOf(s).Metrics.Fallback(PathRDMA, PathStream, "register destination: "+err.Error())
		return staging, nil
	}
	p.after = append(p.after, release)
	key, err := packedKey(mem)
	if err != nil {
		cfgOf(s).Metrics.Fallback(PathRDMA, PathStream, "pack key: "+err.Error())
		return staging, nil
	}
	m.Offers |= PathRDMA
	m.RAddr = uint64(mem.Addr()) + uint64(off)
	m.RKey = key
	if mem.Type() == rdma.MemoryCUDA {
		m.RMemory = 1
	}
	return staging, nil
}

// ucxSameDevice reports whether a GPU payload on dst's own device should go
// through UCX rather than gdrpc's cuda-ipc: UCX moves GPU memory on ep itself
// (its cuda_ipc lane), which keeps its mappings of the peer's memory, while
// cuda-ipc opens and closes one per transfer: UCX's lane is the faster on one
// device. Between two GPUs cuda-ipc stays first: UCX's lane moved a fraction
// of it there (the README's performance table).
func ucxSameDevice(d Descriptor, dst *devicebuf.Buffer, ep *rdma.Endpoint, rc *rdma.Context, allowed Path) bool {
	return allowed&PathRDMA != 0 && ep != nil && rc != nil && d.DeviceUUID != "" &&
		d.DeviceUUID == dst.DeviceUUID() && gpuDirect(rc, ep)
}

func sessionError(t Token, s *transport.Session, ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		return &TransferError{Token: t, Kind: TransferTimeout, Err: fmt.Errorf("no answer from the owner in time: %w", ctx.Err())}
	case ctx.Err() != nil:
		return &TransferError{Token: t, Kind: TransferCanceled, Err: ctx.Err()}
	}
	if se := s.Err(); se != nil {
		err = se
	}
	return &TransferError{Token: t, Kind: TransferUnavailable, Err: fmt.Errorf("session to the owner died: %w", err)}
}

func finError(t Token, f *fin) error {
	k := TransferFailed
	switch f.Status {
	case finUnknownToken:
		k = TransferNotFound
	case finBadLength:
		k = TransferInvalid
	case finBusy:
		k = TransferExhausted
	}
	return &TransferError{Token: t, Kind: k, Err: fmt.Errorf("owner refused: %s", f.Msg)}
}

func handleFIN(s *transport.Session, payload []byte) {
	trace.Log(context.Background(), "gdrpc", "fin-received")
	f, err := parseFIN(payload)
	if err != nil {
		dropControl(s, err)
		return
	}
	pulls.Lock()
	p := pulls.m[f.Req]
	pulls.Unlock()
	if p == nil || p.s != s {
		return
	}
	select {
	case p.fin <- f:
	default:
	}
}

func handleChunk(s *transport.Session, payload []byte) {
	req, off, n, err := parseRangeNotice(payload, "chunk notice")
	if err != nil {
		dropControl(s, err)
		return
	}
	pulls.Lock()
	p := pulls.m[req]
	pulls.Unlock()
	if p == nil || p.s != s || p.chunks == nil {
		return
	}
	select {
	case p.chunks <- [2]uint64{off, n}:
	case <-p.chunksGone:
	case <-s.Done():
	}
}

// stagedCopier copies staged chunks to their GPU destination as their notices
// arrive, overlapping the owner's next puts.
type stagedCopier struct {
	done     chan error // the copier's outcome once every byte was copied
	quit     chan struct{}
	exited   chan struct{}
	stopOnce sync.Once
}

func newStagedCopier(dst, staging *devicebuf.Buffer, p *pull) *stagedCopier {
	c := &stagedCopier{done: make(chan error, 1), quit: make(chan struct{}), exited: make(chan struct{})}
	p.chunks = make(chan [2]uint64, 64)
	p.chunksGone = c.exited
	total := uint64(dst.Len())
	go func() {
		defer close(c.exited)
		var copied uint64
		landed := newChunkCoverage(total)
		for copied < total {
			var ch [2]uint64
			select {
			case ch = <-p.chunks:
			case <-c.quit:
				return
			}
			off, n := ch[0], ch[1]
			if err := landed.add(off, n); err != nil {
				c.done <- err
				return
			}
			if err := copyRange(dst, int(off), staging, int(off), int(n)); err != nil {
				c.done <- err
				return
			}
			copied += n
		}
		c.done <- nil
	}()
	return c
}

func (c *stagedCopier) wait(ctx context.Context, s *transport.Session) error {
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-s.Done():
		return s.Err()
	}
}

// stop ends the copier and waits for it: no copy runs afterwards.
func (c *stagedCopier) stop() {
	c.stopOnce.Do(func() { close(c.quit) })
	<-c.exited
}

// serveBulk receives a stream-path payload on a bulk stream the owner opened:
// a bulk header (request id, length) and the bytes.
func serveBulk(s *transport.Session, c net.Conn) {
	defer c.Close()
	timeout := cfgOf(s).Timeout
	c.SetReadDeadline(time.Now().Add(timeout))
	var hdr [bulkHeaderLen]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		endBulk(s, c, timeout, err)
		return
	}
	req, n, err := parseBulkHeader(hdr[:])
	if err != nil {
		abort(s, fmt.Errorf("%w: bulk stream: %w", transport.ErrPeerGone, err))
		return
	}
	grace := timeout
	if p := claimFor(s, req, n); p != nil {
		err := readInto(c, p, cfgOf(s).StagingChunk)
		p.bulk <- err
		endRead(p)
		if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
			// The owner's push began before this stream and ends at its own
			// timeout, so an honest owner closes the stream moments after
			// this deadline; one that keeps it open past a short grace
			// stalled it on purpose, and the session ends, not a transfer
			// timeout later.
			grace = finGrace(timeout)
		}
	}
	endBulk(s, c, grace, nil)
}

// finGrace is how long an owner's bytes that trail what ended a transfer
// for this side (its FIN, or the end of its push's time) may still come
// before the session ends, for a transfer timeout of timeout.
func finGrace(timeout time.Duration) time.Duration { return min(timeout/4, time.Second) }

// endBulk waits for the owner to close a bulk stream, reading what it still
// sends into nothing (a pull given up, a stream cut short): the multiplexer
// keeps what arrives on a stream closed on this side only, up to its
// window, so the stream is closed once the owner closed it. An owner that
// keeps it open past the transfer timeout breaks the protocol (its own push
// ends by then) and ends the session. err is the read that ended the
// stream's use, if one failed: a stream the owner closed or broke is over.
func endBulk(s *transport.Session, c net.Conn, timeout time.Duration, err error) {
	if err == nil {
		c.SetReadDeadline(time.Now().Add(timeout))
		_, err = io.Copy(io.Discard, c)
		if err == nil {
			return // the owner closed it
		}
	}
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		abort(s, fmt.Errorf("%w: a bulk stream left open past the transfer timeout", transport.ErrPeerGone))
	}
}

// claimFor claims the pull req names for n bytes (claimBulk): nil when there
// is no live pull, or when its destination does not hold n bytes, which fails
// the pull.
func claimFor(s *transport.Session, req, n uint64) *pull {
	p := claimBulk(s, req)
	if p != nil && uint64(p.dst.Len()) != n {
		p.bulk <- fmt.Errorf("bulk data announces %d bytes, destination holds %d", n, p.dst.Len())
		endRead(p)
		return nil
	}
	return p
}

// claimBulk returns the pull req names, claimed by the caller and marked as
// being read into (endRead when done), or nil when no live pull of s may be
// read into.
func claimBulk(s *transport.Session, req uint64) *pull {
	pulls.Lock()
	defer pulls.Unlock()
	p := pulls.m[req]
	if p == nil || p.s != s || p.detached || p.claimed {
		return nil
	}
	p.claimed = true
	p.reading = make(chan struct{})
	return p
}

// beginRead marks the claimed pull p as being read into again (endRead when
// done); false when p was settled meanwhile: dst is no longer the reader's.
func beginRead(p *pull) bool {
	pulls.Lock()
	defer pulls.Unlock()
	if p.detached {
		return false
	}
	if p.reading == nil {
		p.reading = make(chan struct{})
	}
	return true
}

// endRead ends a read into p's destination (no-op when none is under way).
func endRead(p *pull) {
	pulls.Lock()
	defer pulls.Unlock()
	if p.reading != nil {
		close(p.reading)
		p.reading = nil
	}
}

// serveBulkLane reads the frames of one of a session's frame lanes (its bulk
// lane, or its wide lane: the transport names which when it ends the
// session) until it fails,
// putting each piece into the destination of the pull it names. It returns
// the error that broke the lane (nil when the session closed it); transfers
// still open then fail.
func serveBulkLane(s *transport.Session, c net.Conn) (err error) {
	open := map[uint64]*laneXfer{}
	defer func() {
		for _, x := range open {
			x.fail(fmt.Errorf("lane closed mid-transfer: %w", cmp.Or(err, net.ErrClosed)))
		}
	}()
	hdr := make([]byte, laneFrameLen)
	for {
		_ = c.SetReadDeadline(time.Time{}) // an idle lane waits for the next frame as long as the session lives
		if _, err := io.ReadFull(c, hdr); err != nil {
			select {
			case <-s.Done():
				return nil
			default:
				return err
			}
		}
		f, err := parseLaneFrame(hdr)
		if err != nil {
			return err
		}
		x := open[f.req]
		switch {
		case x == nil && f.off != 0:
			return fmt.Errorf("piece at %d of transfer %d, which has not begun", f.off, f.req)
		case x == nil && len(open) == maxLaneTransfers:
			return fmt.Errorf("more than %d transfers open", maxLaneTransfers)
		case x == nil:
			x = newLaneXfer(s, f)
			open[f.req] = x
		case f.total != x.total || f.off != x.got:
			return fmt.Errorf("piece [%d, +%d) of %d bytes for transfer %d, which is at %d of %d",
				f.off, f.n, f.total, f.req, x.got, x.total)
		}
		if f.kind == laneAbort {
			x.fail(errors.New("the owner gave the transfer up"))
			delete(open, f.req)
			continue
		}
		// A frame, once begun, comes whole unless the owner stalls.
		_ = c.SetReadDeadline(time.Now().Add(cfgOf(s).Timeout))
		if err := x.frame(c, int(f.n)); err != nil {
			return err
		}
		if x.got == x.total {
			x.done()
			delete(open, f.req)
		}
	}
}

// maxLaneTransfers bounds the transfers open at once on a frame lane's reader
// (a session has at most two lanes, its bulk lane and a wide lane): a peer
// that opens more breaks the lane.
const maxLaneTransfers = 4096

// laneXfer is a transfer under way on a frame lane, on the reader's side. The
// reader holds the pull's destination only while it reads a frame into it
// (beginRead, endRead): a pull settled between two frames waits for nothing,
// and the transfer's later frames are dropped.
type laneXfer struct {
	p     *pull // nil: the transfer's pieces are read and dropped
	total uint64
	got   uint64
	// GPU destinations: pieces gather in a host bounce buffer (the pull's),
	// copied on to the GPU when full and at the end. held bytes of it wait,
	// from got-held.
	held int
}

// newLaneXfer starts the transfer f begins: into the pull it names (claimFor),
// or into nothing.
func newLaneXfer(s *transport.Session, f laneFrame) *laneXfer {
	return &laneXfer{total: f.total, p: claimFor(s, f.req, f.total)}
}

// frame reads the next n bytes of the transfer from r.
func (x *laneXfer) frame(r io.Reader, n int) error {
	if x.p != nil && !beginRead(x.p) {
		x.release() // given up: the puller has gone
	}
	err := x.read(r, n)
	if x.p != nil {
		endRead(x.p)
	}
	return err
}

// read takes the next n bytes of the transfer from r. Only an error of r is
// returned; a failed copy to the GPU fails the pull and drops the rest.
func (x *laneXfer) read(r io.Reader, n int) error {
	off := x.got
	x.got += uint64(n)
	// drop fails the pull with err and reads the rest of the frame into nothing.
	drop := func(err error) error {
		x.fail(err)
		_, err = io.CopyN(io.Discard, r, int64(n))
		return err
	}
	if x.p == nil {
		return drop(nil)
	}
	dst := x.p.dst
	if dst.Kind() == devicebuf.Host {
		b, err := dst.HostBytes()
		if err != nil {
			return drop(err)
		}
		_, err = io.ReadFull(r, b[off:x.got])
		return err
	}
	bounce := x.p.bounce.Load() // only this reader sets it while the pull lives
	if bounce == nil {
		var err error
		if bounce, err = devicebuf.NewHostAllocator().Alloc(int(min(uint64(cfgOf(x.p.s).StagingChunk), x.total))); err != nil {
			return drop(err)
		}
		x.p.bounce.Store(bounce)
	}
	hb, _ := bounce.HostBytes()
	for n > 0 {
		k := min(n, len(hb)-x.held)
		if _, err := io.ReadFull(r, hb[x.held:x.held+k]); err != nil {
			return err
		}
		x.held += k
		n -= k
		if x.held == len(hb) || (n == 0 && x.got == x.total) {
			if err := copyRange(dst, int(x.got)-n-x.held, bounce, 0, x.held); err != nil {
				return drop(fmt.Errorf("copy to the GPU: %w", err))
			}
			x.held = 0
		}
	}
	return nil
}

// done hands the pull its bytes.
func (x *laneXfer) done() {
	if x.p != nil {
		x.p.bulk <- nil
		x.release()
	}
}

// fail hands the pull err; the transfer's remaining pieces are dropped.
func (x *laneXfer) fail(err error) {
	if x.p != nil {
		x.p.bulk <- err
		x.release()
	}
}

// release lets go of the pull: the transfer's remaining pieces are dropped.
func (x *laneXfer) release() {
	endRead(x.p)
	x.p.dropBounce()
	x.p = nil
}

// readInto fills dst from r; device memory goes through a host bounce buffer.
func readInto(r io.Reader, p *pull, chunk int) error {
	dst := p.dst
	if dst.Kind() == devicebuf.Host {
		b, err := dst.HostBytes()
		if err != nil {
			return err
		}
		for off := 0; off < len(b); {
			if !p.wanted() {
				return errPullGivenUp
			}
			k := min(len(b)-off, readPiece)
			if _, err := io.ReadFull(r, b[off:off+k]); err != nil {
				return err
			}
			off += k
		}
		return nil
	}
	return chunked(nil, dst.Len(), chunk, func(bounce *devicebuf.Buffer, off, n int) error {
		hb, _ := bounce.HostBytes()
		if _, err := io.ReadFull(r, hb[:n]); err != nil {
			return err
		}
		if !p.wanted() {
			return errPullGivenUp
		}
		return copyRange(dst, off, bounce, 0, n)
	})
}

// readPiece is how much of a stream-path payload a bulk reader reads into
// host memory before it looks again whether the pull still wants it: a
// caller that gave up waits for one piece at most.
const readPiece = 1 << 20

// errPullGivenUp ends a bulk read whose pull was given up: the rest of the
// stream goes into nothing.
var errPullGivenUp = errors.New("the pull was given up")

// ---- owner side ----------------------------------------------------------------

// serveRTR answers one receiver's request for an outbox entry, on one of the
// session's pushers (queueRTR). c is the configuration of the engine that
// serves s, resolved once: the session may close, and leave the engine's map,
// while the push runs.
func serveRTR(s *transport.Session, m *rtr, c *TransferConfig) {
	ctx, cancel := context.WithTimeout(sessionContext(s), c.Timeout)
	defer cancel()
	ctx, endTask := traceTask(ctx, "gdrpc.push")
	defer endTask()
	f := &fin{Req: m.Req}
	// The push's own context: the entry's leaving cancels it, not the FIN's.
	pctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	e, u, st, err := box.checkout(m.Token, m.Length, stop)
	if err != nil {
		f.Status, f.Msg = st, err.Error()
	} else {
		// Only a push of a payload the outbox holds keeps a lingering
		// session up: an RTR for any token would.
		defer busy(s)()
		start := time.Now()
		f.Path, err = push(pctx, s, m, e.src, u, c)
		if !box.checkin(m.Token, e, u, err == nil) {
			if err == nil || errors.Is(context.Cause(pctx), errWithdrawn) {
				// Cut short, or read in part after the entry left: the
				// receiver must not take what it got.
				err = errWithdrawn
			}
		}
		c.Metrics.Transfer(TransferInfo{Path: f.Path, Bytes: int64(m.Length), Elapsed: time.Since(start), Err: err, Memory: e.src.kind()})
		c.Logger.Debug("out-of-band push", "session", s.ID(), "path", f.Path.String(), "bytes", m.Length, "elapsed", time.Since(start), "err", err)
		if err != nil {
			f.Status, f.Msg = finFailed, err.Error()
		}
	}
	if f.Path == PathStaged && m.Offers&PathStaged == 0 {
		// The staging was this side's alone: the receiver, which offered no
		// chunk-by-chunk copy, got puts into its destination.
		f.Path = PathRDMA
	}
	r := trace.StartRegion(ctx, "gdrpc.fin")
	if err := sendControl(ctx, s, ctlFIN, f.marshal()); err != nil {
		c.Logger.Debug("FIN not sent", "session", s.ID(), "err", err)
	}
	r.End()
}

// push moves src into the receiver's destination by the best path both
// accept, reading src only through u.
func push(ctx context.Context, s *transport.Session, m *rtr, src Source, u *sourceUse, c *TransferConfig) (Path, error) {
	if m.Length == 0 {
		return PathNone, nil
	}
	allowed := c.Paths
	if m.Offers&allowed&PathCUDAIPC != 0 && ipcAllowed(s) {
		err := u.read(func() error { return pushIPC(s, m, src) })
		if err == nil || errors.Is(err, errWithdrawn) {
			return PathCUDAIPC, err
		}
		c.Metrics.Fallback(PathCUDAIPC, PathRDMA, err.Error())
	}
	if m.Offers&allowed&PathRDMA != 0 {
		if ep := s.Endpoint(); ep != nil {
			var path Path
			err := u.read(func() (err error) {
				path, err = pushRDMA(ctx, s, ep, m, src)
				return err
			})
			if err == nil || ctx.Err() != nil || errors.Is(err, errWithdrawn) {
				return path, err
			}
			c.Metrics.Fallback(PathRDMA, PathStream, err.Error())
		}
	}
	return PathStream, pushStream(ctx, s, m, src, u)
}

func pushIPC(s *transport.Session, m *rtr, src Source) error {
	if err := foreignIPC(s, m.IPC); err != nil {
		return err
	}
	r := trace.StartRegion(context.Background(), "gdrpc.ipc-open")
	remote, err := openIPC(m)
	r.End()
	if err != nil {
		return err
	}
	defer func() {
		r := trace.StartRegion(context.Background(), "gdrpc.ipc-close")
		remote.Release()
		r.End()
	}()
	return copyIntoIPC(remote, m, src, nil)
}

// foreignIPC refuses a receiver's IPC handle that names this process's own
// memory: a peer that echoes a handle this process exported would have the
// owner write into its own memory.
func foreignIPC(s *transport.Session, h devicebuf.IPCHandle) error {
	if s.PeerID() != transport.LocalID() && devicebuf.OwnIPC(h) {
		return errors.New("the receiver's IPC handle names this process's own memory")
	}
	return nil
}

// copyIntoIPC copies src where m says in remote, the receiver's allocation
// opened through its IPC handle, once m's range lies inside it, and waits for
// the copy: on stream, after the copies queued there, or alone when nil.
func copyIntoIPC(remote *devicebuf.Buffer, m *rtr, src Source, stream *devicebuf.Stream) error {
	dst, err := ipcDestination(remote, m)
	if err != nil {
		return err
	}
	defer dst.Release()
	defer trace.StartRegion(context.Background(), "gdrpc.ipc-copy").End()
	return copyFromSource(dst, src, stream)
}

// ipcDestination is the range of remote, an opened allocation, that m names.
func ipcDestination(remote *devicebuf.Buffer, m *rtr) (*devicebuf.Buffer, error) {
	if m.IPCOffset > uint64(remote.Len()) || m.Length > uint64(remote.Len())-m.IPCOffset {
		return nil, fmt.Errorf("IPC destination outside its allocation: [%d, +%d) of %d bytes", m.IPCOffset, m.Length, remote.Len())
	}
	return remote.Slice(int(m.IPCOffset), int(m.Length))
}

// Unpacked keys of a receiver's registered regions, kept per session:
// unpacking a shared-memory key attaches the receiver's segment, and the
// first put into it faults every page in. Receivers that trust their peers
// reuse their registered pool regions and send the same packed key again. The
// keys go when the session closes, the least recently used when there are too
// many, each once no push uses it.
const maxRemoteKeys = 256

type cachedKey struct {
	packed string
	k      *rdma.RemoteKey
	refs   int  // pushes using it; guarded by keysBySession
	dead   bool // evicted: close at refs == 0
}

type remoteKeys struct {
	lru  []*cachedKey // least recently used first
	keys map[string]*cachedKey
}

var keysBySession = struct {
	sync.Mutex
	m map[*transport.Session]*remoteKeys
}{m: map[*transport.Session]*remoteKeys{}}

// peerInProcess reports whether s's other end is in this process, whose keys
// name this process's memory by right (Session.PeerInProcess; tests take
// another process's place through it).
var peerInProcess = (*transport.Session).PeerInProcess

// remoteKey returns the unpacked key for packed and the function that ends its
// use by the caller. Unpacking is a round trip to the endpoint's worker: it
// runs outside keysBySession's lock, so that a busy worker stalls only its own
// pushes.
func remoteKey(s *transport.Session, ep *rdma.Endpoint, packed []byte) (*rdma.RemoteKey, func(), error) {
	keysBySession.Lock()
	ck := keysBySession.m[s].lookup(packed)
	if ck != nil {
		ck.refs++
		keysBySession.Unlock()
		return ck.k, ck.done, nil
	}
	keysBySession.Unlock()
	select {
	case <-s.Done():
		return nil, nil, closedErr(s)
	default:
	}
	unpack := ep.UnpackForeignKey // a trusted peer's key, too, names its own memory only
	if peerInProcess(s) {
		unpack = ep.UnpackKey // both ends' memory is this process's
	}
	k, err := unpack(packed)
	if err != nil {
		return nil, nil, err
	}
	var unused *rdma.RemoteKey // closed once the lock is released
	keysBySession.Lock()
	defer func() {
		keysBySession.Unlock()
		if unused != nil {
			unused.Close()
		}
	}()
	select {
	case <-s.Done(): // dropRemoteKeys ran or runs: cache nothing
		unused = k
		return nil, nil, closedErr(s)
	default:
	}
	c := keysBySession.m[s]
	if c == nil {
		c = &remoteKeys{keys: map[string]*cachedKey{}}
		keysBySession.m[s] = c
	}
	if ck = c.lookup(packed); ck != nil { // unpacked concurrently: keep one
		unused = k
	} else {
		ck = &cachedKey{packed: string(packed), k: k}
		c.keys[ck.packed] = ck
		c.lru = append(c.lru, ck)
		if len(c.lru) > maxRemoteKeys {
			old := c.lru[0]
			c.lru = c.lru[1:]
			delete(c.keys, old.packed)
			old.dead = true
			if old.refs == 0 {
				unused = old.k
			}
		}
	}
	ck.refs++
	return ck.k, ck.done, nil
}

// done ends one caller's use of ck.
func (ck *cachedKey) done() {
	keysBySession.Lock()
	ck.refs--
	last := ck.dead && ck.refs == 0
	keysBySession.Unlock()
	if last {
		ck.k.Close()
	}
}

// lookup finds packed and marks it most recently used.
func (c *remoteKeys) lookup(packed []byte) *cachedKey {
	if c == nil {
		return nil
	}
	ck := c.keys[string(packed)]
	if ck != nil {
		if i := slices.Index(c.lru, ck); i >= 0 && i != len(c.lru)-1 {
			c.lru = append(append(c.lru[:i:i], c.lru[i+1:]...), ck)
		}
	}
	return ck
}

func dropRemoteKeys(s *transport.Session) {
	var unused []*rdma.RemoteKey
	keysBySession.Lock()
	if c := keysBySession.m[s]; c != nil {
		for _, ck := range c.lru {
			ck.dead = true
			if ck.refs == 0 {
				unused = append(unused, ck.k)
			}
		}
	}
	delete(keysBySession.m, s)
	keysBySession.Unlock()
	for _, k := range unused {
		k.Close()
	}
}

// openIPC maps the receiver's allocation named by m's handle for one transfer and
// returns it with a reference for the caller, whose release closes the mapping
// (concurrent transfers into one allocation share it). No mapping outlives its
// transfer: the receiver frees or recycles the destination once the transfer ends
// (its pools free idle regions), and CUDA leaves freeing an allocation that another
// process still has open undefined; in this process, a kept mapping would keep the
// receiver's allocation itself alive.
func openIPC(m *rtr) (*devicebuf.Buffer, error) {
	dev, err := deviceOrdinal(m.IPCDevice)
	if err != nil {
		return nil, err
	}
	return devicebuf.OpenIPC(m.IPC, dev)
}

func pushRDMA(ctx context.Context, s *transport.Session, ep *rdma.Endpoint, m *rtr, src Source) (path Path, err error) {
	if err := checkKeyDomains(ep, m.RKey, s.TrustsPeer()); err != nil {
		return PathRDMA, err
	}
	r := trace.StartRegion(ctx, "gdrpc.rkey")
	key, done, err := remoteKey(s, ep, m.RKey)
	r.End()
	if err != nil {
		return PathRDMA, fmt.Errorf("unpack the receiver's key: %w", err)
	}
	defer done()
	if err := checkDomains(key.Domains(), s.TrustsPeer()); err != nil {
		return PathRDMA, err
	}
	defer func() {
		if err != nil {
			settleWrites(s, ep) // before the key goes and before any FIN(failed)
		}
	}()
	path = PathRDMA
	// direct: the puts went as copies of this process's into the
	// receiver's segment, in place when they returned (no flush).
	direct := key.Direct()
	switch b := src.Buffer; {
	case b == nil:
		err = ep.PutBytes(ctx, src.Bytes, m.RAddr, key)
	case b.Kind() == devicebuf.Host && key.Direct():
		// A copy into the receiver's segment: the source needs no
		// registration.
		if err = b.Wait(); err != nil {
			return path, err
		}
		var hb []byte
		if hb, err = b.HostBytes(); err != nil {
			return path, err
		}
		r = trace.StartRegion(ctx, "gdrpc.put")
		err = ep.PutBytes(ctx, hb, m.RAddr, key)
		r.End()
	case b.Kind() == devicebuf.Host || gpuDirect(s.RDMAContext(), ep):
		// UCX reads GPU memory itself, outside any stream: a buffer whose
		// bytes are still arriving (received stream-ordered and sent on)
		// is waited for first. A host source with a direct key took the
		// case above: this is a UCX put, which a flush completes.
		direct = false
		if err = b.Wait(); err != nil {
			return path, err
		}
		var mem *rdma.Memory
		var off int
		var release func()
		r := trace.StartRegion(ctx, "gdrpc.register")
		mem, off, release, err = registered(s.RDMAContext(), b)
		r.End()
		if err != nil {
			return path, err
		}
		r = trace.StartRegion(ctx, "gdrpc.put")
		err = ep.Put(ctx, mem, off, b.Len(), m.RAddr, key)
		r.End()
		release()
	default:
		path = PathStaged
		err = pushStaged(ctx, s, ep, m, b, key)
	}
	if err != nil || direct {
		return path, err
	}
	defer trace.StartRegion(ctx, "gdrpc.flush").End()
	if err := ep.Flush(ctx); err != nil {
		return path, fmt.Errorf("flush: %w", err)
	}
	return path, nil
}

// pushStaged moves GPU memory that UCX cannot register: chunks are copied device
// to registered host staging while the previous chunk is being put, two
// staging buffers in flight.
func pushStaged(ctx context.Context, s *transport.Session, ep *rdma.Endpoint, m *rtr, src *devicebuf.Buffer, key *rdma.RemoteKey) error {
	chunk := min(roundUp(cfgOf(s).StagingChunk, stagedGrain), src.Len())
	pool := HostPool(s.RDMAContext())
	var bufs [2]*devicebuf.Buffer
	for i := range bufs {
		b, err := pool.Alloc(chunk)
		if err != nil {
			for _, o := range bufs[:i] {
				o.Release()
			}
			return fmt.Errorf("staging buffer: %w", err)
		}
		bufs[i] = b
	}
	defer func() {
		for _, b := range bufs {
			b.Release()
		}
	}()
	type filled struct {
		slot, off, n int
		err          error
	}
	ready := make(chan filled, len(bufs))
	free := make(chan int, len(bufs))
	for i := range bufs {
		free <- i
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // copier: device -> staging
		defer wg.Done()
		defer close(ready)
		for off := 0; off < src.Len(); off += chunk {
			var slot int
			select {
			case slot = <-free:
			case <-stop:
				return
			}
			n := min(chunk, src.Len()-off)
			err := copyRange(bufs[slot], 0, src, off, n)
			ready <- filled{slot, off, n, err}
			if err != nil {
				return
			}
		}
	}()
	defer wg.Wait()
	defer close(stop)
	for f := range ready {
		if f.err != nil {
			return fmt.Errorf("copy to staging: %w", f.err)
		}
		mem, off, release, err := registered(s.RDMAContext(), bufs[f.slot])
		if err != nil {
			return err
		}
		err = ep.Put(ctx, mem, off, f.n, m.RAddr+uint64(f.off), key)
		release()
		if err != nil {
			return err
		}
		free <- f.slot
		if m.Offers&PathStaged != 0 {
			// The receiver copies each chunk on to its GPU as soon as it
			// landed (a direct copy has when Put returns).
			if !key.Direct() {
				if err := ep.Flush(ctx); err != nil {
					return fmt.Errorf("flush: %w", err)
				}
			}
			if err := sendControl(ctx, s, ctlChunk, rangeNotice(m.Req, uint64(f.off), uint64(f.n))); err != nil {
				return err
			}
		}
	}
	return nil
}

// pushStream writes src to the receiver on the session's bulk lane, or on a
// bulk stream of its own where the session has no lane. The writes end
// (fail) once ctx does: the outbox entry's leaving waits for them.
func pushStream(ctx context.Context, s *transport.Session, m *rtr, src Source, u *sourceUse) error {
	link := stateOf(s).link
	if link == nil {
		return closedErr(s)
	}
	if link.Lane() != nil {
		return pushLane(ctx, s, link, m, src, u)
	}
	c, err := link.OpenBulk(ctx)
	if err != nil {
		return fmt.Errorf("open bulk stream: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetWriteDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetWriteDeadline(time.Now()) })
	defer stop()
	if _, err := c.Write(bulkHeader(m.Req, m.Length)); err != nil {
		return err
	}
	err = u.read(func() error {
		return eachPiece(src, cfgOf(s).StagingChunk, func(p []byte) error {
			_, err := c.Write(p)
			return err
		})
	})
	if err != nil {
		return err
	}
	return awaitBulkClose(ctx, s, c)
}

// closeWriter is a conn that can end its writing side alone (a half-close)
// and read on.
type closeWriter interface {
	CloseWrite() error
}

// errBulkLeftOpen ends a session whose receiver kept a bulk stream open past
// the push that wrote it.
var errBulkLeftOpen = errors.New("gdrpc: the receiver kept a bulk stream open after its transfer")

// awaitBulkClose ends the owner's side of c, a bulk stream written whole,
// and waits, by ctx (the push's, whose pusher slot it still holds), for the
// receiver to close its side: an honest receiver reads to the owner's close
// and closes (endBulk). The multiplexer keeps a stream closed on one side
// only for a minute, so a receiver that never closes its side would pile up
// the streams of its RTRs far past Limits.Pushes; one that keeps a stream
// open past the push ends the session. A conn that cannot half-close is
// closed, unwaited.
func awaitBulkClose(ctx context.Context, s *transport.Session, c net.Conn) error {
	cw, ok := c.(closeWriter)
	if !ok {
		return nil
	}
	if err := cw.CloseWrite(); err != nil {
		return err
	}
	// By the push's deadline alone: a push the outbox entry's leaving cut
	// short has a stream that an honest receiver closes all the same.
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetReadDeadline(dl)
	}
	_, err := io.Copy(io.Discard, c) // the receiver sends nothing on it
	if err == nil {
		return nil // the receiver closed its side
	}
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		abort(s, fmt.Errorf("%w: %w", transport.ErrPeerGone, errBulkLeftOpen))
		return fmt.Errorf("%w: %w", errBulkLeftOpen, err)
	}
	return err
}

// laneFrameMax bounds the pieces of a transfer on a frame lane: transfers in
// flight together take turns at this grain.
const laneFrameMax = 256 << 10

// pushLane writes src to the receiver as frames on the session's bulk lane
// (or its wide lane, which the transport picks by the transfer's length).
// A source that fails (a device copy) or does not hold the transfer's length,
// or a ctx that ends, stops the transfer with an abort frame; a lane cut mid
// frame ends the session. A frame under way is not cut short when the
// entry leaves, and need not be, so the lane stays intact: the entry's
// leaving waits at most laneQuick for a host payload's frame
// (pushLaneHost), one device copy for a device payload's (eachCopy).
func pushLane(ctx context.Context, s *transport.Session, link *transport.Link, m *rtr, src Source, u *sourceUse) error {
	f := laneFrame{kind: laneData, req: m.Req, total: m.Length}
	write := func(ctx context.Context, body []byte) error {
		err := link.WriteLaneFrame(ctx, f.total, f.marshal(), body)
		switch {
		case err == nil:
			f.off += f.n
			return nil
		case errors.Is(err, transport.ErrNoLaneTurn):
			return err // nothing written: the lane is intact
		}
		abort(s, fmt.Errorf("%w: bulk lane write: %w", transport.ErrPeerGone, err))
		return errLaneBroken
	}
	var err error
	if uint64(src.Len()) != f.total {
		err = fmt.Errorf("the source holds %d bytes, the transfer %d", src.Len(), f.total)
	} else if f.total == 0 {
		err = write(ctx, nil)
	} else if src.kind() == devicebuf.Host {
		err = pushLaneHost(ctx, s, link, &f, src, u)
	} else {
		err = eachCopy(s, src, u, cfgOf(s).StagingChunk, func(p []byte) error {
			for len(p) > 0 {
				f.n = uint64(min(len(p), laneFrameMax))
				if f.n > f.total-f.off {
					return fmt.Errorf("the source holds more than the transfer's %d bytes", f.total)
				}
				if err := write(ctx, p[:f.n]); err != nil {
					return err
				}
				p = p[f.n:]
			}
			return nil
		})
		if err == nil && f.off != f.total {
			err = fmt.Errorf("the source gave %d bytes, the transfer has %d", f.off, f.total)
		}
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errLaneBroken):
		return closedErr(s)
	}
	// Tell the receiver, even when ctx ended: the abort is one small frame.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfgOf(s).Timeout)
	defer cancel()
	f.kind, f.n = laneAbort, 0
	if werr := write(actx, nil); errors.Is(werr, errLaneBroken) {
		return closedErr(s)
	}
	return err
}

var errLaneBroken = errors.New("bulk lane broken")

// eachPiece hands fn src's bytes in order: host memory in one piece, GPU
// memory through a host bounce buffer, a staging chunk at a time.
func eachPiece(src Source, chunk int, fn func([]byte) error) error {
	switch b := src.Buffer; {
	case b == nil:
		return fn(src.Bytes)
	case b.Kind() == devicebuf.Host:
		hb, err := b.HostBytes()
		if err != nil {
			return err
		}
		return fn(hb)
	default:
		return chunked(nil, b.Len(), chunk, func(bounce *devicebuf.Buffer, off, n int) error {
			if err := copyRange(bounce, 0, b, off, n); err != nil {
				return err
			}
			hb, _ := bounce.HostBytes()
			return fn(hb[:n])
		})
	}
}

// laneQuick is how long a frame of a host payload is written from the
// payload itself; then the rest of the frame is copied, so that the outbox
// entry's leaving waits for the peer at most this long (see eachCopy).
const laneQuick = time.Millisecond

// pushLaneHost writes a host payload's frames on the bulk lane straight from
// the payload, each for at most laneQuick, under u; a frame the peer does
// not take by then is finished from a copy. It fails as pushLane's write
// does.
func pushLaneHost(ctx context.Context, s *transport.Session, link *transport.Link, f *laneFrame, src Source, u *sourceUse) error {
	host := src.Bytes
	if b := src.Buffer; b != nil {
		var err error
		if host, err = b.HostBytes(); err != nil {
			return err
		}
	}
	bp := laneCopies.Get().(*[]byte)
	var err error
	defer func() { afterLane(s, err, func() { laneCopies.Put(bp) }) }()
	for f.off < f.total {
		f.n = min(f.total-f.off, laneFrameMax)
		if err = u.begin(); err != nil {
			return err
		}
		err = link.WriteLaneFrameFrom(ctx, f.total, f.marshal(), host[f.off:f.off+f.n], laneQuick, func(rest []byte) []byte {
			defer u.finish()
			if len(rest) > 0 {
				laneCopied()
			}
			return (*bp)[:copy(*bp, rest)]
		})
		switch {
		case err == nil:
			f.off += f.n
			continue
		case errors.Is(err, transport.ErrNoLaneTurn):
			return err // nothing written: the lane is intact
		}
		abort(s, fmt.Errorf("%w: bulk lane write: %w", transport.ErrPeerGone, err))
		err = errLaneBroken
		return err
	}
	return nil
}

// afterLane runs release, which gives back a buffer a lane write read from,
// now, or, where err says a write broke part-way (errLaneBroken: a UCX send
// cut short by its deadline may still be reading the buffer), once s's
// connections are released: a buffer given back at once could be unmapped
// under the send, or refilled with another transfer's bytes that the send
// then carries.
func afterLane(s *transport.Session, err error, release func()) {
	if s == nil || !errors.Is(err, errLaneBroken) {
		release()
		return
	}
	go func() {
		<-s.Released()
		release()
	}()
}

// eachCopy hands fn the bytes of src, a device payload, in order, in pieces
// of at most chunk bytes that it copies, under u, into a host buffer of its
// own: fn, which may wait for the peer over s's lanes, reads only the copy,
// so the outbox entry's leaving waits for one copy at most.
func eachCopy(s *transport.Session, src Source, u *sourceUse, chunk int, fn func([]byte) error) error {
	return chunked(s, src.Len(), chunk, func(bounce *devicebuf.Buffer, off, n int) error {
		if err := u.read(func() error { return copyRange(bounce, 0, src.Buffer, off, n) }); err != nil {
			return err
		}
		hb, _ := bounce.HostBytes()
		return fn(hb[:n])
	})
}

// laneCopied runs when pushLaneHost finishes a frame from a copy; tests
// replace it to see that happen.
var laneCopied = func() {}

// laneCopies are the buffers pushLaneHost finishes frames from.
var laneCopies = sync.Pool{New: func() any {
	b := make([]byte, laneFrameMax)
	return &b
}}

// chunked runs fn over [0, n) in staging-chunk pieces with one host bounce
// buffer, given back as afterLane says where fn writes it on s's lanes (s
// nil: it does not).
func chunked(s *transport.Session, n, chunk int, fn func(bounce *devicebuf.Buffer, off, n int) error) (err error) {
	chunk = min(chunk, n)
	if chunk == 0 {
		return nil
	}
	bounce, err := devicebuf.NewHostAllocator().Alloc(chunk)
	if err != nil {
		return err
	}
	defer func() { afterLane(s, err, func() { bounce.Release() }) }()
	for off := 0; off < n; off += chunk {
		if err = fn(bounce, off, min(chunk, n-off)); err != nil {
			return err
		}
	}
	return nil
}

// copyRange copies n bytes from src[soff:] to dst[doff:] through devicebuf.
func copyRange(dst *devicebuf.Buffer, doff int, src *devicebuf.Buffer, soff, n int) error {
	d, err := dst.Slice(doff, n)
	if err != nil {
		return err
	}
	defer d.Release()
	sv, err := src.Slice(soff, n)
	if err != nil {
		return err
	}
	defer sv.Release()
	return devicebuf.Copy(d, sv)
}
