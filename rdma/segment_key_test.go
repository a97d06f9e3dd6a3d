//go:build cgo && !nordma && linux

package rdma_test

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/bits"
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/rdma"
)

// forgedKey frames comp as the key of the peer's memory domain md, for a
// region of n bytes at addr.
func forgedKey(md int, comp []byte, addr, n uint64) []byte {
	rk := binary.LittleEndian.AppendUint64(nil, 1<<md)
	rk = append(rk, 0, byte(len(comp)))
	rk = append(rk, comp...)
	packed := make([]byte, 28, 28+len(rk))
	copy(packed, "GDRK")
	packed[4] = 1 // key version, host memory
	binary.BigEndian.PutUint64(packed[8:], addr)
	binary.BigEndian.PutUint64(packed[16:], n)
	binary.BigEndian.PutUint32(packed[24:], uint32(len(rk)))
	return append(packed, rk...)
}

// laneMD returns the index of the peer's memory domain of kind component that
// a lane of ep reaches, or -1.
func laneMD(t *testing.T, ep *rdma.Endpoint, component string) int {
	m := regexp.MustCompile(`->\s*md\[(\d+)\]/` + component + `/`).FindStringSubmatch(ep.TransportInfo())
	if m == nil {
		return -1
	}
	i, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	return i
}

// A key naming a shared-memory segment that does not attach (a receiver that
// died after it sent its key, or a forged key) is refused with an error: UCX's
// unpack, whose error path crashes, never sees it. Keys of live segments still
// unpack.
func TestUnpackKeyDeadSegment(t *testing.T) {
	c := defaultContext(t)
	client, _ := pair(t, c)
	const addr, n = 0x10000000, 4096

	posix := laneMD(t, client, "posix")
	if posix < 0 {
		t.Skipf("no posix lane: %s", client.TransportInfo())
	}
	comp := binary.LittleEndian.AppendUint64(nil, 1<<63|1<<62|uint64(1<<29)<<30|uint64(os.Getpid()))
	comp = binary.LittleEndian.AppendUint64(comp, addr)
	comp = binary.LittleEndian.AppendUint64(comp, n)
	_, err := client.UnpackKey(forgedKey(posix, comp, addr, n))
	require.ErrorIs(t, err, rdma.ErrBadKey)
	require.ErrorContains(t, err, "does not open")

	f, err := os.CreateTemp(t.TempDir(), "model") // a file this process holds: no UCX segment
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(n))
	comp = binary.LittleEndian.AppendUint64(nil, 1<<63|1<<62|uint64(f.Fd())<<30|uint64(os.Getpid()))
	comp = binary.LittleEndian.AppendUint64(comp, addr)
	comp = binary.LittleEndian.AppendUint64(comp, n)
	_, err = client.UnpackKey(forgedKey(posix, comp, addr, n))
	require.ErrorContains(t, err, "no UCX segment")

	if sysv := laneMD(t, client, "sysv"); sysv >= 0 {
		comp := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, 0x7fff_fff0), addr)
		_, err = client.UnpackKey(forgedKey(sysv, comp, addr, n))
		require.ErrorContains(t, err, "does not attach")
	}

	// A live segment's key.
	m, err := c.Alloc(1 << 20)
	require.NoError(t, err)
	defer m.Close()
	packed, err := m.PackKey()
	require.NoError(t, err)
	k, err := client.UnpackKey(packed)
	require.NoError(t, err)
	require.NoError(t, k.Close())
	// The same key, for an endpoint whose peer is another process: the
	// segment is this process's own.
	_, err = client.UnpackForeignKey(packed)
	require.ErrorIs(t, err, rdma.ErrBadKey)
	require.ErrorContains(t, err, "this process's own")
}

// UCX unpacks a component of a key for every memory domain of the peer it
// reaches, lanes or not, and only those of lanes are known by kind, so
// checked: the others never reach UCX. With shared memory's error handling
// off, sysv and posix are no lanes but stay reachable; a key naming a sysv
// segment that does not attach unpacks without it (UCX's unpack would crash
// on it), and a live segment's key is no direct copy.
func TestUnpackKeyKeepsLaneDomains(t *testing.T) {
	c := defaultContext(t)
	probe, _ := pair(t, c)
	sysv, tcp := laneMD(t, probe, "sysv"), laneMD(t, probe, "tcp")
	if sysv < 0 || tcp < 0 {
		t.Skipf("no sysv and tcp lanes: %s", probe.TransportInfo())
	}

	nc, err := rdma.NewContext(rdma.WithConfig("MM_ERROR_HANDLING", "n"))
	require.NoError(t, err)
	defer nc.Close()
	client, _ := pair(t, nc)
	if laneMD(t, client, "sysv") >= 0 || laneMD(t, client, "tcp") != tcp {
		t.Skipf("sysv is still a lane, or tcp moved: %s", client.TransportInfo())
	}
	const addr, n = 0x10000000, 4096
	bad := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, 0x7fff_fff0), addr)
	rk := binary.LittleEndian.AppendUint64(nil, 1<<tcp|1<<sysv)
	rk = append(rk, 0)
	for md := range 64 {
		switch md {
		case tcp:
			rk = append(rk, 0)
		case sysv:
			rk = append(rk, byte(len(bad)))
			rk = append(rk, bad...)
		}
	}
	forged := make([]byte, 28, 28+len(rk))
	copy(forged, "GDRK")
	forged[4] = 1
	binary.BigEndian.PutUint64(forged[8:], addr)
	binary.BigEndian.PutUint64(forged[16:], n)
	binary.BigEndian.PutUint32(forged[24:], uint32(len(rk)))
	forged = append(forged, rk...)
	doms, err := client.KeyDomains(forged)
	require.NoError(t, err)
	require.Equal(t, []string{"tcp"}, doms)
	k, err := client.UnpackKey(forged)
	require.NoError(t, err, "the sysv component goes, the tcp one stays")
	require.False(t, k.Direct())
	require.Equal(t, []string{"tcp"}, k.Domains())
	require.NoError(t, k.Close())

	m, err := nc.Alloc(1 << 20)
	require.NoError(t, err)
	defer m.Close()
	packed, err := m.PackKey()
	require.NoError(t, err)
	doms, err = client.KeyDomains(packed)
	require.NoError(t, err)
	require.Equal(t, []string{"tcp"}, doms)
	k, err = client.UnpackKey(packed)
	require.NoError(t, err)
	require.False(t, k.Direct(), "a segment of no lane is not attached")
	require.NoError(t, k.Close())
}

// keyComponents splits a packed key into its region and the components of
// its rkey, by the peer's memory domain.
func keyComponents(packed []byte) (comps map[int][]byte, base, n uint64) {
	base, n = binary.BigEndian.Uint64(packed[8:]), binary.BigEndian.Uint64(packed[16:])
	rk := packed[28:]
	comps = map[int][]byte{}
	p := 9
	for mds := binary.LittleEndian.Uint64(rk); mds != 0; mds &= mds - 1 {
		l := int(rk[p])
		comps[bits.TrailingZeros64(mds)] = rk[p+1 : p+1+l]
		p += 1 + l
	}
	return comps, base, n
}

// A put or get through a posix or sysv key reaches the region's address less
// the address the component gives its segment in the owner, plus where this
// process attached the segment, unbounded by UCX: a key of a live segment
// whose component moves that address (a forged key) would reach this
// process's other memory, and one flagged for huge pages that its file is
// not on makes UCX's unpack fail, and crash. Both are refused.
func TestUnpackKeyComponentOutsideRegion(t *testing.T) {
	c := defaultContext(t)
	client, _ := pair(t, c)
	m, err := c.Alloc(1 << 20)
	require.NoError(t, err)
	defer m.Close()
	packed, err := m.PackKey()
	require.NoError(t, err)
	comps, base, n := keyComponents(packed)
	tried := 0
	for _, tc := range []struct {
		component string
		at        int // where the component holds its segment's address in the owner
	}{{"posix", 8}, {"sysv", 4}} {
		md := laneMD(t, client, tc.component)
		comp, ok := comps[md]
		if md < 0 || !ok {
			continue
		}
		tried++
		k, err := client.UnpackKey(forgedKey(md, comp, base, n))
		require.NoError(t, err, "%s: the component as packed", tc.component)
		require.NoError(t, k.Close())
		for _, shift := range []uint64{4096, 1 << 40, math.MaxUint64 - 4095} { // the last moves it down a page
			forged := bytes.Clone(comp)
			binary.LittleEndian.PutUint64(forged[tc.at:], binary.LittleEndian.Uint64(comp[tc.at:])+shift)
			_, err := client.UnpackKey(forgedKey(md, forged, base, n))
			require.ErrorIs(t, err, rdma.ErrBadKey, "%s moved by %#x", tc.component, shift)
			require.ErrorContains(t, err, "outside its segment")
		}
		if tc.component == "posix" {
			forged := bytes.Clone(comp)
			binary.LittleEndian.PutUint64(forged, binary.LittleEndian.Uint64(comp)|1<<61) // UCT_POSIX_SEG_FLAG_HUGETLB
			_, err := client.UnpackKey(forgedKey(md, forged, base, n))
			require.ErrorIs(t, err, rdma.ErrBadKey)
			require.ErrorContains(t, err, "huge pages")
		}
	}
	if tried == 0 {
		t.Skipf("no posix or sysv component on a lane: %s", client.TransportInfo())
	}
}
