package devicebuf

// ReleaseStranded lets go of the copies stranded by closed streams' failed
// waits, as nothing outside a test may (the device may still run them), and
// returns how many there were.
func ReleaseStranded() int {
	stranded.Lock()
	q := stranded.q
	stranded.q = nil
	stranded.Unlock()
	letGo(q)
	return len(q)
}
