// Package nvmlinv lists GPUs through NVML (github.com/NVIDIA/go-nvml, which loads
// libnvidia-ml.so.1 at run time). It only reads; it never changes device state.
//
// It needs cgo (go-nvml is a cgo package); without cgo package devicebuf does not use it.
package nvmlinv
