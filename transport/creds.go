package transport

import (
	"context"
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
	session   *Session
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
// The gRPC stream is protected by inner; bytes moved out of band (RDMA, bulk
// streams) are not encrypted.
func NewCredentials(inner credentials.TransportCredentials) credentials.TransportCredentials {
	return &creds{inner: inner}
}

func (c *creds) wrap(conn net.Conn, s *Session, innerConn net.Conn, innerAI credentials.AuthInfo) (net.Conn, credentials.AuthInfo) {
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
	if c.inner != nil {
		var err error
		out, innerAI, err = c.inner.ClientHandshake(ctx, authority, conn)
		if err != nil {
			return nil, nil, err
		}
	}
	out, ai := c.wrap(conn, s, out, innerAI)
	return out, ai, nil
}

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
	}
	out, ai := c.wrap(conn, s, out, innerAI)
	return out, ai, nil
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
