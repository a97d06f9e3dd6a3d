package transport

// LeakChecks run after all tests of this package (TestMain in
// session_main_test.go); each returns an error describing a leak. Tests of
// other files of this package may append to it from init.
var LeakChecks []func() error

// TLSCredsForTest returns server and client TLS credentials for a
// self-signed certificate of "gdrpc.test".
var TLSCredsForTest = tlsCredsForTest

// HandshakeHeld is how many live sessions of this process hold s's
// handshake digest.
func HandshakeHeld(s *Session) int {
	registry.Lock()
	defer registry.Unlock()
	return len(registry.handshakes[s.handshake])
}
