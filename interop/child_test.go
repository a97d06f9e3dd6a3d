package interop_test

import (
	"fmt"
	"os"
)

// runChild plays a role in a re-executed test binary and returns its exit
// code.
func runChild(role string) int {
	switch role {
	}
	fmt.Fprintln(os.Stderr, "unknown child role", role)
	return 2
}
