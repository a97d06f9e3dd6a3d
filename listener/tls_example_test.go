package listener_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log"
	"math/big"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"

	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/dialer"
	"github.com/gdrpc/gdrpc/listener"
)

// tlsHealth answers health checks and says how the caller reached it.
type tlsHealth struct {
	healthpb.UnimplementedHealthServer
}

func (tlsHealth) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	// The peer's AuthInfo is the TLS credentials' own, so certificate-based
	// authorization works as without gdrpc; the session is found from the
	// call's context.
	p, _ := peer.FromContext(ctx)
	ti := p.AuthInfo.(credentials.TLSInfo)
	over := "no session (a plain gRPC client)"
	if sess := gdrpc.SessionFromContext(ctx); sess != nil {
		over = "session over " + sess.Transport()
	}
	fmt.Printf("handler: %s, %s\n", tls.VersionName(ti.State.Version), over)
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

// selfSigned returns a certificate for 127.0.0.1 and a pool that trusts it.
func selfSigned() (tls.Certificate, *x509.CertPool) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		log.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		log.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool
}

// TLS over gdrpc: the server passes its credentials to ServerOptions and the
// client to DialOptions; both wrap them, binding the TLS connection to the
// gdrpc session. TLS protects the gRPC stream only: payloads moved
// out-of-band (RDMA writes, CUDA IPC copies, bulk streams) are not encrypted.
// Mutual TLS works the same way (ClientAuth and client certificates in the
// tls.Configs).
func ExampleServerOptions_tls() {
	cert, pool := selfSigned()

	lis, err := listener.Listen("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	serverCreds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})
	srv := grpc.NewServer(listener.ServerOptions(serverCreds)...)
	healthpb.RegisterHealthServer(srv, tlsHealth{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	clientCreds := credentials.NewTLS(&tls.Config{RootCAs: pool})
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), dialer.New().DialOptions(clientCreds)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	var p peer.Peer // the client's view of the call's peer
	resp, err := healthpb.NewHealthClient(cc).Check(context.Background(), &healthpb.HealthCheckRequest{}, grpc.Peer(&p))
	if err != nil {
		log.Fatal(err)
	}
	ti := p.AuthInfo.(credentials.TLSInfo)
	fmt.Printf("client: %s, server certificate for %v, session over %s\n",
		resp.GetStatus(), ti.State.PeerCertificates[0].IPAddresses[0], gdrpc.SessionFromPeer(&p).Transport())
	// Output:
	// handler: TLS 1.3, session over tcp
	// client: SERVING, server certificate for 127.0.0.1, session over tcp
}
