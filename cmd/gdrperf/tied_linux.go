package main

import (
	"os/exec"
	"syscall"
)

// tie makes SIGKILL cmd's parent-death signal.
func tie(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
