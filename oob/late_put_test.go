package oob

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/devicebuf/devicebuftest"
	"github.com/gdrpc/gdrpc/transport"
	"github.com/gdrpc/gdrpc/transport/transporttest"
)

// TestNoPutAfterFetchFailed: a receiver whose session ends while the owner's
// put into its destination is under way gets the destination back from
// Fetch only once the session's endpoint is released: UCX copies a put that
// arrives to the address it names until then, and the caller may hand the
// memory to someone else as soon as Fetch returns.
func TestNoPutAfterFetchFailed(t *testing.T) {
	setTransferConfig(t, TransferConfig{Timeout: testTimeout, Limits: Limits{Abandoned: time.Hour}})
	rc := ucxContext(t, "tcp")
	const n = 64 << 20
	var owner *transport.Session
	ownerSet := make(chan struct{})
	started := make(chan struct{}, 1)
	putDone := make(chan error, 1)
	interceptControl(t, ctlRTR, func(s *transport.Session, p []byte) bool {
		<-ownerSet
		if s != owner {
			return false
		}
		m, err := parseRTR(p)
		require.NoError(t, err)
		require.NotZero(t, m.Offers&PathRDMA)
		// The put goes in one piece, as one into GPU memory does: the
		// key's header and its rkey name CUDA memory.
		key := bytes.Clone(m.RKey)
		key[5], key[28+8] = 1, 1
		ep := s.Endpoint()
		k, err := ep.UnpackKey(key)
		require.NoError(t, err)
		go func() {
			defer k.Close()
			err := ep.PutBytes(context.Background(), bytes.Repeat([]byte{0xab}, n), m.RAddr, k)
			if err == nil {
				err = ep.Flush(context.Background())
			}
			putDone <- err
		}()
		started <- struct{}{}
		return true
	})
	ucx := []transport.Option{transport.WithRDMAContext(rc), transport.WithMode(transport.ModeUCX)}
	_, cs, ss, _, _ := lanePair(t, ucx, ucx)
	owner = ss
	close(ownerSet)

	buf := make([]byte, n)
	dst := devicebuf.HostFromBytes(buf)
	defer dst.Release()
	go func() {
		<-started
		_ = cs.Close() // the receiver's session ends while the put goes
	}()
	_, err := Fetch(context.Background(), Descriptor{Owner: cs.Peer().ID, Token: newToken(), Length: n, Kind: devicebuf.Host, Device: -1}, dst)
	require.Error(t, err)
	clear(buf) // the caller's again
	<-putDone
	<-cs.Released() // nothing lands after this
	require.Zero(t, n-bytes.Count(buf, []byte{0}), "bytes the owner's put wrote after Fetch returned")
	require.Eventually(t, func() bool { return numPulls() == 0 }, 10*time.Second, time.Millisecond)
}

// TestRTRWriteFailedAfterItWent: an RTR whose write fails after its bytes
// left may reach the owner all the same, which may then write into the
// destination (here by CUDA IPC, which a trusted peer on this host is
// offered). Such a pull is not carried into the same destination by another
// session, and a destination the caller gave is the caller's again only once
// the session can write no more: its connection released, which here comes
// late, as a UCX endpoint's does while its close lingers. An RTR of which
// nothing was written, its session closed, may go by another session.
func TestRTRWriteFailedAfterItWent(t *testing.T) {
	fake := devicebuftest.Install(t, 1)
	t.Cleanup(func() { require.NoError(t, CloseHostPools()) })
	token := newToken()
	c1, c2 := net.Pipe()
	conn := &failAfterWrite{Conn: c1, mark: token[:], failed: make(chan struct{}), letClose: make(chan struct{})}
	var once sync.Once
	letClose := func() { once.Do(func() { close(conn.letClose) }) }
	t.Cleanup(letClose)
	side := func() []transport.Option {
		return []transport.Option{transport.WithEngine(Engine()), transport.WithIdentity(transport.NewIdentity()),
			transport.WithMode(transport.ModeTCP), transport.WithLanes(false), transport.WithTrustPeers(true)}
	}
	cs, ss := transporttest.PairOver(t, conn, c2, side(), side())
	rtrs := make(chan *rtr, 2)
	interceptRTRs(t, ss, func(m *rtr) { rtrs <- m })
	go func() {
		<-conn.failed
		time.AfterFunc(100*time.Millisecond, letClose) // the lingering close
	}()

	const n = 1 << 20
	gpu, err := devicebuf.NewCUDAAllocator(0)
	require.NoError(t, err)
	dst, err := gpu.Alloc(n)
	require.NoError(t, err)
	d := Descriptor{Owner: cs.PeerID(), Token: token, Length: n, Kind: devicebuf.CUDA, Device: 0, DeviceUUID: dst.DeviceUUID(), HostID: transport.LocalHostID()}
	ctx := context.WithValue(testContext(t), callerDstKey{}, true)
	_, err = fetchVia(ctx, cs, d, dst, func() {})
	require.Error(t, err)
	require.NotErrorIs(t, err, errRTRNotSent, "an RTR that may have gone is not sent again")
	select {
	case <-cs.Released():
	default:
		t.Fatal("the caller's destination came back while the session could still write into it")
	}
	require.NotZero(t, (<-rtrs).Offers&PathCUDAIPC, "the owner got the RTR, and with it dst's IPC handle")

	d.Token = newToken()
	_, err = fetchVia(ctx, cs, d, dst, func() {})
	require.ErrorIs(t, err, errRTRNotSent, "nothing of the RTR was written: another session may carry the pull")
	dst.Release()
	require.Eventually(t, func() bool {
		return numPulls() == 0 && devicebuf.Live().CUDABuffers == 0 && fake.Allocations() == 0
	}, 10*time.Second, time.Millisecond, "pulls, or their destination, left over")
}

// failAfterWrite is a connection whose write of bytes that hold mark goes
// out whole and then reports a failure, as a write whose connection broke
// after its bytes left does. Its Close waits for letClose.
type failAfterWrite struct {
	net.Conn
	mark     []byte
	failed   chan struct{} // closed at that write
	letClose chan struct{}
	once     sync.Once
}

func (c *failAfterWrite) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err == nil && bytes.Contains(p, c.mark) {
		c.once.Do(func() { close(c.failed) })
		return n, errors.New("the connection broke after the write went")
	}
	return n, err
}

func (c *failAfterWrite) Close() error {
	<-c.letClose
	return c.Conn.Close()
}
