//go:build cgo && !nordma && linux

package rdma_test

import (
	"bytes"
	"encoding/binary"
	"os/exec"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/gdrpc/gdrpc/rdma"
)

// A key whose sysv component names a segment that is no UCX segment (one
// another program created under a key of its own, as ipcmk does) is refused:
// UCX would attach it for writing with this process's rights, and the puts
// and gets through the key would reach that program's memory, which no peer
// exposed.
func TestSysvKeyOfOtherProgram(t *testing.T) {
	c := newContext(t, transports[0].tls)
	client, _ := pair(t, c)
	md := laneMD(t, client, "sysv")
	if md < 0 {
		t.Skipf("no sysv lane: %s", client.TransportInfo())
	}
	ipcmk, err := exec.LookPath("ipcmk")
	if err != nil {
		t.Skip("no ipcmk to make a segment from another process")
	}
	const n = 8192
	out, err := exec.Command(ipcmk, "-M", strconv.Itoa(n), "-p", "0600").Output()
	require.NoError(t, err)
	m := regexp.MustCompile(`id: (\d+)`).FindSubmatch(out)
	require.NotNil(t, m, "ipcmk said %q", out)
	shmid, err := strconv.Atoi(string(m[1]))
	require.NoError(t, err)
	t.Cleanup(func() { unix.SysvShmCtl(shmid, unix.IPC_RMID, nil) })
	other, err := unix.SysvShmAttach(shmid, 0, 0)
	require.NoError(t, err)
	t.Cleanup(func() { unix.SysvShmDetach(other) })

	const at = 0x10000000
	comp := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, uint32(shmid)), at)
	k, err := client.UnpackForeignKey(forgedKey(md, comp, at, n))
	if err == nil {
		perr := client.PutBytes(testCtx(t), bytes.Repeat([]byte{0xaa}, n), at, k)
		k.Close()
		t.Fatalf("the key unpacked (direct %v); a put through it returned %v and left %#x in the other program's segment", k.Direct(), perr, other[:4])
	}
	require.ErrorIs(t, err, rdma.ErrBadKey)
	require.ErrorContains(t, err, "no UCX segment")
	require.Equal(t, make([]byte, n), other, "the other program's segment untouched")
}
