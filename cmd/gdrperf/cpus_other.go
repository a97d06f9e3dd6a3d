//go:build !linux

package main

// allowedCPUs names the CPUs this process may run on; "" here, where it is
// not asked.
func allowedCPUs() string { return "" }
