//go:build race

package main

// raceEnabled: the race detector slows moving 64 MiB a dozen times to minutes.
const raceEnabled = true
