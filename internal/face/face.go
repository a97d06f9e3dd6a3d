// Package face turns the options of package gdrpc into what packages dialer
// and listener hand the session layer: session options with an out-of-band
// engine of their own.
package face

import (
	"github.com/gdrpc/gdrpc"
	"github.com/gdrpc/gdrpc/oob"
	"github.com/gdrpc/gdrpc/transport"
)

// SessionOptions returns the session options opts ask for, the engine among
// them.
func SessionOptions(opts []gdrpc.Option) []transport.Option {
	var c gdrpc.Config
	for _, o := range opts {
		if o != nil { // an optional option left unset
			o(&c)
		}
	}
	tc := oob.TransferConfig{Timeout: c.TransferTimeout, Paths: c.Paths, Logger: c.Logger, Limits: c.Limits, ReceiveSpace: c.ReceiveSpace, ReceiveSpaceLimit: c.ReceiveSpaceLimit, StreamOrdered: c.StreamOrdered}
	out := []transport.Option{transport.WithTrustPeers(c.TrustPeers)}
	if c.Metrics != nil {
		tc.Metrics = transferMetrics{c.Metrics}
		out = append(out, transport.WithMetrics(sessionMetrics{c.Metrics}))
	}
	out = append(out, transport.WithEngine(oob.New(tc)))
	if c.Transport != "" {
		out = append(out, transport.WithMode(c.Transport))
	}
	if c.Logger != nil {
		out = append(out, transport.WithLogger(c.Logger))
	}
	if c.KeepAliveInterval != 0 || c.KeepAliveTimeout != 0 {
		out = append(out, transport.WithKeepAlive(c.KeepAliveInterval, c.KeepAliveTimeout))
	}
	if c.IdleTimeout != 0 {
		out = append(out, transport.WithIdleTimeout(c.IdleTimeout))
	}
	if c.HostSessions != 0 {
		out = append(out, transport.WithHostSessions(c.HostSessions))
	}
	return append(out, c.Session...)
}

// sessionMetrics and transferMetrics split a gdrpc.Metrics into the session
// layer's and the engine's.
type sessionMetrics struct{ m gdrpc.Metrics }

func (s sessionMetrics) SessionUp(tr string, client bool)            { s.m.SessionUp(tr, client) }
func (s sessionMetrics) SessionDown(tr string, client bool, e error) { s.m.SessionDown(tr, client, e) }
func (s sessionMetrics) Fallback(reason string)                      { s.m.SessionFallback(reason) }

type transferMetrics struct{ m gdrpc.Metrics }

func (t transferMetrics) Transfer(i oob.TransferInfo) { t.m.Transfer(i) }
func (t transferMetrics) Fallback(wanted, took oob.Path, reason string) {
	t.m.TransferFallback(wanted, took, reason)
}
