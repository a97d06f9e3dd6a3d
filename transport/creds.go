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

// AuthInfo is what gRPC's peer.FromContext carries for a gdrpc session: the
// peer process as the handshake described it, the transport, and the inner
// credentials' AuthInfo (TLS, say), or nil when there are none.
type AuthInfo struct {
	credentials.CommonAuthInfo
	Peer      Peer
	Transport string // "ucx" or "tcp"
	Inner     credentials.AuthInfo
	// TLSBound reports that Inner is TLS and its connection is bound to the
	// session: the TLS peer proved, with its session key, that it is the
	// process Peer describes (bindTLS).
	TLSBound bool
	session  *Session
}

// AuthType returns "gdrpc", or "gdrpc+" and the inner credentials' type.
func (a AuthInfo) AuthType() string {
	if a.Inner != nil {
		return "gdrpc+" + a.Inner.AuthType()
	}
	return "gdrpc"
}

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
// handshake runs over the gdrpc conn exactly as it would over TCP. For a
// gdrpc conn the AuthInfo is an AuthInfo that carries the peer process and
// its capabilities (SessionFromContext finds the session); a plain
// connection gets the inner AuthInfo, or a PlainAuthInfo.
//
// When inner is TLS, each end then binds the TLS connection to its session:
// it signs the TLS exporter value (RFC 5705) and the session's handshake
// with the key that proved its process id, and checks the other end's
// signature with the key the session proved, so a TLS connection relayed
// between two different sessions fails. Both ends of a gdrpc session must
// therefore use NewCredentials (the dialer and listener packages do).
//
// The gRPC stream is protected by inner; bytes moved out of band (RDMA, bulk
// streams) are not encrypted.
func NewCredentials(inner credentials.TransportCredentials) credentials.TransportCredentials {
	return &creds{inner: inner}
}

func (c *creds) wrap(conn net.Conn, s *Session, innerConn net.Conn, innerAI credentials.AuthInfo, tlsBound bool) (net.Conn, credentials.AuthInfo) {
	if s == nil {
		if innerAI != nil {
			return innerConn, innerAI
		}
		return innerConn, PlainAuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}
	}
	ai := AuthInfo{
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity},
		Peer:           s.Peer(),
		Transport:      s.Transport(),
		Inner:          innerAI,
		TLSBound:       tlsBound,
		session:        s,
	}
	if innerAI != nil {
		if ci, ok := innerAI.(interface {
			GetCommonAuthInfo() credentials.CommonAuthInfo
		}); ok {
			ai.CommonAuthInfo = ci.GetCommonAuthInfo()
		} else {
			ai.CommonAuthInfo.SecurityLevel = credentials.InvalidSecurityLevel
		}
	}
	if innerConn != conn {
		innerConn = &sessionConn{Conn: innerConn, sess: s}
	}
	return innerConn, ai
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
	bound := false
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
			bound = true
		}
	}
	out, ai := c.wrap(conn, s, out, innerAI, bound)
	return out, ai, nil
}

// ServerHandshake runs under the deadline gRPC sets on conn for it.
func (c *creds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	s := SessionOf(conn)
	out := conn
	var innerAI credentials.AuthInfo
	bound := false
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
			bound = true
		}
	}
	out, ai := c.wrap(conn, s, out, innerAI, bound)
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
	if _, err := c.Write(sig[:]); err != nil {
		return fmt.Errorf("gdrpc: TLS channel binding: send: %w", err)
	}
	var peerSig signature
	if _, err := io.ReadFull(c, peerSig[:]); err != nil {
		return fmt.Errorf("gdrpc: TLS channel binding: read: %w", err)
	}
	if !ed25519.Verify(s.peer.PublicKey, tlsBinding(theirs, s, ekm), peerSig[:]) {
		return &IdentityError{Claimed: s.peer.ID, Reason: "the TLS channel binding does not verify: the TLS peer is not the session's peer"}
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
	p, ok := peer.FromContext(ctx)
	if !ok || p == nil {
		return nil
	}
	switch ai := p.AuthInfo.(type) {
	case AuthInfo:
		return ai.session
	case *AuthInfo:
		return ai.session
	}
	if a, ok := p.Addr.(*Addr); ok {
		return a.session
	}
	return nil
}
