package devicebuf_test

import (
	"errors"
	"fmt"

	"github.com/gdrpc/gdrpc/devicebuf"
)

// A pool of host memory: blocks are reused, the pool is bounded, and the memory goes back
// when the last reference is released.
func ExampleNewPool() {
	p, err := devicebuf.NewPool(devicebuf.PoolConfig{MaxBytes: 16 << 20})
	if err != nil {
		panic(err)
	}
	defer p.Close()

	b, _ := p.Alloc(100 << 10) // from the 128 KiB class
	hb, _ := b.HostBytes()
	copy(hb, "hello")
	first := b.Ptr()
	b.Release()

	b, _ = p.Alloc(120 << 10)
	fmt.Println("reused:", b.Ptr() == first)
	b.Release()

	_, err = p.Alloc(32 << 20)
	fmt.Println("exhausted:", errors.Is(err, devicebuf.ErrExhausted))
	fmt.Printf("%+v\n", p.Stats())
	// Output:
	// reused: true
	// exhausted: true
	// {Regions:1 RegionBytes:4194304 Registrations:0 InUse:0 BytesInUse:0 Hits:1 Misses:1 Exhausted:1 Waits:0 Freed:0}
}

// Copying to a GPU when there is one, and falling back to host memory when there is not.
func ExampleCopy() {
	src := devicebuf.HostFromBytes([]byte("payload"))
	defer src.Release()

	var dst *devicebuf.Buffer
	if a, err := devicebuf.NewCUDAAllocator(0); err == nil {
		dst, _ = a.Alloc(src.Len())
	} else {
		dst, _ = devicebuf.NewHostAllocator().Alloc(src.Len())
	}
	defer dst.Release()
	if err := devicebuf.Copy(dst, src); err != nil {
		panic(err)
	}
	back := devicebuf.HostFromBytes(make([]byte, src.Len()))
	defer back.Release()
	_ = devicebuf.Copy(back, dst)
	hb, _ := back.HostBytes()
	fmt.Println(string(hb))
	// Output: payload
}
