// Package wire holds what gdrpc's binary messages share: a reader of
// big-endian fields whose first error sticks, and the bounds on strings and
// lists. The handshake (package transport) and the rendezvous (package oob)
// parse with it.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrMalformed is wrapped by every error a Reader makes.
var ErrMalformed = errors.New("malformed message")

// Bounds of the variable-length fields.
const (
	MaxStringLen = 1 << 10 // bytes of a string
	MaxListLen   = 64      // strings of a list
)

// Malformed returns an error wrapping ErrMalformed.
func Malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// Reader parses a message body B; the first error sticks in Err, and later
// reads return zero values.
type Reader struct {
	B   []byte
	Err error
}

// Take returns the next n bytes (a slice of B).
func (r *Reader) Take(n int, what string) []byte {
	if r.Err != nil {
		return nil
	}
	if n < 0 || len(r.B) < n {
		r.Err = Malformed("%s: need %d bytes, have %d", what, n, len(r.B))
		return nil
	}
	v := r.B[:n]
	r.B = r.B[n:]
	return v
}

// U8 reads one byte.
func (r *Reader) U8(what string) uint8 {
	if v := r.Take(1, what); v != nil {
		return v[0]
	}
	return 0
}

// U16 reads a big-endian uint16.
func (r *Reader) U16(what string) uint16 {
	if v := r.Take(2, what); v != nil {
		return binary.BigEndian.Uint16(v)
	}
	return 0
}

// U64 reads a big-endian uint64.
func (r *Reader) U64(what string) uint64 {
	if v := r.Take(8, what); v != nil {
		return binary.BigEndian.Uint64(v)
	}
	return 0
}

// Raw fills dst with the next len(dst) bytes.
func (r *Reader) Raw(dst []byte, what string) {
	copy(dst, r.Take(len(dst), what))
}

// Str reads a string: [length u16][bytes], at most MaxStringLen bytes.
func (r *Reader) Str(what string) string {
	n := int(r.U16(what))
	if r.Err == nil && n > MaxStringLen {
		r.Err = Malformed("%s: string of %d bytes (max %d)", what, n, MaxStringLen)
	}
	return string(r.Take(n, what))
}

// List reads a list of strings: [count u16][string]..., at most MaxListLen.
func (r *Reader) List(what string) []string {
	n := int(r.U16(what))
	if r.Err != nil {
		return nil
	}
	if n > MaxListLen {
		r.Err = Malformed("%s: list of %d items (max %d)", what, n, MaxListLen)
		return nil
	}
	var l []string
	for range n {
		s := r.Str(what)
		if r.Err != nil {
			return nil
		}
		l = append(l, s)
	}
	return l
}

// End reports the first error, or bytes left after the last field.
func (r *Reader) End() error {
	if r.Err == nil && len(r.B) != 0 {
		r.Err = Malformed("%d trailing bytes", len(r.B))
	}
	return r.Err
}

// Finish is End, its error naming the message: malformed what.
func (r *Reader) Finish(what string) error {
	if err := r.End(); err != nil {
		return fmt.Errorf("malformed %s: %w", what, err)
	}
	return nil
}
