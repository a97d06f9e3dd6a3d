package devicebuftest_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
)

func TestMain(m *testing.M) { devicebuftest.Main(m) }

func TestInstallRestores(t *testing.T) {
	before := devicebuf.CUDAAvailable()
	t.Run("installed", func(t *testing.T) {
		devicebuftest.Install(t, 1)
		require.NoError(t, devicebuf.CUDAAvailable())
		t.Run("nested absent", func(t *testing.T) {
			devicebuftest.InstallAbsent(t, "gone")
			require.ErrorIs(t, devicebuf.CUDAAvailable(), devicebuf.ErrNotSupported)
		})
		require.NoError(t, devicebuf.CUDAAvailable(), "the outer fake is back")
	})
	require.Equal(t, before, devicebuf.CUDAAvailable(), "the driver before is back")
}

// fakeTB records failures instead of stopping the test.
type fakeTB struct {
	testing.TB
	name     string
	failed   bool
	cleanups []func()
}

func (f *fakeTB) Helper()               {}
func (f *fakeTB) Name() string          { return f.name }
func (f *fakeTB) Errorf(string, ...any) { f.failed = true }
func (f *fakeTB) Fatalf(string, ...any) { f.failed = true; panic(f) }
func (f *fakeTB) Cleanup(fn func())     { f.cleanups = append(f.cleanups, fn) }
func (f *fakeTB) runCleanups() {
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
}

func TestLeakedDeviceMemoryFails(t *testing.T) {
	tb := &fakeTB{TB: t, name: "leaky"}
	devicebuftest.Install(tb, 1)
	a, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	b, err := a.Alloc(100)
	require.NoError(t, err)
	tb.runCleanups()
	require.True(t, tb.failed, "a leaked allocation fails the test that installed the fake")
	// Free it through the (now uninstalled) fake that made it.
	require.NoError(t, b.Release())
}

func TestParallelInstallFails(t *testing.T) {
	devicebuftest.Install(t, 1)
	other := &fakeTB{TB: t, name: "TestSomethingElse"}
	func() {
		defer func() { require.Same(t, other, recover()) }()
		devicebuftest.Install(other, 1)
	}()
	require.True(t, other.failed)
	other.runCleanups()
	require.NoError(t, devicebuf.CUDAAvailable(), "the first fake stays installed")
}
