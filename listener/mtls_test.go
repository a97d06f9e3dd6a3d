package listener_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/listener"
	"github.com/gdrpc/gdrpc/transport"
)

// testPKI is a CA and the certificates it issued.
type testPKI struct {
	tb     testing.TB
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	pool   *x509.CertPool
	serial int64
}

func newTestPKI(tb testing.TB) *testPKI {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(tb, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "gdrpc test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(tb, err)
	ca, err := x509.ParseCertificate(der)
	require.NoError(tb, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return &testPKI{tb: tb, ca: ca, caKey: key, pool: pool, serial: 1}
}

// issue returns a certificate for tmpl's names, signed by the CA.
func (p *testPKI) issue(tmpl *x509.Certificate) tls.Certificate {
	p.tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(p.tb, err)
	p.serial++
	tmpl.SerialNumber = big.NewInt(p.serial)
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	require.NoError(p.tb, err)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// mtlsHealth answers Check with SERVING when the caller's TLS certificate
// names client-7, as a handler that authorizes by certificate does.
type mtlsHealth struct {
	healthpb.UnimplementedHealthServer
	sessions chan *transport.Session
}

func (h *mtlsHealth) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return nil, status.Errorf(codes.Unauthenticated, "AuthInfo is %T, not TLS", p.AuthInfo)
	}
	if certs := ti.State.PeerCertificates; len(certs) == 0 || certs[0].Subject.CommonName != "client-7" {
		return nil, status.Error(codes.PermissionDenied, "not client-7")
	}
	h.sessions <- transport.SessionFromContext(ctx)
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

// TestMutualTLS: over a gdrpc session with mutual TLS, a handler reads the
// client's certificate from credentials.TLSInfo (the type check gRPC's RBAC
// makes), admits the client it names and refuses others, and still finds the
// session from the call's context.
func TestMutualTLS(t *testing.T) {
	pki := newTestPKI(t)
	serverCert := pki.issue(&x509.Certificate{Subject: pkix.Name{CommonName: "gdrpc.test"}, DNSNames: []string{"gdrpc.test"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	clientCert := func(name string) tls.Certificate {
		return pki.issue(&x509.Certificate{Subject: pkix.Name{CommonName: name},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	}
	stls := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{serverCert},
		ClientCAs:    pki.pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
	})
	opts := []transport.Option{transport.WithMode(transport.ModeTCP)}
	l, err := listener.Listen("127.0.0.1:0", gdrpc.WithSessionOptions(opts...))
	require.NoError(t, err)
	srv := grpc.NewServer(listener.ServerOptions(stls)...)
	defer srv.Stop()
	h := &mtlsHealth{sessions: make(chan *transport.Session, 1)}
	healthpb.RegisterHealthServer(srv, h)
	go func() { _ = srv.Serve(l) }()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	call := func(name string) (*peer.Peer, error) {
		ctls := credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{clientCert(name)},
			RootCAs:      pki.pool,
			ServerName:   "gdrpc.test",
		})
		cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(), dialer.New(gdrpc.WithSessionOptions(opts...)).DialOptions(ctls)...)
		require.NoError(t, err)
		defer cc.Close()
		var p peer.Peer
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p))
		return &p, err
	}

	p, err := call("client-7")
	require.NoError(t, err)
	sess := <-h.sessions
	require.NotNil(t, sess, "the handler finds the session")
	require.Equal(t, transport.LocalID(), sess.Peer().ID)
	require.Equal(t, "tcp", sess.Transport())
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	require.True(t, ok, "the client's AuthInfo is %T", p.AuthInfo)
	require.Equal(t, "gdrpc.test", ti.State.PeerCertificates[0].Subject.CommonName)
	require.NotNil(t, transport.SessionFromPeer(p), "the client finds its session")

	_, err = call("client-8")
	require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
}
