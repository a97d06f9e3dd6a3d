package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// parseSize reads a byte count: a number with an optional binary suffix
// (B, K/KiB, M/MiB, G/GiB; case-insensitive), e.g. "64MiB", "1g", "4096".
func parseSize(s string) (int, error) {
	t := strings.TrimSpace(s)
	units := []struct {
		suffix string
		mul    int
	}{
		{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30},
		{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"b", 1},
	}
	mul := 1
	lower := strings.ToLower(t)
	for _, u := range units {
		if strings.HasSuffix(lower, u.suffix) {
			mul = u.mul
			lower = strings.TrimSpace(strings.TrimSuffix(lower, u.suffix))
			break
		}
	}
	n, err := strconv.ParseUint(lower, 10, 40)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("size %q: want a positive number of bytes with an optional suffix (KiB, MiB, GiB)", s)
	}
	v := n * uint64(mul)
	if v > 1<<36 {
		return 0, fmt.Errorf("size %q: over 64 GiB", s)
	}
	return int(v), nil
}

// parseSizes reads a comma-separated list of sizes, without repeats (however
// written: 1MiB and 1024KiB are one size), since a size names a row.
func parseSizes(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		if strings.TrimSpace(f) == "" {
			continue
		}
		n, err := parseSize(f)
		if err != nil {
			return nil, err
		}
		if slices.Contains(out, n) {
			return nil, fmt.Errorf("size %s given twice", formatSize(n))
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no sizes in %q", s)
	}
	return out, nil
}

// formatSize prints n with the largest binary unit that divides it.
func formatSize(n int) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// mibPerSec is the throughput of n bytes moved in d.
func mibPerSec(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / (1 << 20) / d.Seconds()
}

// median returns the median of xs (the mean of the middle two for an even
// count), 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := len(s) / 2
	if len(s)%2 == 1 {
		return s[m]
	}
	return (s[m-1] + s[m]) / 2
}

// medianRate is the throughput of n-byte transfers that took ds, at their
// median time: n / median(ds), the middle two times' mean for an even count
// (the median of the rates would be their harmonic mean instead). 0 for none.
func medianRate(n int, ds []time.Duration) float64 {
	if len(ds) == 0 {
		return 0
	}
	xs := make([]float64, 0, len(ds))
	for _, d := range ds {
		xs = append(xs, d.Seconds())
	}
	m := median(xs)
	if m <= 0 {
		return 0
	}
	return float64(n) / (1 << 20) / m
}
