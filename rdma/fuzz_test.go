package rdma_test

import (
	"errors"
	"testing"

	"github.com/gdrpc/gdrpc/rdma"
)

// FuzzUnpackKey feeds packed keys (real ones, then mutations) to
// Endpoint.UnpackKey: an error or a key, never a crash. The endpoint is over
// tcp: UCX 1.13 crashes (SIGSEGV in ucp_rkey_destroy on its error path) when
// a shared-memory transport fails to unpack its part of a key, for example a
// sysv key whose segment is gone; our framing and structure checks cannot
// know which remote memory domain is sysv, so shm keys are fuzzed only as far
// as the checks go (FuzzKeyFraming).
func FuzzUnpackKey(f *testing.F) {
	requireUCX(f)
	type side struct {
		ctx *rdma.Context
		ep  *rdma.Endpoint
	}
	var sides []side
	for _, tr := range transports {
		c := newContext(f, tr.tls)
		if tr.name != "tcp" {
			// live keys of shm memory unpack on a shm endpoint
			client, _ := pair(f, c)
			m, err := c.Alloc(4096)
			if err != nil {
				f.Fatal(err)
			}
			k, err := m.PackKey()
			if err != nil {
				f.Fatal(err)
			}
			rk, err := client.UnpackKey(k)
			if err != nil {
				f.Fatal(err)
			}
			rk.Close()
			m.Close()
			f.Add(k)
			continue
		}
		client, _ := pair(f, c)
		sides = append(sides, side{c, client})
		for _, n := range []int{1, 4096, 1 << 20} {
			m, err := c.Alloc(n)
			if err != nil {
				f.Fatal(err)
			}
			k, err := m.PackKey()
			if err != nil {
				f.Fatal(err)
			}
			f.Add(k)
			// the key outlives the memory: UCX must still unpack or fail cleanly
			m.Close()
		}
	}
	f.Add([]byte("GDRK\x01\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, s := range sides {
			k, err := s.ep.UnpackKey(b)
			if err != nil {
				if k != nil {
					t.Fatal("key with an error")
				}
				if !errors.Is(err, rdma.ErrBadKey) {
					var se *rdma.StatusError
					if !errors.As(err, &se) {
						t.Fatalf("unexpected error type: %v", err)
					}
				}
				continue
			}
			if err := k.Close(); err != nil {
				t.Fatal(err)
			}
		}
	})
}
