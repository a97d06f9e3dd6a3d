package wire

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every error a Reader makes wraps ErrMalformed, trailing bytes' included,
// and the first sticks.
func TestErrorsAreMalformed(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    []byte
		read func(r *Reader)
		want string
	}{
		{"short", []byte{1}, func(r *Reader) { r.U16("a") }, "a: need 2 bytes, have 1"},
		{"trailing", []byte{1, 2, 3}, func(r *Reader) { r.U8("a") }, "2 trailing bytes"},
		{"long string", binary.BigEndian.AppendUint16(nil, MaxStringLen+1), func(r *Reader) { r.Str("s") }, "string of 1025 bytes"},
		{"long list", binary.BigEndian.AppendUint16(nil, MaxListLen+1), func(r *Reader) { r.List("l") }, "list of 65 items"},
		{"first sticks", []byte{0, 5, 'a'}, func(r *Reader) { r.Str("first"); r.U64("second") }, "first: need 5 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Reader{B: tc.b}
			tc.read(r)
			err := r.Finish("M")
			require.ErrorIs(t, err, ErrMalformed)
			require.ErrorContains(t, err, "malformed M")
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, err, r.Finish("M"), "the first error sticks")
		})
	}
	r := &Reader{B: []byte{0, 2, 'h', 'i', 0, 1, 0, 1, 'x', 7}}
	require.Equal(t, "hi", r.Str("s"))
	require.Equal(t, []string{"x"}, r.List("l"))
	require.Equal(t, uint8(7), r.U8("b"))
	require.NoError(t, r.End())
}

// No input makes a Reader panic, read past its body or return an error that
// is not ErrMalformed.
func FuzzReader(f *testing.F) {
	f.Add([]byte{0, 2, 'h', 'i', 0, 1, 0, 0}, "sLbq")
	f.Add(binary.BigEndian.AppendUint16(nil, 0xffff), "L")
	f.Fuzz(func(t *testing.T, b []byte, ops string) {
		r := &Reader{B: b}
		n := 0
		for _, op := range ops {
			before := len(r.B)
			switch op {
			case 'b':
				r.U8("b")
			case 'h':
				r.U16("h")
			case 'q':
				r.U64("q")
			case 's':
				if s := r.Str("s"); len(s) > MaxStringLen {
					t.Fatalf("a string of %d bytes", len(s))
				}
			case 'L':
				if l := r.List("L"); len(l) > MaxListLen {
					t.Fatalf("a list of %d strings", len(l))
				}
			case 'r':
				r.Raw(make([]byte, 3), "r")
			}
			if len(r.B) > before {
				t.Fatal("the body grew")
			}
			n += before - len(r.B)
		}
		if n > len(b) {
			t.Fatalf("read %d bytes of %d", n, len(b))
		}
		if err := r.End(); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("%v is not ErrMalformed", err)
		}
		if err := r.Finish("x"); err != nil && !strings.HasPrefix(err.Error(), "malformed x: ") {
			t.Fatalf("Finish: %v", err)
		}
	})
}
