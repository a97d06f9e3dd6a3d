package transport

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"fmt"
	"io"
	"net"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// AuthInfo is what gRPC's peer.FromContext carries for a gdrpc session whose
// credentials have no inner credentials: the peer process as the handshake
// described it and the transport. With inner credentials (TLS, say), the
// peer carries their AuthInfo unchanged, and the session is found from the
// peer's address (SessionFromContext, SessionFromPeer).
type AuthInfo struct {
	credentials.CommonAuthInfo
	Peer      Peer
	Transport string // "ucx" or "tcp"
	session   *Session
}

// AuthType returns "gdrpc".
func (a AuthInfo) AuthType() string { return "gdrpc" }

// Session returns the session, or nil.
func (a AuthInfo) Session() *Session { return a.session }

// PlainAuthInfo is the AuthInfo of a plain (not gdrpc) connection accepted
// without inner credentials.
type PlainAuthInfo struct {
	credentials.CommonAuthInfo
}

// AuthType returns "insecure".
func (PlainAuthInfo) AuthType() string { return "insecure" }

type creds struct {
	inner credentials.TransportCredentials
}

// NewCredentials returns gRPC transport credentials for gdrpc conns. inner
// may be nil (no security) or any credentials, TLS for instance: its
// handshake runs over the gdrpc conn exactly as it would over TCP, and the
// AuthInfo gRPC hands to handlers and interceptors (peer.FromContext) is
// inner's, unchanged, so a check such as AuthInfo.(credentials.TLSInfo) works
// as it does over TCP. Without inner, a gdrpc conn gets an AuthInfo with the
// peer process and a plain connection a PlainAuthInfo. Either way the session
// of a call is found from the peer's address: SessionFromContext in a
// handler, SessionFromPeer for a client's grpc.Peer.
//
// When inner is TLS, each end then binds the TLS connection to its session:
// it signs the TLS exporter value (RFC 5705) and the session's handshake
// with the key that proved its process id, and checks the other end's
// signature with the key the session proved, so a TLS connection relayed
// between two different sessions fails. A call whose session
// SessionFromContext finds and whose AuthInfo is a credentials.TLSInfo
// therefore ran over TLS bound to that session: its TLS peer is the session's
// peer process. Both ends of a gdrpc session must use NewCredentials (the
// dialer and listener packages do).
//
// The gRPC stream is protected by inner; bytes moved out of band (RDMA, bulk
// streams) are not encrypted.
func NewCredentials(inner credentials.TransportCredentials) credentials.TransportCredentials {
	return &creds{inner: inner}
}

// wrap returns the conn and AuthInfo of a finished handshake: inner's
// AuthInfo as it is, else one of this package's.
func (c *creds) wrap(conn net.Conn, s *Session, innerConn net.Conn, innerAI credentials.AuthInfo) (net.Conn, credentials.AuthInfo) {
	if s != nil && innerConn != conn {
		innerConn = &sessionConn{Conn: innerConn, sess: s}
	}
	switch {
	case innerAI != nil:
		return innerConn, innerAI
	case s == nil:
		return innerConn, PlainAuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}
	}
	return innerConn, AuthInfo{
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity},
		Peer:           s.Peer(),
		Transport:      s.Transport(),
		session:        s,
	}
}

// sessionConn keeps SessionOf working through a conn the inner credentials
// wrapped.
type sessionConn struct {
	net.Conn
	sess *Session
}

func (c *sessionConn) Session() *Session { return c.sess }

func (c *creds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	s := SessionOf(conn)
	out := conn
	var innerAI credentials.AuthInfo
	if c.inner != nil {
		var err error
		out, innerAI, err = c.inner.ClientHandshake(ctx, authority, conn)
		if err != nil {
			return nil, nil, err
		}
		if ti, ok := innerAI.(credentials.TLSInfo); ok && s != nil {
			unbind := bindDeadline(ctx, out)
			err := bindTLS(s, out, ti.State)
			unbind()
			if err != nil {
				_ = out.Close()
				return nil, nil, ctxErr(ctx, err)
			}
		}
	}
	out, ai := c.wrap(conn, s, out, innerAI)
	return out, ai, nil
}

// ServerHandshake runs under the deadline gRPC sets on conn for it.
func (c *creds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	s := SessionOf(conn)
	out := conn
	var innerAI credentials.AuthInfo
	if c.inner != nil {
		var err error
		out, innerAI, err = c.inner.ServerHandshake(conn)
		if err != nil {
			return nil, nil, err
		}
		if ti, ok := innerAI.(credentials.TLSInfo); ok && s != nil {
			if err := bindTLS(s, out, ti.State); err != nil {
				_ = out.Close()
				return nil, nil, err
			}
		}
	}
	out, ai := c.wrap(conn, s, out, innerAI)
	return out, ai, nil
}

// TLS channel binding: the exporter label (RFC 5705) and the label of what
// each end signs.
const (
	tlsExporterLabel = "EXPORTER-gdrpc-session-binding"
	tlsBindingLabel  = "gdrpc tls binding v1\x00"
)

// tlsBinding returns what the end of the given role signs: the label, the
// role, the session's handshake digest and the TLS exporter value.
func tlsBinding(role string, s *Session, ekm []byte) []byte {
	b := make([]byte, 0, len(tlsBindingLabel)+len(role)+len(s.handshake)+len(ekm))
	b = append(b, tlsBindingLabel...)
	b = append(b, role...)
	b = append(b, s.handshake[:]...)
	return append(b, ekm...)
}

// bindTLS proves over c, a TLS connection on the session's gRPC stream, that
// both ends of the TLS connection are the ends of the session s: each end
// sends its signature (64 bytes) of the TLS exporter value and the session's
// handshake digest, made with the key its process id was proven with, and
// checks the other's with the key the session proved. A TLS connection
// relayed between two sessions has one exporter value but two handshakes, so
// neither end's signature verifies at the other.
func bindTLS(s *Session, c net.Conn, state tls.ConnectionState) error {
	ekm, err := state.ExportKeyingMaterial(tlsExporterLabel, s.handshake[:], 32)
	if err != nil {
		return fmt.Errorf("gdrpc: TLS channel binding: %w", err)
	}
	mine, theirs := roleServerLabel, roleClientLabel
	if s.client {
		mine, theirs = theirs, mine
	}
	sig := s.cfg.identity.signTranscript(tlsBinding(mine, s, ekm))
	_, sendErr := c.Write(sig[:])
	// The peer's signature is read even when the send failed: the peer
	// sends before it reads, so it may already be here, and a relayed
	// connection whose other end gave up first is still reported as what
	// it is (yamux may fail a write whose data went out when its session
	// ends before the write is acknowledged).
	var peerSig signature
	if _, err := io.ReadFull(c, peerSig[:]); err != nil {
		if sendErr != nil {
			return fmt.Errorf("gdrpc: TLS channel binding: send: %w", sendErr)
		}
		return fmt.Errorf("gdrpc: TLS channel binding: read: %w", err)
	}
	if !ed25519.Verify(s.peer.PublicKey, tlsBinding(theirs, s, ekm), peerSig[:]) {
		return &IdentityError{Claimed: s.peer.ID, Reason: "the TLS channel binding does not verify: the TLS peer is not the session's peer"}
	}
	if sendErr != nil {
		return fmt.Errorf("gdrpc: TLS channel binding: send: %w", sendErr)
	}
	return nil
}

func (c *creds) Info() credentials.ProtocolInfo {
	if c.inner != nil {
		return c.inner.Info()
	}
	return credentials.ProtocolInfo{SecurityProtocol: "insecure"}
}

func (c *creds) Clone() credentials.TransportCredentials {
	if c.inner != nil {
		return &creds{inner: c.inner.Clone()}
	}
	return &creds{}
}

//nolint:staticcheck // part of the interface
func (c *creds) OverrideServerName(name string) error {
	if c.inner != nil {
		return c.inner.OverrideServerName(name) //nolint:staticcheck
	}
	return nil
}

// SessionFromContext returns the session of the RPC whose context ctx is (a
// server handler's or interceptor's), or nil when the RPC did not come over a
// gdrpc session.
func SessionFromContext(ctx context.Context) *Session {
	p, _ := peer.FromContext(ctx)
	return SessionFromPeer(p)
}

// SessionFromPeer returns the session p, the peer of an RPC (from
// peer.FromContext, or filled by the grpc.Peer call option), came over, or nil
// when it came over none: gRPC's peer address of a gdrpc conn is an *Addr,
// whatever credentials run inside.
func SessionFromPeer(p *peer.Peer) *Session {
	if p == nil {
		return nil
	}
	if a, ok := p.Addr.(*Addr); ok && a.session != nil {
		return a.session
	}
	if ai, ok := p.AuthInfo.(AuthInfo); ok {
		return ai.session
	}
	return nil
}
