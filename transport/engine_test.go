package transport

import (
	"net"
	"sync"
)

// testHooks is what the test engine does with what sessions carry; tests set
// the hooks they need and put back what they found.
var testHooks struct {
	mu      sync.Mutex
	control func(s *Session, typ byte, payload []byte)
	bulk    func(s *Session, c net.Conn)       // nil: bulk streams are closed at once
	lane    func(s *Session, c net.Conn) error // nil: frame lanes are left unread
	closed  func(s *Session)
	linger  func(s *Session)
	join    func(s *Session)
}

// setHook sets *hook to fn until the test ends.
func setHook[F any](t interface{ Cleanup(func()) }, hook *F, fn F) {
	testHooks.mu.Lock()
	old := *hook
	*hook = fn
	testHooks.mu.Unlock()
	t.Cleanup(func() {
		testHooks.mu.Lock()
		*hook = old
		testHooks.mu.Unlock()
	})
}

func hookOf[F any](hook *F) F {
	testHooks.mu.Lock()
	defer testHooks.mu.Unlock()
	return *hook
}

// testEngine serves the sessions of this package's tests through testHooks.
type testEngine struct{}

func (testEngine) Attach(s *Session, _ *Link) Handler { return testHandler{s} }
func (testEngine) Codecs() []string                   { return []string{"test"} }

type testHandler struct{ s *Session }

func (h testHandler) Control(typ byte, payload []byte) {
	if fn := hookOf(&testHooks.control); fn != nil {
		fn(h.s, typ, payload)
	}
}

func (h testHandler) Bulk(c net.Conn) {
	if fn := hookOf(&testHooks.bulk); fn != nil {
		fn(h.s, c)
		return
	}
	_ = c.Close()
}

func (h testHandler) Lane(c net.Conn) error {
	if fn := hookOf(&testHooks.lane); fn != nil {
		return fn(h.s, c)
	}
	return nil
}

func (h testHandler) Linger() {
	if fn := hookOf(&testHooks.linger); fn != nil {
		fn(h.s)
	}
}

func (h testHandler) Join() {
	if fn := hookOf(&testHooks.join); fn != nil {
		fn(h.s)
	}
}

func (h testHandler) Closed() {
	if fn := hookOf(&testHooks.closed); fn != nil {
		fn(h.s)
	}
}
