package dialer

// Busy returns the calls and streams in flight on each of the pool's
// connections, as the pool counts them.
func (p *Pool) Busy() []int64 {
	out := make([]int64, len(p.busy))
	for i := range p.busy {
		out[i] = p.busy[i].Load()
	}
	return out
}

// Sessions returns how many sessions d holds.
func (d *Dialer) Sessions() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.sessions)
}
