package transport

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials"
)

// tlsCredsForTest returns server and client TLS credentials for a
// self-signed certificate of "gdrpc.test".
func tlsCredsForTest(tb testing.TB) (server, client credentials.TransportCredentials) {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(tb, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "gdrpc.test"},
		DNSNames:     []string{"gdrpc.test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(tb, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(tb, err)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	server = credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	client = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "gdrpc.test"})
	return server, client
}

// credsHandshakes runs the gRPC credentials' handshakes of NewCredentials
// (TLS inside) over the two conns at once and returns their errors.
func credsHandshakes(t *testing.T, clientConn, serverConn net.Conn) (clientErr, serverErr error) {
	t.Helper()
	stls, ctls := tlsCredsForTest(t)
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	require.NoError(t, serverConn.SetDeadline(time.Now().Add(handTimeout))) // as gRPC's server does
	srvErr := make(chan error, 1)
	go func() {
		_, ai, err := NewCredentials(stls).ServerHandshake(serverConn)
		if _, isTLS := ai.(credentials.TLSInfo); err == nil && !isTLS {
			t.Errorf("server: AuthInfo %T, want the inner TLSInfo", ai)
		}
		srvErr <- err
	}()
	_, ai, err := NewCredentials(ctls).ClientHandshake(ctx, "gdrpc.test", clientConn)
	if err == nil {
		require.IsType(t, credentials.TLSInfo{}, ai, "the inner AuthInfo")
	}
	return err, <-srvErr
}

// gRPCConns returns the gRPC stream conns of a session pair.
func gRPCConns(t *testing.T, client, server *Session) (net.Conn, net.Conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), handTimeout)
	defer cancel()
	cc, err := client.Conn(ctx)
	require.NoError(t, err)
	sc, err := server.Conn(ctx)
	require.NoError(t, err)
	return cc, sc
}

// TestTLSBinding: TLS inside a session is bound to it; a TLS connection
// relayed by a third process between its session with the client and its
// session with the server (each proven, as the relay's own id) fails at both
// ends, although the TLS handshake itself succeeds.
func TestTLSBinding(t *testing.T) {
	client, relay, server := NewIdentity(), NewIdentity(), NewIdentity()

	t.Run("direct", func(t *testing.T) {
		cs, ss := pipePairWith(t, []Option{WithIdentity(client)}, []Option{WithIdentity(server)})
		cc, sc := gRPCConns(t, cs, ss)
		cerr, serr := credsHandshakes(t, cc, sc)
		require.NoError(t, cerr)
		require.NoError(t, serr)
	})

	t.Run("relayed", func(t *testing.T) {
		cs, rs1 := pipePairWith(t, []Option{WithIdentity(client)}, []Option{WithIdentity(relay)})
		rs2, ss := pipePairWith(t, []Option{WithIdentity(relay)}, []Option{WithIdentity(server)})
		cc, rc1 := gRPCConns(t, cs, rs1)
		rc2, sc := gRPCConns(t, rs2, ss)
		var relaying sync.WaitGroup
		relaying.Add(2)
		go func() { defer relaying.Done(); _, _ = io.Copy(rc2, rc1); _ = rc2.Close() }()
		go func() { defer relaying.Done(); _, _ = io.Copy(rc1, rc2); _ = rc1.Close() }()
		t.Cleanup(func() {
			for _, s := range []*Session{cs, rs1, rs2, ss} {
				_ = s.Close()
			}
			relaying.Wait()
		})

		cerr, serr := credsHandshakes(t, cc, sc)
		const reason = "the TLS channel binding does not verify: the TLS peer is not the session's peer"
		requireIdentityError(t, cerr, relay.ID(), reason)
		requireIdentityError(t, serr, relay.ID(), reason)
	})
}
