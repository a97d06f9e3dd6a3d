package interop_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/examples/tensor"
	"github.com/gdrpc/gdrpc/examples/tensor/tensorpb"
	"github.com/gdrpc/gdrpc/gdrcodec"
	gdrv1 "github.com/gdrpc/gdrpc/gdrcodec/gdrv1"
)

// TestConcurrentCalls runs unary calls and server streams with out-of-band
// payloads in both directions from several goroutines at once over one
// session, and checks every byte.
func TestConcurrentCalls(t *testing.T) {
	const workers, rounds = 6, 3
	for _, tc := range transportCases[:3] {
		t.Run("transport="+tc.name, func(t *testing.T) {
			opts := tc.options(t)
			paths := countPaths(t)
			srv := startServer(t, opts, nil, bothServices)
			cc := dialClient(t, srv.addr, opts, nil)
			client := tensorpb.NewTensorServiceClient(cc)
			ctx := callCtx(t)

			concurrently(t, workers, func(w int) error {
				for r := range rounds {
					seed := uint32(w*100 + r)
					if w%2 == 0 { // Echo: the request's parts go up and come back
						var parts []*gdrv1.DeviceBuffer
						var want [][]byte
						for i, n := range []int{gdrcodec.StreamEagerThreshold + w, 1<<20 + r} { // out-of-band over every session
							p := pattern(n, seed+uint32(i))
							want = append(want, p)
							b := devicebuf.HostFromBytes(p)
							parts = append(parts, gdrcodec.New(b))
							b.Release()
						}
						in := &tensorpb.Tensor{Name: fmt.Sprint(seed), Parts: parts}
						out, err := client.Echo(ctx, in)
						gdrcodec.ReleaseAll(in)
						if err != nil {
							return fmt.Errorf("echo %d: %w", seed, err)
						}
						if len(out.Parts) != len(want) {
							return fmt.Errorf("echo %d: %d parts back", seed, len(out.Parts))
						}
						for i, db := range out.Parts {
							p, err := tensor.Bytes(db)
							if err != nil {
								return err
							}
							if !bytes.Equal(p, want[i]) {
								return fmt.Errorf("echo %d part %d: bytes differ", seed, i)
							}
						}
						gdrcodec.ReleaseAll(out)
					} else { // Download: four payloads down a server stream
						st, err := client.Download(ctx, &tensorpb.Sized{Size: 300<<10 + uint64(w), Seed: seed})
						if err != nil {
							return err
						}
						for i := range uint32(4) {
							tn, err := st.Recv()
							if err != nil {
								return fmt.Errorf("download %d/%d: %w", seed, i, err)
							}
							p, err := tensor.Bytes(tn.Data)
							if err != nil {
								return err
							}
							if !bytes.Equal(p, pattern(300<<10+w, seed+i)) {
								return fmt.Errorf("download %d/%d: bytes differ", seed, i)
							}
							gdrcodec.ReleaseAll(tn)
						}
						if _, err := st.Recv(); !errors.Is(err, io.EOF) {
							return fmt.Errorf("download %d: end: %v", seed, err)
						}
					}
				}
				return nil
			})
			// Echo: 2 parts up and 2 down; Download: 4 down.
			require.Equal(t, rounds*(workers/2*4+workers/2*4), paths.succeeded(t))
		})
	}
}
