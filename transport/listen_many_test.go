package transport_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// TestManySessions: concurrent clients dial, then talk and leave at once;
// every byte arrives, every session leaves the registry.
func TestManySessions(t *testing.T) {
	const clients = 16
	for _, tc := range transportCases {
		t.Run(tc.name, func(t *testing.T) {
			opts := tc.options(t)
			l, err := transport.Listen("127.0.0.1:0", opts...)
			require.NoError(t, err)
			var served sync.WaitGroup
			served.Add(1)
			go func() {
				defer served.Done()
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					served.Add(1)
					go func() {
						defer served.Done()
						defer c.Close()
						_, _ = io.Copy(c, c)
					}()
				}
			}()
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			var wg sync.WaitGroup
			errs := make(chan error, clients)
			// Dials overlap each other but no close: Debian's UCX 1.13 can
			// abort a process whose connection request races a closing
			// socket (README, Known limits), which no code of gdrpc's can
			// prevent. Over UCX the dials go one at a time: with four at
			// once it still aborted the suite once (the sessions' lanes and
			// the listener's turned-away requests close sockets of their
			// own while the next requests come).
			dialing := make(chan struct{}, clients)
			if tc.ucx != "" {
				dialing = make(chan struct{}, 1)
			}
			var dialed sync.WaitGroup
			dialed.Add(clients)
			for i := range clients {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- func() error {
						dialing <- struct{}{}
						s, err := transport.Dial(ctx, l.Addr().String(), opts...)
						var c net.Conn
						if err == nil {
							c, err = s.Conn(ctx)
						}
						<-dialing
						dialed.Done()
						dialed.Wait()
						if s != nil {
							defer s.Close()
						}
						if err != nil {
							return err
						}
						defer c.Close()
						if s.Transport() != tc.want() {
							return fmt.Errorf("transport %s", s.Transport())
						}
						msg := []byte(fmt.Sprintf("client %d says hello", i))
						if _, err := c.Write(msg); err != nil {
							return err
						}
						got := make([]byte, len(msg))
						if _, err := io.ReadFull(c, got); err != nil {
							return err
						}
						if string(got) != string(msg) {
							return fmt.Errorf("got %q, want %q", got, msg)
						}
						return nil
					}()
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			require.NoError(t, l.Close())
			served.Wait()
		})
	}
}
