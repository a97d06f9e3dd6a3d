package oob

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/rdma"
)

var hostPoolClasses = func() []int {
	var c []int
	for s := 4 << 10; s <= 1<<30; s <<= 1 {
		c = append(c, s)
	}
	return c
}()

// registration is what a host pool's regions carry: UCX-allocated memory,
// registered once with one rdma.Context and kept registered.
type registration struct {
	ctx *rdma.Context
	mem *rdma.Memory
}

var (
	hostPoolsMu sync.Mutex
	hostPools   = map[*rdma.Context]*devicebuf.Pool{}
	plainPool   *devicebuf.Pool

	// regionRegs maps a UCX-allocated region's address to its registration,
	// between the pool's region source and its registrar.
	regionRegs sync.Map // uintptr -> *registration

	keyCache sync.Map // *rdma.Memory -> []byte
)

// DefaultHostPool is HostPool of the default UCX context (rdma.Default),
// or of none where UCX cannot be used.
func DefaultHostPool() *devicebuf.Pool {
	if rdma.Available() == nil {
		if rc, err := rdma.Default(); err == nil {
			return HostPool(rc)
		}
	}
	return HostPool(nil)
}

// HostPool returns the process's pool of registered host memory for rc: regions
// UCX allocated (puts into them run faster than into other memory), carved
// into size classes and reused. With rc nil (no UCX), plain page-aligned host
// memory. Received payloads and staging buffers come from it. Its regions
// count against TransferConfig.PoolBytes; one with no block out for
// devicebuf.DefaultPoolIdleTimeout goes back to UCX (deregistered, unpinned),
// and sooner when a transfer of another size class needs its room, so regions
// made for refused or aborted transfers do not stay pinned.
func HostPool(rc *rdma.Context) *devicebuf.Pool {
	hostPoolsMu.Lock()
	defer hostPoolsMu.Unlock()
	if rc == nil {
		if plainPool == nil {
			plainPool = mustPool(devicebuf.PoolConfig{MaxBytes: cfg().PoolBytes, Oversize: true})
		}
		return plainPool
	}
	if p := hostPools[rc]; p != nil {
		return p
	}
	p := mustPool(devicebuf.PoolConfig{
		Regions: func(n int) (*devicebuf.Buffer, error) {
			mem, err := rc.Alloc(n)
			if err != nil {
				return nil, err
			}
			// Where there is a GPU, staging through this memory runs at pinned speed.
			unpin := func() error { return nil }
			if devicebuf.CUDAAvailable() == nil {
				if u, err := devicebuf.PinHost(mem.Addr(), mem.Len()); err == nil {
					unpin = u
				} else {
					cfg().Logger.Debug("host pool region not pinned", "bytes", mem.Len(), "err", err)
				}
			}
			reg := &registration{ctx: rc, mem: mem}
			regionRegs.Store(mem.Addr(), reg)
			return devicebuf.Wrap(mem.Addr(), mem.Len(), devicebuf.Host, -1, func() {
				regionRegs.Delete(mem.Addr())
				keyCache.Delete(mem)
				unpin()
				mem.Close()
			}), nil
		},
		Registrar: regionRegistrar{},
		// Classes up to 1 GiB so that large destinations and staging buffers are
		// reused too: a new region means a UCX allocation, a registration and,
		// with a GPU, pinning.
		Classes:  hostPoolClasses,
		MaxBytes: cfg().PoolBytes,
		Oversize: true,
	})
	hostPools[rc] = p
	return p
}

// CloseHostPools closes the pools HostPool made, giving their memory back to
// UCX (and unpinning it); later HostPool calls make new ones. Call it when no
// transfer is under way: at shutdown, or between tests.
func CloseHostPools() error {
	hostPoolsMu.Lock()
	pools := hostPools
	hostPools = map[*rdma.Context]*devicebuf.Pool{}
	if plainPool != nil {
		pools[nil] = plainPool
		plainPool = nil
	}
	hostPoolsMu.Unlock()
	var errs []error
	for _, p := range pools {
		errs = append(errs, p.Close())
	}
	return errors.Join(errs...)
}

func mustPool(c devicebuf.PoolConfig) *devicebuf.Pool {
	p, err := devicebuf.NewPool(c)
	if err != nil {
		panic(fmt.Sprintf("transport: host pool: %v", err)) // the config above is valid by construction
	}
	return p
}

// regionRegistrar hands a pool the registration its region source made.
type regionRegistrar struct{}

func (regionRegistrar) Register(ptr uintptr, n int, kind devicebuf.Kind, device int) (any, func() error, error) {
	r, ok := regionRegs.Load(ptr)
	if !ok {
		return nil, nil, fmt.Errorf("region %#x was not allocated by UCX", ptr)
	}
	return r, func() error { return nil }, nil
}

// registered returns b's memory registration with rc and b's offset in it: the
// pool's where b comes from a registered pool of rc, else a registration made
// for this one transfer (Go memory stays pinned until release).
func registered(rc *rdma.Context, b *devicebuf.Buffer) (*rdma.Memory, int, func(), error) {
	if r, ok := b.Registration().(*registration); ok && r.ctx == rc {
		root, off := b.Root()
		if root.Ptr() != r.mem.Addr() {
			return nil, 0, nil, fmt.Errorf("region at %#x registered at %#x", root.Ptr(), r.mem.Addr())
		}
		return r.mem, off, func() {}, nil
	}
	return registerExactly(rc, b)
}

// registerExactly registers b alone with rc for one transfer (Go memory
// stays pinned until release): a key packed from it reaches b and nothing
// else, and only until release.
func registerExactly(rc *rdma.Context, b *devicebuf.Buffer) (*rdma.Memory, int, func(), error) {
	mt := rdma.MemoryHost
	if b.Kind() == devicebuf.CUDA {
		if !rc.CanMap(rdma.MemoryCUDA) {
			return nil, 0, nil, fmt.Errorf("UCX cannot register CUDA memory: %w", rdma.ErrNotSupported)
		}
		mt = rdma.MemoryCUDA
	}
	var pin runtime.Pinner
	if b.GoMemory() {
		hb, err := b.HostBytes()
		if err != nil {
			return nil, 0, nil, err
		}
		if len(hb) > 0 {
			pin.Pin(unsafe.SliceData(hb))
		}
	}
	var mem *rdma.Memory
	var err error
	if mt == rdma.MemoryCUDA {
		mem, err = rc.MapCUDA(b.Ptr(), b.Len(), b.Device())
	} else {
		mem, err = rc.Map(b.Ptr(), b.Len(), mt)
	}
	if err != nil {
		pin.Unpin()
		return nil, 0, nil, fmt.Errorf("register %d bytes: %w", b.Len(), err)
	}
	return mem, 0, func() {
		keyCache.Delete(mem)
		mem.Close()
		pin.Unpin()
	}, nil
}

func packedKey(mem *rdma.Memory) ([]byte, error) {
	if k, ok := keyCache.Load(mem); ok {
		return k.([]byte), nil
	}
	k, err := mem.PackKey()
	if err != nil {
		return nil, err
	}
	if err := keyFitsRTR(k); err != nil {
		return nil, err
	}
	keyCache.Store(mem, k)
	return k, nil
}

// keyFitsRTR reports why a packed key cannot go in an RTR or a SPACE: the
// owner refuses one longer than maxRKey as malformed, without a FIN, and the
// pull would wait out its timeout instead of taking another path.
func keyFitsRTR(k []byte) error {
	if len(k) > maxRKey {
		return fmt.Errorf("packed key of %d bytes, more than the %d an RTR carries", len(k), maxRKey)
	}
	return nil
}

// deviceOrdinal finds the local CUDA ordinal of a GPU by UUID.
func deviceOrdinal(uuid string) (int, error) {
	n, err := devicebuf.DeviceCount()
	if err != nil {
		return -1, err
	}
	for i := range n {
		if u, err := devicebuf.DeviceUUIDOf(i); err == nil && u == uuid {
			return i, nil
		}
	}
	return -1, fmt.Errorf("no local GPU with UUID %s", uuid)
}
