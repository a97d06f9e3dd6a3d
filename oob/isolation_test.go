package oob

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/internal/testenv"
	"github.com/gdrpc/gdrpc/rdma"
	"github.com/gdrpc/gdrpc/transport"
)

// The attacks of a peer that speaks the rendezvous by hand, against the
// isolation the engine promises (oob_isolation.go). Each test runs both
// sessions of a pair in this process: one side is the engine, the other the
// attacker, whose control messages the test intercepts and forges.

// ucxContext returns a UCX context restricted to the UCX transports tls,
// closed (with the host pools) when the test ends.
func ucxContext(t testing.TB, tls string) *rdma.Context {
	t.Helper()
	testenv.Need(t, "ucx", rdma.Available())
	rc, err := rdma.NewContext(rdma.WithTransports(tls))
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, CloseHostPools())
		require.NoError(t, rc.Close())
	})
	return rc
}

// ucxPair returns the client and server sessions of a UCX session on a
// context of its own restricted to the UCX transports tls.
func ucxPair(t testing.TB, tls string, extra ...transport.Option) (cs, ss *transport.Session) {
	t.Helper()
	opts := append([]transport.Option{transport.WithRDMAContext(ucxContext(t, tls)), transport.WithMode(transport.ModeUCX)}, extra...)
	_, cs, ss, _, _ = lanePair(t, opts, opts)
	return cs, ss
}

// tcpPair returns the client and server sessions of a TCP session.
func tcpPair(t *testing.T, extra ...transport.Option) (cs, ss *transport.Session) {
	t.Helper()
	opts := append([]transport.Option{transport.WithMode(transport.ModeTCP)}, extra...)
	_, cs, ss, _, _ = lanePair(t, opts, opts)
	return cs, ss
}

// intercept hands fn, instead of the engine, the control messages of type typ
// that s receives, until the test ends.
func intercept(t *testing.T, typ byte, s *transport.Session, fn func(payload []byte)) {
	t.Helper()
	controlMu.Lock()
	engine := controlHandlers[typ]
	controlHandlers[typ] = func(from *transport.Session, payload []byte) {
		if from == s {
			runHook(func() bool { fn(payload); return true })
			return
		}
		engine(from, payload)
	}
	controlMu.Unlock()
	t.Cleanup(func() {
		controlMu.Lock()
		controlHandlers[typ] = engine
		controlMu.Unlock()
	})
}

// interceptRTRs hands the RTRs that reach s, parsed, to f instead of the
// owner's engine.
func interceptRTRs(t *testing.T, s *transport.Session, f func(*rtr)) {
	t.Helper()
	intercept(t, ctlRTR, s, func(payload []byte) {
		m, err := parseRTR(payload)
		if err != nil {
			t.Errorf("RTR: %v", err)
			return
		}
		f(m)
	})
}

// answerWith makes the owner side of s answer every RTR with a FIN that
// reports status over path and writes nothing; the RTRs go to rtrs.
func answerWith(t *testing.T, s *transport.Session, status finStatus, path Path) <-chan *rtr {
	t.Helper()
	rtrs := make(chan *rtr, 16)
	interceptRTRs(t, s, func(m *rtr) {
		rtrs <- m
		f := &fin{Req: m.Req, Status: status, Path: path}
		if err := sendControl(context.Background(), s, ctlFIN, f.marshal()); err != nil {
			t.Errorf("FIN: %v", err)
		}
	})
	return rtrs
}

// withConfig sets the engine's configuration until the test ends.
func withConfig(t testing.TB, c TransferConfig) {
	t.Helper()
	old := *cfg()
	SetTransferConfig(c)
	t.Cleanup(func() { SetTransferConfig(old) })
}

func descriptorOf(n int) Descriptor {
	return Descriptor{Owner: transport.ID(newToken()), Token: Token(newToken()), Length: uint64(n), Kind: devicebuf.Host, Device: -1}
}

// stale returns a destination of n bytes from the host pool of s that holds a
// previous transfer's bytes.
func stale(t *testing.T, s *transport.Session, n int) (*devicebuf.Buffer, []byte) {
	t.Helper()
	dst, err := HostPool(s.RDMAContext()).Alloc(n)
	require.NoError(t, err)
	t.Cleanup(func() { dst.Release() })
	b, err := dst.HostBytes()
	require.NoError(t, err)
	copy(b, bytes.Repeat([]byte("VICTIM-SECRET-PAYLOAD "), n/22+1))
	return dst, b
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestFINWithoutWrite: an owner answers "ok" over the rdma path it was
// offered and writes nothing. The receiver cannot tell; what it hands over
// must not be the destination's earlier contents.
func TestFINWithoutWrite(t *testing.T) {
	cs, ss := ucxPair(t, "tcp")
	rtrs := answerWith(t, cs, finOK, PathRDMA)
	const n = 256 << 10
	dst, b := stale(t, ss, n)
	path, err := fetchVia(testContext(t), ss, descriptorOf(n), dst, func() {})
	require.NoError(t, err)
	require.Equal(t, PathRDMA, path)
	require.NotZero(t, (<-rtrs).Offers&PathRDMA, "the receiver offered rdma")
	require.Equal(t, make([]byte, n), b, "the destination reached the caller uncleared")
}

// TestFINForPathNotOffered: a FIN "ok" naming a path the RTR did not offer
// (or none, for a payload with bytes) fails the transfer; the destination
// does not reach the caller.
func TestFINForPathNotOffered(t *testing.T) {
	for _, tc := range []struct {
		name string
		pair func(*testing.T, ...transport.Option) (cs, ss *transport.Session)
		path Path
	}{
		{"tcp/rdma", tcpPair, PathRDMA},
		{"tcp/cuda-ipc", tcpPair, PathCUDAIPC},
		{"tcp/none", tcpPair, PathNone},
		{"tcp/two paths", tcpPair, PathRDMA | PathStream},
		{"ucx/staged", func(t *testing.T, _ ...transport.Option) (cs, ss *transport.Session) { return ucxPair(t, "tcp") }, PathStaged},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs, ss := tc.pair(t)
			rtrs := answerWith(t, cs, finOK, tc.path)
			const n = 4096
			dst, _ := stale(t, ss, n)
			_, err := fetchVia(testContext(t), ss, descriptorOf(n), dst, func() {})
			var te *TransferError
			require.ErrorAs(t, err, &te)
			require.Equal(t, TransferInvalid, te.Kind)
			require.ErrorContains(t, err, "which was not offered")
			require.Zero(t, (<-rtrs).Offers&tc.path&^PathStream, "the path was not offered")
		})
	}
}

// TestForgedKeyWritesOwnMemory: a receiver sends, as the key of its
// destination, one that names a shared-memory segment of the owner's own
// (here: another transfer's destination in the owner's host pool). On shared
// memory the owner writes into the segment itself, wherever the key says: it
// must not put with such a key, and falls back to the stream path. Peers it
// trusts may name shared memory, but only their own: a trusted peer in
// another process (the test's pair taken for one) is refused the owner's.
func TestForgedKeyWritesOwnMemory(t *testing.T) {
	t.Run("untrusted", func(t *testing.T) {
		cs, ss := ucxPair(t, "posix,sysv,cma,tcp")
		testForgedKeyWritesOwnMemory(t, cs, ss)
	})
	t.Run("trusted", func(t *testing.T) {
		cs, ss := ucxPair(t, "posix,sysv,cma,tcp", transport.WithTrustPeers(true))
		require.True(t, cs.PeerInProcess())
		peerInProcess = func(*transport.Session) bool { return false }
		t.Cleanup(func() { peerInProcess = (*transport.Session).PeerInProcess })
		testForgedKeyWritesOwnMemory(t, cs, ss)
	})
}

func testForgedKeyWritesOwnMemory(t *testing.T, cs, ss *transport.Session) {
	const n = 256 << 10
	payload := bytes.Repeat([]byte("payload "), n/8)
	d := Offer(Source{Bytes: payload}, OfferOptions{})
	defer Withdraw(d.Token)

	victim, vb := stale(t, cs, n)
	want := bytes.Clone(vb)
	mem, off, _, err := registered(cs.RDMAContext(), victim)
	require.NoError(t, err)
	key, err := packedKey(mem)
	require.NoError(t, err)
	domains, err := ss.Endpoint().KeyDomains(key)
	require.NoError(t, err)
	require.Contains(t, domains, "sysv", "the forged key names shared memory")

	dst, err := devicebuf.NewHostAllocator().Alloc(n)
	require.NoError(t, err)
	p := makePull(ss, dst)
	p.list()
	defer p.settled()
	m := &rtr{Req: p.req, Token: d.Token, Length: n, Offers: PathRDMA | PathStream,
		RAddr: uint64(mem.Addr()) + uint64(off), RKey: key}
	ctx := testContext(t)
	require.NoError(t, sendControl(ctx, ss, ctlRTR, m.marshal()))
	var f *fin
	select {
	case f = <-p.fin:
	case <-ctx.Done():
		t.Fatal("no FIN")
	}
	require.Equal(t, want, vb, "the owner wrote into its own memory")
	require.Equal(t, finOK, f.Status, f.Msg)
	require.Equal(t, PathStream, f.Path)
	require.NoError(t, bulkResult(t, p))
	got, err := dst.HostBytes()
	require.NoError(t, err)
	require.Equal(t, payload, got)
}

// TestDestinationKeyScope: the key a receiver sends covers its destination
// and nothing else, names only memory the receiver's side writes into, and
// its registration ends with the transfer. With trusted peers it is the pool
// region's key, reused across transfers (and puts may take shared memory).
func TestDestinationKeyScope(t *testing.T) {
	for _, tc := range []struct {
		name    string
		tls     string
		trust   bool
		domains []string
	}{
		{"tcp/default", "tcp", false, []string{"tcp"}},
		{"tcp/trusted", "tcp", true, []string{"tcp"}},
		{"shm/default", "posix,sysv,cma,tcp", false, []string{"tcp"}},
		{"shm/trusted", "posix,sysv,cma,tcp", true, []string{"sysv", "tcp"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs, ss := ucxPair(t, tc.tls, transport.WithTrustPeers(tc.trust))
			rtrs := make(chan *rtr, 1)
			interceptRTRs(t, cs, func(m *rtr) {
				rtrs <- m
				serveRTR(cs, m, cfgOf(cs))
			})
			const n = 256 << 10
			payload := bytes.Repeat([]byte("payload "), n/8)
			d := Offer(Source{Bytes: payload}, OfferOptions{})
			defer Withdraw(d.Token)
			dst, b := stale(t, ss, n)
			before := rdma.Stats().Memories

			path, err := fetchVia(testContext(t), ss, d, dst, func() {})
			require.NoError(t, err)
			require.Equal(t, PathRDMA, path)
			require.Equal(t, payload, b)
			m := <-rtrs
			base, length := binary.BigEndian.Uint64(m.RKey[8:]), binary.BigEndian.Uint64(m.RKey[16:])
			root, _ := dst.Root()
			if tc.trust {
				require.Equal(t, [2]uint64{uint64(root.Ptr()), uint64(root.Len())}, [2]uint64{base, length})
			} else {
				require.Equal(t, [2]uint64{uint64(dst.Ptr()), n}, [2]uint64{base, length}, "the key covers more than the destination")
			}
			domains, err := cs.Endpoint().KeyDomains(m.RKey)
			require.NoError(t, err)
			require.ElementsMatch(t, tc.domains, domains)
			require.Equal(t, before, rdma.Stats().Memories, "the destination's registration outlived the transfer")
		})
	}
}

// TestCanceledPushWritesNothingLate: a push whose context ends while its put
// is in flight returns, and so lets its FIN(failed) go, only once the put can
// no longer land: a destination the receiver then reuses keeps what it got.
func TestCanceledPushWritesNothingLate(t *testing.T) {
	cs, ss := ucxPair(t, "tcp")
	const n = 8 << 20
	src := bytes.Repeat([]byte{0xAB}, n)
	marker := bytes.Repeat([]byte{0x5A}, n)
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for range 3 {
		dst, b := stale(t, ss, n)
		mem, off, release, err := registerExactly(ss.RDMAContext(), dst)
		require.NoError(t, err)
		key, err := mem.PackKey()
		require.NoError(t, err)
		m := &rtr{Req: 1, Length: n, Offers: PathRDMA, RAddr: uint64(mem.Addr()) + uint64(off), RKey: key}
		_, err = pushRDMA(canceled, cs, cs.Endpoint(), m, Source{Bytes: src})
		if err != nil {
			require.ErrorIs(t, err, context.Canceled)
		}
		copy(b, marker) // the receiver reused the destination
		require.NoError(t, cs.Endpoint().Flush(testContext(t)))
		require.True(t, bytes.Equal(marker, b), "the push wrote after it returned")
		release()
	}
}

// TestChunkNoticesAfterCopierStopped: once a staged pull's copier stopped
// (the pull failed or ended), chunk notices for it no longer wait for it.
func TestChunkNoticesAfterCopierStopped(t *testing.T) {
	_, ss := tcpPair(t)
	const n = 8 << 20
	alloc := devicebuf.NewHostAllocator()
	dst, err := alloc.Alloc(n)
	require.NoError(t, err)
	staging, err := alloc.Alloc(n)
	require.NoError(t, err)
	defer staging.Release()
	p := makePull(ss, dst)
	c := newStagedCopier(dst, staging, p)
	p.list()
	defer p.settled()
	c.stop()

	handled := make(chan struct{})
	go func() {
		defer close(handled)
		for i := range 2 * cap(p.chunks) {
			handleChunk(ss, rangeNotice(p.req, uint64(i)*stagedGrain, stagedGrain))
		}
	}()
	select {
	case <-handled:
	case <-time.After(10 * time.Second):
		t.Fatal("chunk notices block once the copier stopped")
	}
}

func TestChunkCoverage(t *testing.T) {
	const g = stagedGrain
	for _, tc := range []struct {
		name   string
		total  uint64
		chunks [][2]uint64
		err    string // of the last chunk
	}{
		{"in order", 3*g + 5, [][2]uint64{{0, g}, {g, 2 * g}, {3 * g, 5}}, ""},
		{"out of order", 3 * g, [][2]uint64{{2 * g, g}, {0, 2 * g}}, ""},
		{"again", 3 * g, [][2]uint64{{0, g}, {0, g}}, "over an earlier one"},
		{"overlapping", 3 * g, [][2]uint64{{g, 2 * g}, {0, 2 * g}}, "over an earlier one"},
		{"unaligned start", 3 * g, [][2]uint64{{1, g}}, "does not fit"},
		{"short chunk inside", 3 * g, [][2]uint64{{0, g - 1}}, "does not fit"},
		{"past the end", 3 * g, [][2]uint64{{2 * g, 2 * g}}, "does not fit"},
		{"empty", 3 * g, [][2]uint64{{0, 0}}, "does not fit"},
		{"huge offset", 3 * g, [][2]uint64{{1 << 63, g}}, "does not fit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newChunkCoverage(tc.total)
			var err error
			for _, ch := range tc.chunks {
				err = c.add(ch[0], ch[1])
			}
			if tc.err == "" {
				require.NoError(t, err)
			} else {
				require.ErrorContains(t, err, tc.err)
			}
		})
	}
}

// TestFINWithoutWriteGPU: over CUDA IPC into GPU memory (the fake GPU, which
// faults on a CPU touch), which only trusted peers get: a trusted owner's FIN
// is taken at its word, so the destination is not cleared first (a clear
// costs a switch between the two processes' GPU contexts per call).
func TestFINWithoutWriteGPU(t *testing.T) {
	devicebuftest.Install(t, 1)
	t.Cleanup(func() { require.NoError(t, CloseHostPools()) })
	cs, ss := tcpPair(t, transport.WithTrustPeers(true)) // CUDA IPC only with trusted peers
	rtrs := answerWith(t, cs, finOK, PathCUDAIPC)
	const n = 256<<10 + 3
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	dst, err := gpu.Alloc(n)
	require.NoError(t, err)
	defer dst.Release()
	secret := devicebuf.HostFromBytes(bytes.Repeat([]byte{0xEE}, n))
	defer secret.Release()
	require.NoError(t, devicebuf.Copy(dst, secret))

	d := descriptorOf(n)
	d.Kind, d.Device, d.DeviceUUID, d.HostID = devicebuf.CUDA, 0, dst.DeviceUUID(), transport.LocalHostID()
	path, err := fetchVia(testContext(t), ss, d, dst, func() {})
	require.NoError(t, err)
	require.Equal(t, PathCUDAIPC, path)
	require.NotZero(t, (<-rtrs).Offers&PathCUDAIPC, "the receiver offered cuda-ipc")
	got := make([]byte, n)
	back := devicebuf.HostFromBytes(got)
	defer back.Release()
	require.NoError(t, devicebuf.Copy(back, dst))
	require.Equal(t, bytes.Repeat([]byte{0xEE}, n), got, "a trusted peer's destination is not cleared")
}

// BenchmarkDestinationExposure: what a transfer pays for its destination's
// isolation: clearing it, registering it alone and packing its key
// (receiver), unpacking and releasing that key (owner); against the pool
// region's cached key that trusted peers share.
func BenchmarkDestinationExposure(b *testing.B) {
	for _, tls := range []string{"tcp", "posix,sysv,cma,tcp"} {
		for _, n := range []int{64 << 10, 1 << 20, 64 << 20} {
			for _, op := range []string{"clear", "exact-key", "region-key"} {
				b.Run(fmt.Sprintf("tls=%s/size=%s/op=%s", tls, sizeName(n), op), func(b *testing.B) {
					cs, ss := ucxPair(b, tls)
					dst, err := HostPool(ss.RDMAContext()).Alloc(n)
					require.NoError(b, err)
					defer dst.Release()
					b.SetBytes(int64(n))
					for b.Loop() {
						switch op {
						case "clear":
							require.NoError(b, clearDestination(dst))
						case "exact-key", "region-key":
							expose := registerExactly
							if op == "region-key" {
								expose = registered
							}
							mem, _, release, err := expose(ss.RDMAContext(), dst)
							require.NoError(b, err)
							key, err := packedKey(mem)
							require.NoError(b, err)
							k, done, err := remoteKey(cs, cs.Endpoint(), key)
							require.NoError(b, err)
							_ = k
							done()
							release()
						}
					}
				})
			}
		}
	}
}

// BenchmarkPull: a pull over the rdma path with each destination isolated
// (the default) and with trusted peers.
func BenchmarkPull(b *testing.B) {
	for _, tls := range []string{"tcp", "posix,sysv,cma,tcp"} {
		for _, n := range []int{1 << 20, 64 << 20} {
			for _, trust := range []bool{false, true} {
				b.Run(fmt.Sprintf("tls=%s/size=%s/trusted=%v", tls, sizeName(n), trust), func(b *testing.B) {
					_, ss := ucxPair(b, tls, transport.WithTrustPeers(trust))
					d := Offer(Source{Bytes: make([]byte, n)}, OfferOptions{Held: true})
					defer Withdraw(d.Token)
					dst, err := HostPool(ss.RDMAContext()).Alloc(n)
					require.NoError(b, err)
					defer dst.Release()
					b.SetBytes(int64(n))
					for b.Loop() {
						path, err := fetchVia(context.Background(), ss, d, dst, func() {})
						require.NoError(b, err)
						require.Equal(b, PathRDMA, path)
					}
				})
			}
		}
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}

// A peer whose puts never complete after a failed push (its acknowledgements
// stop, the session stays up) holds the source for the transfer timeout at
// most: the session is ended then and the wait returns. Puts that complete
// leave the session up.
func TestSettleWritesBounded(t *testing.T) {
	c, _ := pipePair(t)
	settleWritesWithin(c, func(context.Context) error { return nil }, time.Minute)
	requireLive(t, c)

	stuck := func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }
	settles := func(s *transport.Session, bound time.Duration) {
		done := make(chan struct{})
		go func() {
			defer close(done)
			settleWritesWithin(s, stuck, bound)
		}()
		select {
		case <-done:
		case <-time.After(testTimeout):
			t.Fatal("the wait for puts that never complete did not end")
		}
	}
	settles(c, 50*time.Millisecond)
	require.ErrorContains(t, c.Err(), "did not complete")

	// A session that ends by itself (its peer closed it) ends the wait too.
	c2, s2 := pipePair(t)
	require.NoError(t, s2.Close())
	settles(c2, time.Hour)
	require.Error(t, c2.Err())
	require.NotContains(t, c2.Err().Error(), "did not complete")
}

// A descriptor that names this process as its owner, with a token it never
// offered, fails before anything is allocated for it: a peer cannot make the
// receiver allocate for a payload that does not exist. A real local payload
// is allocated for once and copied.
func TestLocalOwnerUnknownTokenAllocatesNothing(t *testing.T) {
	var allocs int
	alloc := func(n int) (*devicebuf.Buffer, error) {
		allocs++
		return devicebuf.HostFromBytes(make([]byte, n)), nil
	}
	fake := Descriptor{Owner: transport.LocalID(), Token: newToken(), Length: 1 << 30, Kind: devicebuf.Host, Device: -1}
	_, _, err := FetchNew(testContext(t), fake, alloc)
	var te *TransferError
	require.ErrorAs(t, err, &te)
	require.Equal(t, TransferNotFound, te.Kind, "%v", err)
	require.Zero(t, allocs, "allocated for a token this process never offered")

	want := []byte("a payload of this process")
	d := Offer(Source{Bytes: want}, OfferOptions{})
	defer Withdraw(d.Token)
	d.Length++ // the right token, the wrong length
	_, _, err = FetchNew(testContext(t), d, alloc)
	require.ErrorAs(t, err, &te)
	require.Equal(t, TransferInvalid, te.Kind, "%v", err)
	require.Zero(t, allocs, "allocated for a length the payload does not have")
	d.Length--
	b, path, err := FetchNew(testContext(t), d, alloc)
	require.NoError(t, err)
	defer b.Release()
	require.Equal(t, PathLocal, path)
	require.Equal(t, 1, allocs)
	got, _ := b.HostBytes()
	require.Equal(t, want, got)
}
