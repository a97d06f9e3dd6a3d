package devicebuf_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime/debug"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

// Child processes: the test binary re-executed with childEnv set runs one child test.
const (
	childEnv     = "DEVICEBUF_TEST_CHILD"
	ipcHandleEnv = "DEVICEBUF_TEST_IPC_HANDLE"
	ipcOffEnv    = "DEVICEBUF_TEST_IPC_OFFSET"
	ipcLenEnv    = "DEVICEBUF_TEST_IPC_LEN"
)

// runChild re-executes the test binary running only test name, with env added, and returns
// its combined output and error. It is bounded by 2 minutes.
func runChild(t *testing.T, name string, env ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+name+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

var sink byte

// TestFakeDeviceMemoryFaults proves that the CPU cannot touch fake device memory: a child
// process reads it (the fault is caught and its address reported) and then writes it (the
// process dies of SIGSEGV).
func TestFakeDeviceMemoryFaults(t *testing.T) {
	out, err := runChild(t, "TestChildFault", childEnv+"=fault")
	var exitErr *exec.ExitError
	require.ErrorAs(t, err, &exitErr, "the child must die; output:\n%s", out)
	m := regexp.MustCompile(`FAULT-READ addr=(0x[0-9a-f]+) ptr=(0x[0-9a-f]+)`).FindStringSubmatch(out)
	require.NotNil(t, m, "the read must fault; output:\n%s", out)
	require.Equal(t, m[2], m[1], "the fault is at the device pointer")
	require.Contains(t, out, "WRITE "+m[2])
	require.Contains(t, out, "SIGSEGV", "the write must die of a segmentation fault; output:\n%s", out)
	require.Contains(t, out, "unexpected fault address "+m[2])
	require.NotContains(t, out, "NO-FAULT")
}

func TestChildFault(t *testing.T) {
	if os.Getenv(childEnv) != "fault" {
		t.Skip("run as a child of TestFakeDeviceMemoryFaults")
	}
	devicebuftest.Install(t, 1)
	a, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	b, err := a.Alloc(4096)
	require.NoError(t, err)
	ptr := b.Ptr()
	p := (*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&ptr)))
	func() {
		old := debug.SetPanicOnFault(true)
		defer debug.SetPanicOnFault(old)
		defer func() {
			if e, ok := recover().(interface{ Addr() uintptr }); ok {
				fmt.Printf("FAULT-READ addr=%#x ptr=%#x\n", e.Addr(), ptr)
			}
		}()
		sink = *p
	}()
	fmt.Printf("WRITE %#x\n", ptr)
	*p = 1
	fmt.Println("NO-FAULT")
}

// testIPCAcrossProcesses: the parent allocates, writes pattern A, exports an IPC handle; a
// child opens it, checks A, writes pattern B and exits; the parent checks B.
func testIPCAcrossProcesses(t *testing.T, mode string, n int) {
	base := devicebuf.Live()
	a, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	alloc, err := a.Alloc(n + 4096)
	require.NoError(t, err)
	b, err := alloc.Slice(4096, n)
	require.NoError(t, err)
	host, err := devicebuf.NewHostAllocator().Alloc(n)
	require.NoError(t, err)
	hb, _ := host.HostBytes()
	copy(hb, pattern(1, n))
	require.NoError(t, devicebuf.Copy(b, host))

	h, off, err := devicebuf.ExportIPC(b)
	require.NoError(t, err)
	require.Equal(t, 4096, off)
	out, err := runChild(t, "TestChildIPC", childEnv+"=ipc-"+mode,
		ipcHandleEnv+"="+hex.EncodeToString(h[:]), ipcOffEnv+"="+strconv.Itoa(off), ipcLenEnv+"="+strconv.Itoa(n))
	require.NoError(t, err, "child:\n%s", out)
	require.Contains(t, out, "CHILD-OK")

	clear(hb)
	require.NoError(t, devicebuf.Copy(host, b))
	requireBytes(t, pattern(2, n), hb, "what the child wrote")
	require.NoError(t, b.Release())
	require.NoError(t, alloc.Release())
	require.NoError(t, host.Release())
	requireLive(t, base)
}

func TestChildIPC(t *testing.T) {
	mode := os.Getenv(childEnv)
	switch mode {
	case "ipc-fake":
		devicebuftest.Install(t, 1)
	case "ipc-cuda":
	default:
		t.Skip("run as a child of the IPC tests")
	}
	hb, err := hex.DecodeString(os.Getenv(ipcHandleEnv))
	require.NoError(t, err)
	var h devicebuf.IPCHandle
	require.Len(t, hb, len(h))
	copy(h[:], hb)
	off, err := strconv.Atoi(os.Getenv(ipcOffEnv))
	require.NoError(t, err)
	n, err := strconv.Atoi(os.Getenv(ipcLenEnv))
	require.NoError(t, err)

	m, err := devicebuf.OpenIPC(h, 0)
	require.NoError(t, err)
	require.Equal(t, int64(1), devicebuf.Live().IPCMappings)
	v, err := m.Slice(off, n)
	require.NoError(t, err)
	host, err := devicebuf.NewHostAllocator().Alloc(n)
	require.NoError(t, err)
	p, _ := host.HostBytes()
	require.NoError(t, devicebuf.Copy(host, v))
	requireBytes(t, pattern(1, n), p, "what the parent wrote")
	copy(p, pattern(2, n))
	require.NoError(t, devicebuf.Copy(v, host))
	require.NoError(t, v.Release())
	require.NoError(t, m.Release())
	require.NoError(t, host.Release())
	require.Zero(t, devicebuf.Live().IPCMappings)
	fmt.Println("CHILD-OK")
}
