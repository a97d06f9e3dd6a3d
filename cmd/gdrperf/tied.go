package main

import (
	"os/exec"
	"runtime"
)

// runTied runs cmd to its end, the process tied to this one where the
// system allows (tie): it dies with this process, also when this one is
// killed and cannot stop it (a ucx_perftest server would otherwise wait on
// its port for a client that never comes). On Linux the tie is the parent-
// death signal, which the kernel sends when the OS thread that started the
// process exits, not the process: cmd is started and waited for on a
// goroutine locked to its thread all the while, so that thread outlives the
// process unless this one dies.
func runTied(cmd *exec.Cmd) error {
	tie(cmd)
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		done <- cmd.Run()
	}()
	return <-done
}
