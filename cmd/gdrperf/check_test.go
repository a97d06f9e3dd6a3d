package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// The two payload variants of a size differ in every byte, so that a call
// that received the other variant (left over from the previous call, or
// another call's) fails its check whichever windows it reads.
func TestVariantsDiffer(t *testing.T) {
	for _, size := range []int{1, 1000, 1 << 10, 1 << 20, 3<<20 + 17} {
		a, b := variantPattern(size, 0), variantPattern(size, 1)
		require.Equal(t, pattern(size), a)
		for i := range a {
			if a[i] == b[i] {
				t.Fatalf("size %d: byte %d is %d in both variants", size, i, a[i])
			}
		}
	}
}

// checkWindows accepts the variant asked for and refuses the other, a
// shorter payload and one changed in a window only, for payloads attached
// as buffers and carried inline.
func TestCheckWindows(t *testing.T) {
	const size = 1 << 20
	want, other := variantPattern(size, 0), variantPattern(size, 1)
	ws := windowsOf(want)
	require.Len(t, ws, 3)
	attached := func(p []byte) *tensorpb.Tensor {
		b := devicebuf.HostFromBytes(p)
		t.Cleanup(func() { b.Release() })
		return &tensorpb.Tensor{Data: gdrcodec.New(b)}
	}
	inline := func(p []byte) *tensorpb.Tensor {
		return &tensorpb.Tensor{Data: &gdrv1.DeviceBuffer{Length: uint64(len(p)), Inline: p}}
	}
	changed := append([]byte(nil), want...)
	changed[size/2]++
	for name, make := range map[string]func([]byte) *tensorpb.Tensor{"attached": attached, "inline": inline} {
		t.Run(name, func(t *testing.T) {
			require.NoError(t, checkWindows(make(want), size, ws))
			require.Error(t, checkWindows(make(other), size, ws), "the other variant")
			require.Error(t, checkWindows(make(changed), size, ws), "a byte changed in the middle window")
			require.Error(t, checkWindows(make(want[:size-1]), size, ws), "one byte short")
		})
	}
	small := variantPattern(100, 1)
	require.NoError(t, checkWindows(inline(small), 100, windowsOf(small)))
	require.Error(t, checkWindows(inline(variantPattern(100, 0)), 100, windowsOf(small)))
}
