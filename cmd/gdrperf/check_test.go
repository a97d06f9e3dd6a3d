package main

import (
	"context"
	"errors"
	"testing"
	"time"

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

// Which calls of a batch have their payload checked, one call at a time:
// every one with -check every; with -check ends the verified first and the
// measured phase's last, and in a warm-up batch none but the verified. Every
// call's payload is released either way, its release inside the call's
// time, and a failed check fails the batch.
func TestCheckEnds(t *testing.T) {
	const n = 5
	for _, tc := range []struct {
		name     string
		check    string
		verify   bool
		measured bool
		checked  []int
	}{
		{name: "every", check: "every", measured: true, checked: []int{0, 1, 2, 3, 4}},
		{name: "ends", check: "ends", measured: true, checked: []int{4}},
		{name: "ends verified", check: "ends", verify: true, measured: true, checked: []int{0, 4}},
		{name: "ends warm-up", check: "ends", verify: true, checked: []int{0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &bench{o: &options{check: tc.check, callLimit: time.Minute}}
			// A release that takes releaseTime: the call's time must hold it.
			const releaseTime = 2 * time.Millisecond
			var checked []int
			released, calls := 0, 0
			call := func(_ context.Context, _ int, _ bool) (*followUp, error) {
				i := calls
				calls++
				return &followUp{
					check: func() error { checked = append(checked, i); return nil },
					release: func() {
						time.Sleep(releaseTime) // stands for a release's work, not for synchronization
						released++
					},
				}, nil
			}
			times, _, err := b.batch(t.Context(), call, 1, n, tc.verify, tc.measured)
			require.NoError(t, err)
			require.Len(t, times, n)
			for i, d := range times {
				require.GreaterOrEqual(t, d, releaseTime, "call %d's time leaves its release out", i)
			}
			require.Equal(t, tc.checked, checked)
			require.Equal(t, n, released)

			// The last call's payload is wrong: a measured batch fails in
			// either mode, its payloads all released.
			if !tc.measured {
				return
			}
			calls, released = 0, 0
			bad := func(ctx context.Context, w int, first bool) (*followUp, error) {
				f, _ := call(ctx, w, first)
				if calls == n {
					f.check = func() error { return errors.New("payload differs") }
				}
				return f, nil
			}
			_, _, err = b.batch(t.Context(), bad, 1, n, tc.verify, true)
			require.ErrorContains(t, err, "call 4: payload differs")
			require.Equal(t, n, released)
		})
	}
}
