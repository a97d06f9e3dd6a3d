package devicebuf_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

func TestMain(m *testing.M) {
	devicebuftest.Main(m)
}

// pattern returns n pseudo-random bytes determined by seed. Above 64 KiB a random 64 KiB
// block repeats, each 4 KiB page stamped with its index, so that misplaced pages still show.
func pattern(seed uint64, n int) []byte {
	var key [32]byte
	key[0], key[1], key[2] = byte(seed), byte(seed>>8), byte(seed>>16)
	b := make([]byte, n)
	const block = 64 << 10
	_, _ = rand.NewChaCha8(key).Read(b[:min(n, block)])
	for off := block; off < n; off += block {
		copy(b[off:], b[:block])
	}
	for page := 1; page*4096+8 <= n; page++ {
		binary.LittleEndian.PutUint64(b[page*4096:], uint64(page)^seed<<32)
	}
	return b
}

// requireBytes fails unless got equals want, naming the first differing byte.
func requireBytes(tb testing.TB, want, got []byte, msg string) {
	tb.Helper()
	require.Equal(tb, len(want), len(got), "%s: length", msg)
	if !bytes.Equal(want, got) {
		i := 0
		for i < len(want) && want[i] == got[i] {
			i++
		}
		tb.Fatalf("%s: bytes differ first at %d of %d (want %#x, got %#x)", msg, i, len(want), want[i], got[i])
	}
}

// requireLive fails unless devicebuf's live counters are back to base.
func requireLive(tb testing.TB, base devicebuf.Counters) {
	tb.Helper()
	require.Equal(tb, devicebuf.Counters{}, devicebuf.Live().Sub(base), "live objects left")
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

var errClosed = net.ErrClosed
