package transport_test

import (
	"context"
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc/transport"
)

// testTLS returns server and client TLS credentials for a self-signed
// certificate of "gdrpc.test".
func testTLS(t *testing.T) (server, client credentials.TransportCredentials) {
	t.Helper()
	return transport.TLSCredsForTest(t)
}

// seen records what the server's interceptor saw of each call.
type seen struct {
	mu       sync.Mutex
	sessions []*transport.Session
	auths    []credentials.AuthInfo
}

func (s *seen) interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	p, _ := peer.FromContext(ctx)
	s.mu.Lock()
	s.sessions = append(s.sessions, transport.SessionFromContext(ctx))
	s.auths = append(s.auths, p.AuthInfo)
	s.mu.Unlock()
	return h(ctx, req)
}

func (s *seen) last() (*transport.Session, credentials.AuthInfo) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sessions[len(s.sessions)-1], s.auths[len(s.auths)-1]
}

func TestCredentialsTLS(t *testing.T) {
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.options(t)
			stls, ctls := testTLS(t)
			l, err := transport.Listen("127.0.0.1:0", opts...)
			require.NoError(t, err)
			defer l.Close()
			var sn seen
			srv := grpc.NewServer(grpc.Creds(transport.NewCredentials(stls)), grpc.UnaryInterceptor(sn.interceptor))
			healthpb.RegisterHealthServer(srv, health.NewServer())
			go func() { _ = srv.Serve(l) }()
			defer srv.Stop()

			// A gdrpc client with TLS on top.
			var clientAuth credentials.AuthInfo
			cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(),
				grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
					s, err := transport.Dial(ctx, addr, opts...)
					if err != nil {
						return nil, err
					}
					return s.Conn(ctx)
				}),
				grpc.WithTransportCredentials(transport.NewCredentials(ctls)))
			require.NoError(t, err)
			defer cc.Close()
			var p peer.Peer
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p))
			require.NoError(t, err)
			clientAuth = p.AuthInfo

			// The handler sees TLS's own AuthInfo; the session comes from the
			// peer's address.
			sess, ai := sn.last()
			require.NotNil(t, sess)
			require.Equal(t, tc.want(), sess.Transport())
			require.Equal(t, transport.LocalID(), sess.Peer().ID)
			require.Empty(t, sess.Peer().Caps.Codecs, "a session without an engine announces no codec")
			ti, isTLS := ai.(credentials.TLSInfo)
			require.True(t, isTLS, "server AuthInfo is %T", ai)
			require.True(t, ti.State.HandshakeComplete)
			require.Equal(t, "tls", ai.AuthType())
			require.Equal(t, credentials.PrivacyAndIntegrity, ti.SecurityLevel)
			require.Equal(t, "gdrpc+"+tc.want(), p.Addr.Network())

			_, isTLS = clientAuth.(credentials.TLSInfo)
			require.True(t, isTLS, "client AuthInfo is %T", clientAuth)
			cs := transport.SessionFromPeer(&p)
			require.NotNil(t, cs)
			require.Equal(t, tc.want(), cs.Transport())

			// A plain TLS gRPC client on the same port.
			plain, err := grpc.NewClient("passthrough:///"+l.Addr().String(), grpc.WithTransportCredentials(ctls))
			require.NoError(t, err)
			defer plain.Close()
			_, err = healthpb.NewHealthClient(plain).Check(ctx, &healthpb.HealthCheckRequest{})
			require.NoError(t, err)
			sess, ai = sn.last()
			require.Nil(t, sess)
			_, isTLS = ai.(credentials.TLSInfo)
			require.True(t, isTLS, "plain client AuthInfo is %T", ai)
		})
	}
}

// TestCredentialsInsecure: without inner credentials, gdrpc calls carry an
// AuthInfo with the session and plain calls a PlainAuthInfo.
func TestCredentialsInsecure(t *testing.T) {
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP))
	require.NoError(t, err)
	defer l.Close()
	var sn seen
	srv := grpc.NewServer(grpc.Creds(transport.NewCredentials(nil)), grpc.UnaryInterceptor(sn.interceptor))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	checkHealth(t, gdrpcClient(t, l.Addr().String(), transport.WithMode(transport.ModeTCP)))
	sess, ai := sn.last()
	require.NotNil(t, sess)
	require.Equal(t, "gdrpc", ai.AuthType())
	require.Equal(t, credentials.NoSecurity, ai.(transport.AuthInfo).SecurityLevel)

	plain, err := grpc.NewClient("passthrough:///"+l.Addr().String(), grpc.WithTransportCredentials(transport.NewCredentials(nil)))
	require.NoError(t, err)
	defer plain.Close()
	checkHealth(t, plain)
	sess, ai = sn.last()
	require.Nil(t, sess)
	require.IsType(t, transport.PlainAuthInfo{}, ai)
}
