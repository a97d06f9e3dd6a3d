package transport_test

import (
	"context"
	"fmt"
	"io"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/transport"
)

// TestManySessions: concurrent clients dial, talk and leave; every byte
// arrives, every session leaves the registry.
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
			for i := range clients {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- func() error {
						s, err := transport.Dial(ctx, l.Addr().String(), opts...)
						if err != nil {
							return err
						}
						defer s.Close()
						if s.Transport() != tc.want() {
							return fmt.Errorf("transport %s", s.Transport())
						}
						c, err := s.Conn(ctx)
						if err != nil {
							return err
						}
						defer c.Close()
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
