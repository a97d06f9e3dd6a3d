package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCPUList(t *testing.T) {
	for _, c := range []struct {
		cpus []int
		want string
	}{
		{nil, ""},
		{[]int{0}, "0"},
		{[]int{0, 1, 2, 3}, "0-3"},
		{[]int{0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"},
		{[]int{1, 3, 5}, "1,3,5"},
		{[]int{6, 7}, "6-7"},
	} {
		require.Equal(t, c.want, cpuList(c.cpus), "%v", c.cpus)
	}
}
