package transport

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
)

// ErrIdentity reports a peer that did not prove the process id it announced:
// the id is not the one its public key gives, or its signature of the
// handshake does not verify. The error is an *IdentityError.
var ErrIdentity = errors.New("peer did not prove its process id")

// IdentityError is a failed proof of identity in a handshake.
type IdentityError struct {
	Claimed ID     // the process id the peer announced
	Reason  string // what failed
}

func (e *IdentityError) Error() string {
	return fmt.Sprintf("%v: peer announced process id %v: %s", ErrIdentity, e.Claimed, e.Reason)
}

// Is makes errors.Is(err, ErrIdentity) true.
func (e *IdentityError) Is(target error) bool { return target == ErrIdentity }

// Identity is what a process proves itself with: an ed25519 key pair and the
// process id derived from its public key (IDOf). The private key never leaves
// the process; the handshake sends the public key and a signature of the
// handshake's transcript.
type Identity struct {
	id  ID
	pub ed25519.PublicKey
	key ed25519.PrivateKey
}

// NewIdentity returns a fresh identity: a new key pair and its id. Processes
// use LocalIdentity; more identities let tests emulate several processes in
// one (WithIdentity).
func NewIdentity() *Identity {
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		panic("gdrpc: crypto/rand failed: " + err.Error())
	}
	return &Identity{id: IDOf(pub), pub: pub, key: key}
}

// ID returns the process id of the identity.
func (i *Identity) ID() ID { return i.id }

// PublicKey returns the public key the id is derived from.
func (i *Identity) PublicKey() ed25519.PublicKey {
	return append(ed25519.PublicKey(nil), i.pub...)
}

// idDomain separates process id hashes from any other use of SHA-256.
const idDomain = "gdrpc process id\x00"

// IDOf returns the process id of an ed25519 public key: the first 16 bytes of
// SHA-256 over a domain string and the key.
func IDOf(pub ed25519.PublicKey) ID {
	h := sha256.New()
	h.Write([]byte(idDomain))
	h.Write(pub)
	var id ID
	copy(id[:], h.Sum(nil))
	return id
}

var localIdentity = sync.OnceValue(NewIdentity)

// LocalIdentity returns the identity of this process, made on first use and
// fixed for the life of the process.
func LocalIdentity() *Identity { return localIdentity() }

// Handshake signatures. Each side signs the transcript of the handshake so
// far, under a label naming its role, so a signature made for one role or one
// handshake is worth nothing in another:
//
//	server: sign("gdrpc handshake v4\x00server\x00", hello, welcome up to its signature)
//	client: sign("gdrpc handshake v4\x00client\x00", hello, welcome with its signature)
//
// where each message is its frame body, preceded by its length (u32). Both
// bodies carry a fresh random nonce of their sender, so the transcript, and
// every signature over it, is unique to the handshake.
const (
	transcriptLabel = "gdrpc handshake v4\x00"
	roleServerLabel = "server\x00"
	roleClientLabel = "client\x00"
)

// transcript returns the message a side signs: the label, the role and the
// two bodies, each length-prefixed.
func transcript(role string, helloBody, welcomeBody []byte) []byte {
	b := make([]byte, 0, len(transcriptLabel)+len(role)+8+len(helloBody)+len(welcomeBody))
	b = append(b, transcriptLabel...)
	b = append(b, role...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(helloBody)))
	b = append(b, helloBody...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(welcomeBody)))
	return append(b, welcomeBody...)
}

// sessionHash is the digest of a whole handshake (hello, welcome, proof): it
// names the session in what is signed after the handshake (the TLS channel
// binding, creds.go).
func sessionHash(helloBody, welcomeBody, proofBody []byte) [sha256.Size]byte {
	h := sha256.New()
	h.Write([]byte(transcriptLabel))
	for _, b := range [][]byte{helloBody, welcomeBody, proofBody} {
		h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(b))))
		h.Write(b)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// checkClaim checks that the id a peer announced is the one its public key
// gives. self is the local identity: a peer may announce this process's own
// id only by proving it (a session to this very process), never by copying
// it.
func checkClaim(self *Identity, claimed ID, pub publicKey) error {
	if IDOf(pub[:]) == claimed {
		return nil
	}
	if claimed == self.id {
		return &IdentityError{Claimed: claimed, Reason: "it is this process's own id, and the key sent is not this process's"}
	}
	return &IdentityError{Claimed: claimed, Reason: "the id is not derived from the public key sent"}
}

// checkSignature checks that sig is pub's signature of msg (a transcript); the
// claim was checked by checkClaim.
func checkSignature(self *Identity, claimed ID, pub publicKey, msg []byte, sig signature) error {
	if ed25519.Verify(pub[:], msg, sig[:]) {
		return nil
	}
	if claimed == self.id {
		return &IdentityError{Claimed: claimed, Reason: "it is this process's own id, and the handshake signature is not this process's"}
	}
	return &IdentityError{Claimed: claimed, Reason: "the handshake signature does not verify"}
}

// signTranscript returns the identity's signature of msg.
func (i *Identity) signTranscript(msg []byte) signature {
	var sig signature
	copy(sig[:], ed25519.Sign(i.key, msg))
	return sig
}

// publicKey returns the identity's public key in its wire form.
func (i *Identity) publicKey() publicKey {
	var k publicKey
	copy(k[:], i.pub)
	return k
}
