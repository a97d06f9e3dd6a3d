package dialer_test

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

// netnsPair creates two network namespaces joined by a veth pair and returns
// their names and the server's IP; everything is removed when the test ends.
func netnsPair(t *testing.T) (nsA, nsB, ipA string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("two-host test needs root (network namespaces)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("two-host test needs iproute2 (ip)")
	}
	var r [3]byte
	_, _ = rand.Read(r[:])
	tag := hex.EncodeToString(r[:])
	nsA, nsB = "gdrpc-a-"+tag, "gdrpc-b-"+tag
	vA, vB := "gdv"+tag+"a", "gdv"+tag+"b"
	ipA, ipB := fmt.Sprintf("10.251.%d.1", r[0]), fmt.Sprintf("10.251.%d.2", r[0])
	run := func(args ...string) {
		t.Helper()
		out, err := exec.Command("ip", args...).CombinedOutput()
		require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
	}
	run("netns", "add", nsA)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", nsA).Run() })
	run("netns", "add", nsB)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", nsB).Run() })
	run("link", "add", vA, "type", "veth", "peer", "name", vB)
	run("link", "set", vA, "netns", nsA)
	run("link", "set", vB, "netns", nsB)
	run("-n", nsA, "addr", "add", ipA+"/24", "dev", vA)
	run("-n", nsB, "addr", "add", ipB+"/24", "dev", vB)
	for _, x := range [][2]string{{nsA, vA}, {nsB, vB}} {
		run("-n", x[0], "link", "set", "lo", "up")
		run("-n", x[0], "link", "set", x[1], "up")
	}
	return nsA, nsB, ipA
}

// TestTwoHosts runs a gRPC server in one network namespace and a client in
// another, each with its own host id, over UCX tcp across a veth pair.
func TestTwoHosts(t *testing.T) {
	ucxContext(t, "tcp") // skips (or fails under GDRPC_REQUIRE=ucx) without UCX
	nsA, nsB, ipA := netnsPair(t)
	_, line := startChild(t, []string{"ip", "netns", "exec", nsA}, "grpc-server",
		"GDRPC_TEST_LISTEN="+ipA+":0", "GDRPC_TEST_UCX=tcp", "GDRPC_HOST_ID=host-a")
	addr, ok := strings.CutPrefix(line, "ADDR ")
	require.True(t, ok, "server said %q", line)
	require.True(t, strings.HasPrefix(addr, ipA+":"), addr)
	_, line = startChild(t, []string{"ip", "netns", "exec", nsB}, "grpc-client",
		"GDRPC_TEST_ADDR="+addr, "GDRPC_TEST_UCX=tcp", "GDRPC_HOST_ID=host-b")
	require.Equal(t, "OK transport=ucx samehost=false", line)
}
