package transport

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/gdrpc/gdrpc/internal/wire"
	"github.com/gdrpc/gdrpc/rdma"
)

// Dial connects to a gdrpc listener at addr (host:port, TCP), runs the
// handshake, and, when both ends have UCX and the mode allows, moves the
// session onto a UCX endpoint. ctx bounds the dial and the handshake (which
// WithHandshakeTimeout bounds too); it does not bound the session.
func Dial(ctx context.Context, addr string, opts ...Option) (*Session, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	return dial(ctx, addr, cfg)
}

// DialConn is Dial followed by the session's Conn, the stream gRPC runs on,
// for less: the lane under that stream opens together with the session's
// control and bulk lanes instead of after them, and a lane over UCX takes
// milliseconds to connect. Closing the conn closes the session
// (SessionOf finds it).
func DialConn(ctx context.Context, addr string, opts ...Option) (net.Conn, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	cfg.grpcWithLanes = true
	s, err := dial(ctx, addr, cfg)
	if err != nil {
		return nil, err
	}
	c, err := s.Conn(ctx)
	if err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("gdrpc: dial %s: the gRPC stream: %w", addr, err)
	}
	return c, nil
}

func dial(ctx context.Context, addr string, cfg *config) (*Session, error) {
	var rctx *rdma.Context
	if cfg.mode != ModeTCP {
		var uerr error
		rctx, uerr = cfg.rdmaContext()
		if uerr != nil {
			if cfg.mode == ModeUCX {
				return nil, fmt.Errorf("gdrpc: dial %s: transport ucx required: %w", addr, uerr)
			}
			cfg.noteNoUCX(cfg.logger, uerr)
			rctx = nil
		}
	}
	var d net.Dialer
	tc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("gdrpc: dial %s: %w", addr, err)
	}
	s, err := clientHandshake(ctx, cfg, tc, rctx, true)
	if err != nil {
		return nil, fmt.Errorf("gdrpc: dial %s: %w", addr, err)
	}
	return s, nil
}

// NewClientSession runs the client side of the handshake over conn, which
// must reach a peer running NewServerSession or a Listener, and returns a
// session over conn (transport "tcp": no UCX upgrade). The session owns conn.
// It is the seam for fakes and for callers bringing their own connection.
func NewClientSession(ctx context.Context, conn net.Conn, opts ...Option) (*Session, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	if cfg.modeSet && cfg.mode == ModeUCX {
		_ = conn.Close()
		return nil, errors.New("gdrpc: transport ucx needs Dial, not a caller's conn")
	}
	cfg.mode = ModeTCP
	s, err := clientHandshake(ctx, cfg, conn, nil, false)
	if err != nil {
		return nil, fmt.Errorf("gdrpc: %w", err)
	}
	return s, nil
}

// bindDeadline applies ctx's deadline to conn and makes ctx's end fail its
// pending I/O. The returned func undoes both (once, however often it is
// called): where ctx ended meanwhile, it waits for ctx's past deadline to be
// set before it clears it, so that a conn kept after a handshake that ended
// as its context did is not left failing every read.
func bindDeadline(ctx context.Context, conn interface{ SetDeadline(time.Time) error }) func() {
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	set := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(set)
		_ = conn.SetDeadline(time.Unix(1, 0))
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			if !stop() {
				<-set
			}
			_ = conn.SetDeadline(time.Time{})
		})
	}
}

// ctxErr prefers the context's error to the I/O error it caused. A handshake
// that ran out of time returns an error that is a net.Error with Timeout()
// true and matches both context.DeadlineExceeded and os.ErrDeadlineExceeded.
// The I/O deadline is the context's, so a deadline error from the conn may
// come first, before the context's own timer has fired: that is the same
// timeout.
func ctxErr(ctx context.Context, err error) error {
	cerr := ctx.Err()
	if cerr == nil && errors.Is(err, os.ErrDeadlineExceeded) {
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			cerr = context.DeadlineExceeded
		}
	}
	switch {
	case cerr == nil:
		return err
	case errors.Is(cerr, context.DeadlineExceeded):
		return fmt.Errorf("%w (%w: %w)", &TimeoutError{Op: "handshake"}, context.DeadlineExceeded, err)
	default:
		return fmt.Errorf("handshake: %w", cerr)
	}
}

// serverChoseTCP is the fallback reason of a client that offered UCX to a
// server that answered with a TCP session.
const serverChoseTCP = "server chose TCP: it does not trust this client (WithTrustPeers on both ends), has no UCX, is set to TCP, or the client came over IPv6 (UCX sessions start over IPv4)"

var serverChoseTCPNoted sync.Once

// noteServerChoseTCP logs a server's choice of TCP for a client that offered
// UCX: at Info the first time in the process (through slog's default logger
// when no WithLogger was given), at Debug each time.
func (c *config) noteServerChoseTCP() {
	c.logger.Debug(serverChoseTCP)
	c.infoOnce(&serverChoseTCPNoted, c.logger, "gdrpc: "+serverChoseTCP+"; payloads take the stream path (logged once per process)")
}

// clientHandshake runs the client's side of the handshake over conn. With
// lanes, the session may dial the server again for its lanes (Dial: conn is a
// TCP connection to the server's listener).
func clientHandshake(ctx context.Context, cfg *config, conn net.Conn, rctx *rdma.Context, lanes bool) (s *Session, err error) {
	hctx, cancel := context.WithTimeout(ctx, cfg.handshakeTimeout)
	defer cancel()
	unbind := bindDeadline(hctx, conn)
	defer func() {
		if err != nil {
			unbind()
			_ = conn.Close()
			err = ctxErr(hctx, err)
		}
	}()

	caps := cfg.localCaps()
	if rctx == nil && cfg.mode != ModeTCP {
		caps.UCX = false
	}
	if !lanes {
		caps.Lanes = false
	}
	self := cfg.identity
	helloFrame := encodeHello(hello{ID: self.ID(), HostID: LocalHostID(), Mode: cfg.mode, Caps: caps, Key: self.publicKey(), Nonce: newNonce()})
	if _, err := conn.Write(helloFrame); err != nil {
		return nil, fmt.Errorf("handshake: send hello: %w", err)
	}
	version, body, err := readFrame(conn, false)
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = fmt.Errorf("%w: peer closed the connection during the handshake", ErrPeerGone)
		}
		return nil, fmt.Errorf("handshake: %w", err)
	}
	w, err := parseWelcome(version, body)
	if err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	helloBody := helloFrame[frameHeaderLen:]
	err = checkClaim(self, w.ID, w.Key)
	if err == nil {
		err = checkSignature(self, w.ID, w.Key, transcript(roleServerLabel, helloBody, unsignedWelcome(body)), w.Signature)
	}
	if err != nil {
		_, _ = conn.Write(encodeReject(rejectIdentity, err.Error()))
		return nil, fmt.Errorf("handshake: %w", err)
	}
	proofFrame := encodeProof(proof{Signature: self.signTranscript(transcript(roleClientLabel, helloBody, body))})
	if _, err := conn.Write(proofFrame); err != nil {
		return nil, fmt.Errorf("handshake: send proof: %w", err)
	}
	if w.Transport == "tcp" && cfg.mode == ModeUCX {
		return nil, fmt.Errorf("handshake: transport ucx required but the server did not offer it")
	}
	if w.Transport == "tcp" && caps.UCX && cfg.mode == ModeAuto {
		// This side offered UCX (it trusts its peers and has UCX) and the
		// server did not take it (serverChoseTCP says why it may not):
		// said, since a user who trusted one end only would otherwise not
		// learn why payloads take the stream.
		cfg.noteServerChoseTCP()
		cfg.metrics.Fallback(serverChoseTCP)
	}

	setup := sessionSetup{
		client:    true,
		cfg:       cfg,
		peer:      Peer{ID: w.ID, PublicKey: append(ed25519.PublicKey(nil), w.Key[:]...), HostID: w.HostID, Caps: w.Caps, SameHost: w.HostID == LocalHostID()},
		token:     w.Token,
		transport: "tcp",
		conn:      conn,
		boot:      connAddrs(conn),
		handshake: sessionHash(helloBody, body, proofFrame[frameHeaderLen:]),
		ctx:       hctx,
	}
	if caps.Lanes {
		setup.laneAddr = conn.RemoteAddr().String() // the address dialed, resolved
		setup.tcpLaneAddr = setup.laneAddr
	}
	if w.Transport == "ucx" {
		if rctx == nil {
			return nil, fmt.Errorf("handshake: %w", wire.Malformed("server offered UCX to a client without it"))
		}
		host := ""
		if ta, ok := conn.RemoteAddr().(*net.TCPAddr); ok {
			host = ta.IP.String()
		} else {
			return nil, fmt.Errorf("handshake: UCX offered over a non-TCP connection")
		}
		uaddr := net.JoinHostPort(host, strconv.Itoa(int(w.UCXPort)))
		uctx, cancel := hctx, context.CancelFunc(func() {})
		if w.FallbackOK && cfg.mode != ModeUCX {
			// A listener that keeps turning the upgrade away (every
			// endpoint slot taken) must leave the handshake time to fall
			// back to TCP.
			if dl, ok := hctx.Deadline(); ok {
				uctx, cancel = context.WithTimeout(hctx, time.Until(dl)/2)
			}
		}
		ep, uerr := upgradeUCX(uctx, rctx, uaddr, w.Token)
		cancel()
		if uerr != nil {
			if !w.FallbackOK || cfg.mode == ModeUCX {
				return nil, fmt.Errorf("handshake: UCX upgrade to %s: %w", uaddr, uerr)
			}
			cfg.logger.Info("UCX upgrade failed, falling back to TCP", "ucx_addr", uaddr, "err", uerr)
			cfg.metrics.Fallback("UCX upgrade failed: " + uerr.Error())
			if _, err := conn.Write([]byte{decisionTCP}); err != nil {
				return nil, fmt.Errorf("handshake: send decision: %w", err)
			}
		} else {
			if _, err := conn.Write([]byte{decisionUCX}); err != nil {
				_ = ep.Close()
				return nil, fmt.Errorf("handshake: send decision: %w", err)
			}
			unbind()
			_ = conn.Close() // the bootstrap is done; the session runs over UCX
			setup.transport, setup.conn, setup.ep, setup.rctx = "ucx", ep, ep, rctx
			if caps.Lanes {
				setup.laneAddr = uaddr
			}
			return newSession(setup)
		}
	}
	unbind()
	if err := hctx.Err(); err != nil {
		return nil, err
	}
	return newSession(setup)
}

// admission paces a client's requests to a gdrpc UCX listener: the
// listener takes them only while a proven handshake or lane waits for one,
// and while it has an endpoint slot free, and it closes (or, past
// maxShedding closes at once, aborts) an endpoint it took past its slots
// before it reads a byte, since requests that pass its filter together may
// outnumber them. A request turned away is made again until the context
// ends; an endpoint shed so, up to maxSheds times.
type admission struct {
	pause time.Duration // the next wait; doubles up to 100 ms
	sheds int
}

// maxSheds bounds the endpoints one client request dials again after the
// listener shed them: past it, the end or reset is taken for what it says.
const maxSheds = 8

// dial dials the listener at addr until it takes the request or ctx ends.
func (a *admission) dial(ctx context.Context, w *rdma.Worker, addr string) (*rdma.Endpoint, error) {
	for {
		ep, err := w.Dial(ctx, addr)
		if !errors.Is(err, rdma.ErrRejected) && !a.shed(ctx, err) {
			return ep, err
		}
		if err := a.wait(ctx); err != nil {
			return nil, ctxErr(ctx, err)
		}
	}
}

// shed reports whether err, from an endpoint to the listener that it had
// not answered yet, says the listener shed it (its end; a reset, or, while
// the dial was still connecting, an endpoint not connected: an abort), and
// counts it: the endpoint is to be dialed again, up to maxSheds times.
func (a *admission) shed(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil || a.sheds == maxSheds ||
		!errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.ENOTCONN) {
		return false
	}
	a.sheds++
	return true
}

// wait waits a.pause, doubled from the last up to 100 ms (1 ms the first
// time), or returns ctx's error if ctx ends first.
func (a *admission) wait(ctx context.Context) error {
	a.pause = min(max(2*a.pause, time.Millisecond), 100*time.Millisecond)
	t := time.NewTimer(a.pause)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// presentToken sends msg (a magic and the token that names a handshake or
// a session) on ep, a new endpoint to a gdrpc listener, and reads the
// listener's one-byte answer. It closes ep on error.
func presentToken(ctx context.Context, ep net.Conn, msg []byte) (byte, error) {
	unbind := bindDeadline(ctx, ep)
	var b [1]byte
	_, err := ep.Write(msg)
	if err == nil {
		_, err = io.ReadFull(ep, b[:])
	}
	unbind()
	if err != nil {
		_ = ep.Close()
		return 0, ctxErr(ctx, err)
	}
	return b[0], nil
}

// upgradeUCX dials the server's UCX listener and proves the session with its
// token.
func upgradeUCX(ctx context.Context, rctx *rdma.Context, addr string, token ID) (*rdma.Endpoint, error) {
	w := rctx.Worker()
	if w == nil {
		return nil, fmt.Errorf("UCX context has no worker: %w", rdma.ErrNotSupported)
	}
	msg := append([]byte(upgradeMagic), token[:]...)
	var a admission
	for {
		// The server's UCX listener takes the request once the server
		// checked the proof, which this dial may overtake.
		ep, err := a.dial(ctx, w, addr)
		if err != nil {
			return nil, err
		}
		ack, err := presentToken(ctx, ep, msg)
		switch {
		case a.shed(ctx, err):
			if err := a.wait(ctx); err != nil {
				return nil, ctxErr(ctx, err)
			}
			continue
		case err != nil:
			return nil, fmt.Errorf("present token: %w", err)
		case ack != upgradeAckOK:
			_ = ep.Close()
			return nil, fmt.Errorf("server refused the UCX upgrade (ack %d)", ack)
		}
		return ep, nil
	}
}
