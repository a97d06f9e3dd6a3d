package rdma_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"sync"
	"testing"

	"github.com/gdrpc/gdrpc/rdma"
	"github.com/stretchr/testify/require"
)

// Writers on several endpoints of one worker, and flushes from other
// goroutines, all run UCX operations themselves or through the worker's queue,
// whichever the lock allows. Every endpoint's bytes must arrive complete and in
// the order written, small copied writes and large pinned ones interleaved.
func TestConcurrentSubmitters(t *testing.T) {
	forEachPairing(t, func(t *testing.T, tls string, pair func(testing.TB, *rdma.Context) (client, server *rdma.Endpoint)) {
		c := newContext(t, tls)
		const pairs, msgs = 3, 600
		ctx := testCtx(t)
		var wg sync.WaitGroup
		errs := make(chan error, 3*pairs)
		for p := range pairs {
			client, server := pair(t, c)
			wg.Add(3)
			go func() { // writer: numbered records, every 50th one large
				defer wg.Done()
				for i := range msgs {
					if _, err := client.Write(record(p, i)); err != nil {
						errs <- fmt.Errorf("pair %d: write %d: %w", p, i, err)
						return
					}
				}
			}()
			go func() { // reader: checks every record
				defer wg.Done()
				for i := range msgs {
					want := record(p, i)
					got := make([]byte, len(want))
					if _, err := io.ReadFull(server, got); err != nil {
						errs <- fmt.Errorf("pair %d: read %d: %w", p, i, err)
						return
					}
					if !bytes.Equal(got, want) {
						errs <- fmt.Errorf("pair %d: record %d differs (first bytes %x)", p, i, got[:min(16, len(got))])
						return
					}
				}
			}()
			go func() { // flushes racing the writes for the worker's lock
				defer wg.Done()
				for range msgs / 10 {
					if err := client.Flush(ctx); err != nil {
						errs <- fmt.Errorf("pair %d: flush: %w", p, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
	})
}

// record is message i of pair p: a 16-byte header (pair, index) and a body of
// 48 bytes, or 200 KiB (above the copied-write limit) for every 50th.
func record(p, i int) []byte {
	n := 48
	if i%50 == 49 {
		n = 200 << 10
	}
	b := make([]byte, 16+n)
	binary.LittleEndian.PutUint64(b, uint64(p))
	binary.LittleEndian.PutUint64(b[8:], uint64(i))
	for k := range n {
		b[16+k] = byte(p*31 + i*7 + k)
	}
	return b
}
