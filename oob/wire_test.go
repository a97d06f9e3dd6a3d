package oob

import (
	"bytes"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gdrpc/gdrpc/devicebuf"
	"github.com/gdrpc/gdrpc/transport"
)

func TestRTRRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		m    rtr
	}{
		{name: "stream", m: rtr{Req: 1, Token: Token{1, 2}, Length: 7, Offers: PathStream}},
		{name: "rdma", m: rtr{Req: 2, Token: Token{3}, Length: 1 << 30, Offers: PathStream | PathRDMA, RAddr: 0xdeadbeef000, RKey: []byte("key"), RMemory: 1}},
		{name: "ipc", m: rtr{Req: 3, Token: Token{4}, Length: 9, Offers: PathStream | PathCUDAIPC, IPC: devicebuf.IPCHandle{9, 8}, IPCOffset: 4096, IPCDevice: "GPU-1234"}},
		{name: "all", m: rtr{Req: 4, Token: Token{5}, Length: 1, Offers: PathStream | PathCUDAIPC | PathRDMA, RKey: []byte{}, IPCDevice: "GPU-x"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseRTR(tt.m.marshal())
			require.NoError(t, err)
			if tt.m.RKey == nil && got.RKey != nil && len(got.RKey) == 0 {
				got.RKey = nil
			}
			if len(tt.m.RKey) == 0 {
				got.RKey, tt.m.RKey = nil, nil
			}
			require.Equal(t, tt.m, *got)
		})
	}
}

func TestRTRMalformed(t *testing.T) {
	good := (&rtr{Req: 2, Token: Token{3}, Length: 5, Offers: PathStream | PathRDMA, RKey: []byte("key")}).marshal()
	for n := range len(good) {
		_, err := parseRTR(good[:n])
		require.Error(t, err, "truncated to %d bytes", n)
	}
	_, err := parseRTR(append(bytes.Clone(good), 0))
	require.ErrorContains(t, err, "trailing")
	bad := bytes.Clone(good)
	bad[0] = 9
	_, err = parseRTR(bad)
	require.ErrorContains(t, err, "version")
	bad = bytes.Clone(good)
	bad[1+8+16+8] = 0x80
	_, err = parseRTR(bad)
	require.ErrorContains(t, err, "unknown paths")
}

// TestKeyFitsRTR: a receiver offers only keys the owner's parse takes, so a
// key too long for an RTR makes the receiver choose another path rather than
// send an RTR the owner drops (and wait for a FIN that never comes).
func TestKeyFitsRTR(t *testing.T) {
	for _, n := range []int{0, 1, maxRKey - 1, maxRKey, maxRKey + 1, 1 << 16} {
		key := make([]byte, n)
		fits := keyFitsRTR(key) == nil
		m := rtr{Req: 1, Token: Token{1}, Length: 1, Offers: PathStream | PathRDMA, RKey: key}
		_, err := parseRTR(m.marshal())
		require.Equal(t, err == nil, fits, "key of %d bytes: keyFitsRTR %v, the owner's parse %v", n, fits, err)
	}
}

func TestFINRoundTrip(t *testing.T) {
	m := fin{Req: 77, Status: finUnknownToken, Path: PathRDMA, Msg: "unknown or expired token"}
	got, err := parseFIN(m.marshal())
	require.NoError(t, err)
	require.Equal(t, m, *got)
	long := fin{Msg: string(make([]byte, 5000))}
	got, err = parseFIN(long.marshal())
	require.NoError(t, err)
	require.Len(t, got.Msg, maxFinMsg)
	b := m.marshal()
	b[9] = 200
	_, err = parseFIN(b)
	require.ErrorContains(t, err, "status")
}

func TestDescriptorValidate(t *testing.T) {
	good := Descriptor{Owner: transport.ID{1}, Token: Token{2}, Length: 10, Kind: devicebuf.Host, Device: -1}
	require.NoError(t, good.Validate())
	for name, mutate := range map[string]func(*Descriptor){
		"no owner":  func(d *Descriptor) { d.Owner = transport.ID{} },
		"no token":  func(d *Descriptor) { d.Token = Token{} },
		"too long":  func(d *Descriptor) { d.Length = MaxPayload + 1 },
		"bad kind":  func(d *Descriptor) { d.Kind = 7 },
		"long uuid": func(d *Descriptor) { d.DeviceUUID = string(make([]byte, 65)) },
	} {
		d := good
		mutate(&d)
		require.Error(t, d.Validate(), name)
	}
}

func FuzzParseRTR(f *testing.F) {
	f.Add((&rtr{Req: 1, Token: Token{1}, Length: 3, Offers: PathStream}).marshal())
	f.Add((&rtr{Req: 2, Token: Token{3}, Length: 5, Offers: PathStream | PathRDMA | PathCUDAIPC, RKey: []byte("key"), IPCDevice: "GPU-1"}).marshal())
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseRTR(b)
		if err != nil {
			return
		}
		// What parses re-encodes to the same bytes.
		require.Equal(t, b, m.marshal())
	})
}

// A SPACE comes from a peer: whatever it holds parses to an error or to a
// space with at most maxSpaceEvents events (and events only for a CUDA IPC
// space), which re-encodes to the same bytes, or, from a sender that
// offered no events, to those bytes and a zero count.
func FuzzParseSpace(f *testing.F) {
	ipc := rtr{Req: 2, Token: Token{3}, Length: 4 << 20, Offers: PathCUDAIPC, IPCDevice: "GPU-1"}
	f.Add((&spaceMsg{rtr: rtr{Req: 1, Token: Token{1}, Length: 1 << 20, Offers: PathRDMA, RKey: []byte("key")}}).marshal())
	f.Add((&spaceMsg{rtr: ipc, Events: make([]devicebuf.IPCEventHandle, 3)}).marshal())
	f.Add(ipc.marshal())
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseSpace(b)
		if err != nil {
			return
		}
		require.LessOrEqual(t, len(m.Events), maxSpaceEvents)
		if len(m.Events) > 0 {
			require.Equal(t, PathCUDAIPC, m.Offers)
		}
		if got := m.marshal(); !bytes.Equal(got, b) {
			require.Equal(t, append(slices.Clone(b), 0), got, "re-encoded")
		}
	})
}

func FuzzParseFIN(f *testing.F) {
	f.Add((&fin{Req: 1, Status: finFailed, Path: PathStream, Msg: "boom"}).marshal())
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseFIN(b)
		if err != nil {
			return
		}
		require.Equal(t, b, m.marshal())
	})
}

func FuzzParseBulkHeader(f *testing.F) {
	f.Add(bulkHeader(5, 1<<20))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, n, err := parseBulkHeader(b)
		if err != nil {
			return
		}
		require.Equal(t, b, bulkHeader(req, n))
	})
}

func TestLaneFrameMalformed(t *testing.T) {
	good := laneFrame{kind: laneData, req: 3, total: 10, off: 4, n: 6}
	f, err := parseLaneFrame(good.marshal())
	require.NoError(t, err)
	require.Equal(t, good, f)
	for name, tc := range map[string]struct {
		b   []byte
		msg string
	}{
		"short":       {good.marshal()[:laneFrameLen-1], "bulk lane frame"},
		"trailing":    {append(good.marshal(), 0), "trailing"},
		"version":     {append([]byte{wireVersion + 1}, good.marshal()[1:]...), "version"},
		"kind":        {laneFrame{kind: 2, total: 1, n: 1}.marshal(), "kind 2"},
		"past end":    {laneFrame{total: 10, off: 4, n: 7}.marshal(), "piece [4, +7) of a 10-byte transfer"},
		"offset":      {laneFrame{total: 10, off: 11}.marshal(), "piece [11, +0)"},
		"abort body":  {laneFrame{kind: laneAbort, total: 10, n: 1}.marshal(), "abort with 1 bytes"},
		"empty piece": {laneFrame{total: 10, off: 3}.marshal(), "empty piece of a 10-byte transfer"},
		"too big":     {laneFrame{total: 1 << 30, n: laneFrameMax + 1}.marshal(), "exceeds"},
		"huge":        {laneFrame{total: MaxPayload + 1}.marshal(), "exceeds"},
	} {
		_, err := parseLaneFrame(tc.b)
		require.ErrorContains(t, err, tc.msg, name)
	}
}

func FuzzParseLaneFrame(f *testing.F) {
	f.Add(laneFrame{kind: laneData, req: 3, total: 10, off: 4, n: 6}.marshal())
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseLaneFrame(b)
		if err != nil {
			return
		}
		require.Equal(t, b, m.marshal())
	})
}

func TestOutboxLifetime(t *testing.T) {
	before := devicebuf.Live()
	b, err := devicebuf.NewHostAllocator().Alloc(100)
	require.NoError(t, err)

	// Not held: gone after the first completed pull; the outbox's reference goes with it.
	d := Offer(Source{Buffer: b}, OfferOptions{})
	_, _, st, err := box.checkout(d.Token, 99, nil)
	require.Error(t, err)
	require.Equal(t, finBadLength, st)
	e, u, _, err := box.checkout(d.Token, 100, nil)
	require.NoError(t, err)
	require.True(t, box.checkin(d.Token, e, u, true))
	_, _, st, _ = box.checkout(d.Token, 100, nil)
	require.Equal(t, finUnknownToken, st)

	// Held: pulled any number of times until withdrawn; a withdraw during a pull
	// frees the source only when the pull ends.
	d = Offer(Source{Buffer: b}, OfferOptions{Held: true})
	for range 3 {
		e, u, _, err := box.checkout(d.Token, 100, nil)
		require.NoError(t, err)
		require.True(t, box.checkin(d.Token, e, u, true))
	}
	e, u, _, err = box.checkout(d.Token, 100, nil)
	require.NoError(t, err)
	Withdraw(d.Token)
	require.False(t, b.Released())
	require.False(t, box.checkin(d.Token, e, u, true), "a pull the withdraw ended did not complete")
	Withdraw(d.Token) // twice: nothing

	// The lease is the backstop.
	d = Offer(Source{Bytes: []byte("x")}, OfferOptions{Held: true, Lease: time.Millisecond})
	require.Eventually(t, func() bool {
		box.mu.Lock()
		defer box.mu.Unlock()
		_, ok := box.entries[d.Token]
		return !ok
	}, 5*time.Second, time.Millisecond)

	require.NoError(t, b.Release())
	require.Equal(t, 0, ReadStats().Offered)
	require.Equal(t, before, devicebuf.Live())
}

func FuzzParseChunkNotice(f *testing.F) {
	f.Add(rangeNotice(3, 4<<20, 4<<20))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, off, n, err := parseRangeNotice(b, "chunk notice")
		if err != nil {
			return
		}
		require.Equal(t, b, rangeNotice(req, off, n))
	})
}

// A SPACE-FREE names the write where the owner numbered it, and is a bare
// range notice where it did not (an older owner reads no more).
func TestFreeNotice(t *testing.T) {
	b := freeNotice(7, 4096, 8192, 3)
	req, off, n, gen, err := parseFreeNotice(b)
	require.NoError(t, err)
	require.Equal(t, [4]uint64{7, 4096, 8192, 3}, [4]uint64{req, off, n, gen})
	old := freeNotice(7, 4096, 8192, 0)
	require.Equal(t, rangeNotice(7, 4096, 8192), old)
	req, off, n, gen, err = parseFreeNotice(old)
	require.NoError(t, err)
	require.Equal(t, [4]uint64{7, 4096, 8192, 0}, [4]uint64{req, off, n, gen})
	for name, bad := range map[string][]byte{
		"short write number": b[:len(b)-1],
		"trailing":           append(b, 0),
		"version":            append([]byte{9}, b[1:]...),
	} {
		_, _, _, _, err := parseFreeNotice(bad)
		require.Error(t, err, name)
	}
}

func FuzzParseFreeNotice(f *testing.F) {
	f.Add(freeNotice(3, 4<<20, 4<<20, 9))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, off, n, gen, err := parseFreeNotice(b)
		if err != nil || gen == 0 {
			return
		}
		require.Equal(t, b, freeNotice(req, off, n, gen))
	})
}

func FuzzParseLinger(f *testing.F) {
	f.Add(lingerMsg(1))
	f.Add(lingerMsg(1<<63 - 1))
	f.Fuzz(func(t *testing.T, b []byte) {
		seq, err := parseLinger(b)
		if err != nil {
			return
		}
		require.Less(t, seq, uint64(1)<<63, "a sequence number that cannot be shifted into the linger word")
		require.Equal(t, b, lingerMsg(seq))
	})
}
