package rdma

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"testing"

	"github.com/stretchr/testify/require"
)

// Packed rkeys as UCX 1.13 made them here: shm (tcp, sysv, posix domains) for
// UCX-allocated memory, and tcp.
var sampleRkeys = []string{
	"0b0000000000000000000c2500080000c035a3407f00000000",
	"0900000000000000000000",
	"01000000000000000000",
}

func sampleKeys(t testing.TB) [][]byte {
	var out [][]byte
	for _, s := range sampleRkeys {
		rk, err := hex.DecodeString(s)
		require.NoError(t, err)
		out = append(out, encodeKey(packedKey{memType: MemoryHost, base: 0x7f0000001000, length: 4096, rkey: rk}))
	}
	return out
}

func TestKeyFraming(t *testing.T) {
	for _, k := range sampleKeys(t) {
		pk, err := decodeKey(k)
		require.NoError(t, err)
		require.NoError(t, validateRkey(pk.rkey, pk.memType))
		require.Equal(t, k, encodeKey(pk))
		require.True(t, pk.contains(0x7f0000001000, 4096))
		require.True(t, pk.contains(0x7f0000002000, 0))
		require.False(t, pk.contains(0x7f0000001001, 4096))
		require.False(t, pk.contains(0x7f0000000fff, 1))
		require.False(t, pk.contains(^uint64(0), 2))
	}
	good := sampleKeys(t)[0]
	tests := []struct {
		name string
		mut  func([]byte) []byte
	}{
		{"empty", func([]byte) []byte { return nil }},
		{"truncated header", func(b []byte) []byte { return b[:27] }},
		{"truncated rkey", func(b []byte) []byte { return b[:len(b)-1] }},
		{"trailing byte", func(b []byte) []byte { return append(b, 0) }},
		{"bad magic", func(b []byte) []byte { b[0] = 'X'; return b }},
		{"version 2", func(b []byte) []byte { b[4] = 2; return b }},
		{"memory type 7", func(b []byte) []byte { b[5] = 7; return b }},
		{"reserved", func(b []byte) []byte { b[7] = 1; return b }},
		{"zero length region", func(b []byte) []byte { clear(b[16:24]); return b }},
		{"wrapping region", func(b []byte) []byte { copy(b[8:16], bytes.Repeat([]byte{0xff}, 8)); return b }},
		{"rkey length zero", func(b []byte) []byte { clear(b[24:28]); return b[:28] }},
		{"rkey length huge", func(b []byte) []byte { b[24] = 0xff; return b }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decodeKey(tt.mut(bytes.Clone(good)))
			require.ErrorIs(t, err, ErrBadKey)
		})
	}
	rkeyTests := []struct {
		name string
		rkey string
	}{
		{"short", "0b00000000"},
		{"no domain", "000000000000000000"},
		{"memory type", "01000000000000004000"},
		{"memory type not the header's", "01000000000000000100"},
		{"memory type past UCX's", "01000000000000001600"},
		{"domain length past end", "01000000000000000005aabb"},
		{"missing domain", "03000000000000000000"},
		{"long trailer", "01000000000000000000" + hex.EncodeToString(make([]byte, 65))},
	}
	for _, tt := range rkeyTests {
		t.Run("rkey "+tt.name, func(t *testing.T) {
			b, err := hex.DecodeString(tt.rkey)
			require.NoError(t, err)
			require.ErrorIs(t, validateRkey(b, MemoryHost), ErrBadKey)
		})
	}
}

// FuzzKeyFraming: the parser of our framing and the rkey walk return an
// error or a key, never crash, and a parsed key re-encodes to its input.
func FuzzKeyFraming(f *testing.F) {
	for _, k := range sampleKeys(f) {
		f.Add(k)
	}
	f.Add([]byte("GDRK"))
	f.Fuzz(func(t *testing.T, b []byte) {
		pk, err := decodeKey(b)
		if err != nil {
			return
		}
		if !bytes.Equal(encodeKey(pk), b) {
			t.Fatalf("re-encoding differs")
		}
		_ = validateRkey(pk.rkey, pk.memType)
	})
}

func TestRMADomains(t *testing.T) {
	const oneHost = `#                 lane[0]: cm rdmacm
#                 lane[1]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] am am_bw#0 keepalive
#                 lane[2]:  4:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255]
#                 lane[3]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] rma_bw#0 wireup
#                 lane[4]:  6:cuda_ipc/cuda.0 md[5]         -> md[5]/cuda_ipc/sysdev[255] rma_bw#1
`
	require.Equal(t, []string{"tcp", "cuda_ipc"}, rmaDomains(oneHost))
	const nic = `#                 lane[1]:  1:mlx5_0:1/rc_mlx5.0 md[0]      -> md[0]/ib/mlx5_0:1 rma_bw#0 am am_bw#0
#                 lane[2]:  2:tcp/eth0.0 md[1]               -> md[1]/tcp/sysdev[255] am_bw#1 wireup
`
	require.Equal(t, []string{"ib"}, rmaDomains(nic))
	require.Empty(t, rmaDomains(""))
}

// laneKey keeps the components of lane domains alone, in order, with what
// follows them, and zeroed slack after the copy.
func TestLaneKey(t *testing.T) {
	rk := binary.LittleEndian.AppendUint64(nil, 1<<1|1<<2|1<<4)
	rk = append(rk, 1)                   // memory type: CUDA
	rk = append(rk, 2, 0xa1, 0xa2)       // md 1
	rk = append(rk, 3, 0xb1, 0xb2, 0xb3) // md 2
	rk = append(rk, 1, 0xc1)             // md 4
	rk = append(rk, 0xee, 0x10, 0x20)    // system device and a distance
	require.NoError(t, validateRkey(rk, MemoryCUDA))
	require.ErrorIs(t, validateRkey(rk, MemoryHost), ErrBadKey)
	got := laneKey(rk, map[int]string{1: "tcp", 4: "cma", 7: "ib"})
	want := binary.LittleEndian.AppendUint64(nil, 1<<1|1<<4)
	want = append(want, 1, 2, 0xa1, 0xa2, 1, 0xc1, 0xee, 0x10, 0x20)
	require.Equal(t, want, got)
	require.GreaterOrEqual(t, cap(got)-len(got), rkeySlack)
	require.Equal(t, make([]byte, cap(got)-len(got)), got[len(got):cap(got)])
	require.NoError(t, validateRkey(got, MemoryCUDA))

	none := laneKey(rk, map[int]string{7: "ib"})
	require.Equal(t, uint64(0), rkeyDomains(none))
	require.Equal(t, []byte{1, 0xee, 0x10, 0x20}, none[8:])
	require.Equal(t, []string{"cma", "tcp"}, keyDomains(rk, map[int]string{1: "tcp", 4: "cma", 7: "ib"}))
}
