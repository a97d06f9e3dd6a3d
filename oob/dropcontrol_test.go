package oob

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/transport"
)

// linkEngine is a client engine that hands over the session's Link and
// handles nothing: the test sends what it likes through the link.
type linkEngine struct{ links chan *transport.Link }

func (e linkEngine) Attach(_ *transport.Session, l *transport.Link) transport.Handler {
	e.links <- l
	return idleHandler{}
}
func (linkEngine) Codecs() []string { return []string{"gdr"} }

type idleHandler struct{}

func (idleHandler) Control(byte, []byte)  {}
func (idleHandler) Bulk(c net.Conn)       { _ = c.Close() }
func (idleHandler) Lane(c net.Conn) error { _, err := c.Read(make([]byte, 1)); return err }
func (idleHandler) Linger()               {}
func (idleHandler) Closed()               {}
func (idleHandler) Join()                 {}

// A peer that sends malformed control messages as fast as it writes gets
// one Warn line for them; the others go to Debug, and the session stays up.
func TestDroppedControlLogBounded(t *testing.T) {
	var logs testenv.LogBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	l, err := transport.Listen("127.0.0.1:0", transport.WithMode(transport.ModeTCP),
		transport.WithEngine(New(TransferConfig{Logger: log})), transport.WithLogger(log))
	require.NoError(t, err)
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	e := linkEngine{make(chan *transport.Link, 1)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := transport.Dial(ctx, l.Addr().String(), transport.WithMode(transport.ModeTCP), transport.WithEngine(e))
	require.NoError(t, err)
	defer cs.Close()
	_, err = cs.Conn(ctx)
	require.NoError(t, err)
	sc := <-accepted
	defer sc.Close()
	link := <-e.links

	const n = 500
	for range n {
		require.NoError(t, link.SendControl(ctx, ctlFIN, nil)) // a FIN of no bytes
	}
	count := func(level string) int {
		k := 0
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "dropping control message") && strings.Contains(line, "level="+level) {
				k++
			}
		}
		return k
	}
	require.Eventually(t, func() bool { return count("WARN")+count("DEBUG") == n }, 10*time.Second, time.Millisecond)
	require.Equal(t, 1, count("WARN"))
	require.NoError(t, transport.SessionOf(sc).Err(), "the server's session")
}
