package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A negative -skip or -top, a user's typo, is refused with an error (they
// crashed gdrtrace with a slice bounds panic).
func TestNegativeSkip(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.trace")
	require.NoError(t, os.WriteFile(p, traced(t, 3), 0o644))
	var out bytes.Buffer
	require.NotPanics(t, func() { require.ErrorContains(t, run([]string{"-skip", "-1", p}, &out), "negative") })
}

func TestNegativeTop(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.trace")
	require.NoError(t, os.WriteFile(p, traced(t, 3), 0o644))
	var out bytes.Buffer
	require.NotPanics(t, func() { require.ErrorContains(t, run([]string{"-top", "-1", p}, &out), "negative") })
}

// A trace cut short (a process killed while tracing, a copy interrupted) is
// a file a user passes: gdrtrace must report an error or what it read, never
// panic.
func TestTruncatedTrace(t *testing.T) {
	data := traced(t, 20)
	for _, n := range []int{0, 1, 8, 16, 17, 32, 64, 100, 256, 1000, len(data) / 3, len(data) / 2, len(data) - 100, len(data) - 1} {
		if n < 0 || n > len(data) {
			continue
		}
		require.NotPanics(t, func() { _, _ = read(bytes.NewReader(data[:n]), "gdrperf.call") }, "cut at %d of %d", n, len(data))
	}
	// Every cut, every byte flipped: a foreign or damaged file.
	for n := 0; n < len(data); n += max(1, len(data)/400) {
		d := bytes.Clone(data)
		d[n] ^= 0xff
		require.NotPanics(t, func() { _, _ = read(bytes.NewReader(d), "gdrperf.call") }, "byte %d of %d flipped", n, len(data))
		require.NotPanics(t, func() { _, _ = read(bytes.NewReader(data[:n]), "gdrperf.call") }, "cut at %d of %d", n, len(data))
	}
}
