package rdma

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"regexp"
	"slices"
	"strconv"
)

// Packed remote key framing (all integers big-endian):
//
//	offset size
//	0      4    magic "GDRK"
//	4      1    version (1)
//	5      1    memory type of the region
//	6      2    reserved, zero
//	8      8    base address of the registered region
//	16     8    length of the registered region
//	24     4    length n of the UCX rkey buffer (1 .. maxRkeyLen)
//	28     n    the UCX rkey buffer (ucp_rkey_pack output)
//
// Nothing may follow the rkey buffer.
const (
	keyMagic      = "GDRK"
	keyVersion    = 1
	keyHeaderLen  = 28
	maxRkeyLen    = 64 << 10
	maxRegionSize = 1 << 50
)

// ErrBadKey reports a packed remote key that does not parse.
var ErrBadKey = errors.New("rdma: bad packed remote key")

// packedKey is a parsed packed remote key.
type packedKey struct {
	memType MemoryType
	base    uint64
	length  uint64
	rkey    []byte // aliases the input
}

func encodeKey(k packedKey) []byte {
	b := make([]byte, keyHeaderLen+len(k.rkey))
	copy(b, keyMagic)
	b[4] = keyVersion
	b[5] = byte(k.memType)
	binary.BigEndian.PutUint64(b[8:], k.base)
	binary.BigEndian.PutUint64(b[16:], k.length)
	binary.BigEndian.PutUint32(b[24:], uint32(len(k.rkey)))
	copy(b[keyHeaderLen:], k.rkey)
	return b
}

func decodeKey(b []byte) (packedKey, error) {
	if len(b) < keyHeaderLen {
		return packedKey{}, fmt.Errorf("%w: %d bytes, header needs %d", ErrBadKey, len(b), keyHeaderLen)
	}
	if string(b[:4]) != keyMagic {
		return packedKey{}, fmt.Errorf("%w: bad magic %q", ErrBadKey, b[:4])
	}
	if b[4] != keyVersion {
		return packedKey{}, fmt.Errorf("%w: version %d, want %d", ErrBadKey, b[4], keyVersion)
	}
	mt := MemoryType(b[5])
	if mt != MemoryHost && mt != MemoryCUDA {
		return packedKey{}, fmt.Errorf("%w: memory type %d", ErrBadKey, b[5])
	}
	if b[6] != 0 || b[7] != 0 {
		return packedKey{}, fmt.Errorf("%w: reserved bytes set", ErrBadKey)
	}
	base := binary.BigEndian.Uint64(b[8:])
	length := binary.BigEndian.Uint64(b[16:])
	if length == 0 || length > maxRegionSize || base+length < base {
		return packedKey{}, fmt.Errorf("%w: region %#x+%d", ErrBadKey, base, length)
	}
	n := binary.BigEndian.Uint32(b[24:])
	if n == 0 || n > maxRkeyLen {
		return packedKey{}, fmt.Errorf("%w: rkey length %d", ErrBadKey, n)
	}
	if uint64(len(b)-keyHeaderLen) != uint64(n) {
		return packedKey{}, fmt.Errorf("%w: rkey length %d, %d bytes follow the header", ErrBadKey, n, len(b)-keyHeaderLen)
	}
	return packedKey{memType: mt, base: base, length: length, rkey: b[keyHeaderLen:]}, nil
}

// contains reports whether [addr, addr+n) lies inside the key's region.
func (k *packedKey) contains(addr uint64, n int) bool {
	if n < 0 || addr < k.base {
		return false
	}
	off := addr - k.base
	return off <= k.length && uint64(n) <= k.length-off
}

// validateRkey checks the structure of UCX's packed rkey before UCX parses
// it: ucp_ep_rkey_unpack takes no length and trusts the buffer. The layout
// (UCX 1.13 to 1.18): a little-endian uint64 bitmap of memory domains, one
// byte of memory type, then for each bit set one byte of length and that many
// bytes of the transport's key; a short trailer (system device information)
// may follow. The memory type must be mt, the one the key's header names:
// gdrpc maps memory as host or CUDA alone, naming the type to UCX, whose
// values for them (UCS_MEMORY_TYPE_HOST, _CUDA) are MemoryType's; and UCX's
// newer protocol selection indexes arrays by the type unchecked, so another
// value is a read past their end.
func validateRkey(b []byte, mt MemoryType) error {
	const maxTrailer = 64
	if len(b) < 9 {
		return fmt.Errorf("%w: rkey of %d bytes", ErrBadKey, len(b))
	}
	mdMap := binary.LittleEndian.Uint64(b)
	if mdMap == 0 {
		return fmt.Errorf("%w: rkey names no memory domain", ErrBadKey)
	}
	if b[8] != byte(mt) {
		return fmt.Errorf("%w: rkey memory type %d, the key's header says %v", ErrBadKey, b[8], mt)
	}
	p := 9
	for ; mdMap != 0; mdMap &= mdMap - 1 {
		if p >= len(b) {
			return fmt.Errorf("%w: rkey truncated", ErrBadKey)
		}
		p += 1 + int(b[p])
		if p > len(b) {
			return fmt.Errorf("%w: rkey truncated", ErrBadKey)
		}
	}
	if len(b)-p > maxTrailer {
		return fmt.Errorf("%w: %d unexpected bytes after the rkey", ErrBadKey, len(b)-p)
	}
	return nil
}

// rkeySlack is the zeroed room UnpackKey leaves after a copied rkey: what a
// transport's key may be read past a component the peer cut short (a size
// byte counts at most 255).
const rkeySlack = 256

// rkeyDomains returns the bitmap of memory domains b, an rkey, carries.
func rkeyDomains(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }

// laneMask returns the bitmap of the memory domains in lanes.
func laneMask(lanes map[int]string) uint64 {
	var m uint64
	for i := range lanes {
		m |= 1 << i
	}
	return m
}

// laneKey returns a copy of b, an rkey validateRkey accepted, that carries
// the components of the memory domains in lanes alone, followed by
// rkeySlack zeroes (UCX reads each transport's key at that transport's
// size, whatever size byte the peer wrote: they keep a short last
// component's reads inside the copy). What follows the components (system
// device and distances) is kept as it came: it does not depend on them.
func laneKey(b []byte, lanes map[int]string) []byte {
	out := make([]byte, 9, len(b)+rkeySlack)
	out[8] = b[8]
	var kept uint64
	p := 9
	for m := rkeyDomains(b); m != 0; m &= m - 1 {
		md := bits.TrailingZeros64(m)
		n := int(b[p])
		if _, ok := lanes[md]; ok {
			kept |= 1 << md
			out = append(out, b[p:p+1+n]...)
		}
		p += 1 + n
	}
	out = append(out, b[p:]...)
	binary.LittleEndian.PutUint64(out, kept)
	return out
}

// rkeyComponents calls fn with each memory domain index that b, an rkey
// validateRkey accepted, carries and the bytes of its transport's key, in
// order, until fn returns an error.
func rkeyComponents(b []byte, fn func(md int, comp []byte) error) error {
	mdMap := rkeyDomains(b)
	p := 9
	for ; mdMap != 0; mdMap &= mdMap - 1 {
		n := int(b[p])
		if err := fn(bits.TrailingZeros64(mdMap), b[p+1:p+1+n]); err != nil {
			return err
		}
		p += 1 + n
	}
	return nil
}

// laneComponents maps the peer's memory domain indices that the lanes in info
// (ucp_ep_print_info's text) reach to their components.
func laneComponents(info string) map[int]string {
	out := map[int]string{}
	for _, m := range laneDomain.FindAllStringSubmatch(info, -1) {
		if i, err := strconv.Atoi(m[1]); err == nil && i < 64 {
			out[i] = m[2]
		}
	}
	return out
}

// laneDomain matches a lane of ucp_ep_print_info's text and captures the
// peer's memory domain index and component: "-> md[1]/sysv/sysdev[255]".
var laneDomain = regexp.MustCompile(`->\s*md\[(\d+)\]/([A-Za-z0-9_]+)/`)

// keyDomains returns the components (UCX memory domain kinds: "tcp", "ib",
// "sysv", "posix", "cma", "cuda_ipc", ...) of the peer's memory domains that
// rkey, a key validateRkey accepted, carries and that lanes (laneComponents)
// reach: the transports a put with the key may take. A key carrying none of
// them makes UCX emulate the put with active messages the peer applies.
func keyDomains(rkey []byte, lanes map[int]string) []string {
	mdMap := rkeyDomains(rkey)
	var out []string
	for i, component := range lanes {
		if mdMap&(1<<i) != 0 && !slices.Contains(out, component) {
			out = append(out, component)
		}
	}
	slices.Sort(out)
	return out
}

// rmaLane matches a lane of ucp_ep_print_info's text that carries rma_bw and
// captures the peer's memory domain component.
var rmaLane = regexp.MustCompile(`->\s*md\[\d+\]/([A-Za-z0-9_]+)/\S*[^\n]*\brma_bw\b`)

// rmaDomains returns the memory domain components the rma_bw lanes in info
// reach, each once.
func rmaDomains(info string) []string {
	var out []string
	for _, m := range rmaLane.FindAllStringSubmatch(info, -1) {
		if !slices.Contains(out, m[1]) {
			out = append(out, m[1])
		}
	}
	return out
}
