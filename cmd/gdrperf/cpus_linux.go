package main

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// allowedCPUs names the CPUs this process may run on (its affinity, as
// taskset sets it), or "" where the kernel does not say. It reads the
// calling thread's mask, which is the process's unless a thread set its own.
func allowedCPUs() string {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return ""
	}
	var cpus []int
	for c := range 8 * int(unsafe.Sizeof(set)) {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpuList(cpus)
}
