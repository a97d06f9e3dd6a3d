package interop_test

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// netnsPair is two network namespaces joined by a veth pair, each end with a
// private address: two hosts on one machine.
type netnsPair struct {
	ns   [2]string // namespace names
	addr [2]string // IPv4 address of each end
}

// ip runs iproute2 and fails the test on error.
func ip(tb testing.TB, args ...string) {
	tb.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	require.NoError(tb, err, "ip %s: %s", strings.Join(args, " "), out)
}

// newNetnsPair creates the namespaces and the veth pair, with names and a
// 10.x.y.0/24 subnet unique to this run, and removes them when the test ends.
// It skips the test (fails it under GDRPC_REQUIRE=netns) when this process is
// not root, iproute2 is missing, or namespaces cannot be created here.
func newNetnsPair(t *testing.T) *netnsPair {
	t.Helper()
	if os.Geteuid() != 0 {
		skipUnless(t, "netns", "network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		skipUnless(t, "netns", "no iproute2: %v", err)
	}
	var r [5]byte
	_, _ = rand.Read(r[:])
	id := hex.EncodeToString(r[:3])
	p := &netnsPair{
		ns:   [2]string{"gdrpc-" + id + "-a", "gdrpc-" + id + "-b"},
		addr: [2]string{fmt.Sprintf("10.%d.%d.1", 100+r[3]%100, r[4]), fmt.Sprintf("10.%d.%d.2", 100+r[3]%100, r[4])},
	}
	veth := [2]string{"vg" + id + "a", "vg" + id + "b"} // at most 15 bytes
	// Cleanups run last-in first-out: this check runs after the removals.
	t.Cleanup(func() {
		out, _ := exec.Command("ip", "netns", "list").CombinedOutput()
		for _, ns := range p.ns {
			if strings.Contains(string(out), ns) {
				t.Errorf("namespace %s left behind", ns)
			}
		}
	})
	if out, err := exec.Command("ip", "netns", "add", p.ns[0]).CombinedOutput(); err != nil {
		skipUnless(t, "netns", "cannot create a network namespace: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", p.ns[0]).Run() })
	ip(t, "netns", "add", p.ns[1])
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", p.ns[1]).Run() })
	ip(t, "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", veth[0]).Run() }) // gone with its namespace if it moved
	for i := range 2 {
		ip(t, "link", "set", veth[i], "netns", p.ns[i])
		ip(t, "-n", p.ns[i], "addr", "add", p.addr[i]+"/24", "dev", veth[i])
		ip(t, "-n", p.ns[i], "link", "set", veth[i], "up")
		ip(t, "-n", p.ns[i], "link", "set", "lo", "up")
	}
	return p
}

// exec returns the command prefix that runs a program in namespace i.
func (p *netnsPair) exec(i int) []string { return []string{"ip", "netns", "exec", p.ns[i]} }

// TestTwoHosts runs a gRPC server in one network namespace and clients in
// another, joined by a veth pair, over UCX tcp, each side with its own
// GDRPC_HOST_ID: a 16 MiB TensorService response and a 16 MiB request travel
// out-of-band and arrive byte-exact, and the gRPC interop cases pass. Over UCX
// with tcp lanes alone, host memory between hosts takes the stream path, as
// over the TCP fallback: transfers this large go on the UCX session's wide
// lane, over TCP, faster than UCX's tcp puts there.
func TestTwoHosts(t *testing.T) {
	p := newNetnsPair(t)
	const n = 16 << 20
	for _, tc := range []transportCase{transportCases[2], transportCases[0]} { // ucx-tcp, tcp
		t.Run("transport="+tc.name, func(t *testing.T) {
			if tc.ucx != "" {
				requireUCX(t)
			}
			const wantPath = "stream"
			srv := startChild(t, "server", p.exec(0), envUCX+"="+tc.ucx, envListen+"="+p.addr[0]+":0", "GDRPC_HOST_ID=gdrpc-test-host-a")
			addr := srv.waitLine("ADDR ")
			require.True(t, strings.HasPrefix(addr, p.addr[0]+":"), "the server listens on its veth address, got %s", addr)
			cl := startChild(t, "make-client", p.exec(1), envUCX+"="+tc.ucx, envAddr+"="+addr,
				fmt.Sprintf("%s=%d", envSize, n), "GDRPC_HOST_ID=gdrpc-test-host-b")
			res := cl.waitLine("OK ")
			require.NoError(t, cl.wait())
			t.Logf("client in %s: %s", p.ns[1], res)
			require.Contains(t, res, "transport="+tc.want())
			require.Contains(t, res, "pulls=map["+wantPath+":1]", "the response payload came out-of-band")
			require.Contains(t, res, "same_host=false", "the peers have different host ids")
			require.Contains(t, res, fmt.Sprintf("wide=%v", tc.ucx != ""), "a UCX session between hosts over tcp alone has a wide lane, a TCP session none")
			want := fmt.Sprintf("make_crc=%08x digest_crc=%08x", crc32cUpdate(0, pattern(n, 5)), crc32cUpdate(0, pattern(n, 6)))
			require.Contains(t, res, want)

			// The gRPC interop cases, from one host to the other.
			ic := startChild(t, "interop-client", p.exec(1), envUCX+"="+tc.ucx, envAddr+"="+addr, "GDRPC_HOST_ID=gdrpc-test-host-b")
			for _, c := range interopCases {
				ic.waitLine("OK " + c.name)
			}
			require.NoError(t, ic.wait())
		})
	}
}
