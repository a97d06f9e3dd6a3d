package transport

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// recordConn records each Write it gets.
type recordConn struct {
	net.Conn
	writes [][]byte
	fail   error
}

func (c *recordConn) Write(b []byte) (int, error) {
	if c.fail != nil {
		return 0, c.fail
	}
	c.writes = append(c.writes, append([]byte(nil), b...))
	return len(b), nil
}

func yamuxHeader(typ byte, length uint32) []byte {
	h := make([]byte, yamuxHeaderLen)
	h[1] = typ
	binary.BigEndian.PutUint32(h[4:], 3) // stream id
	binary.BigEndian.PutUint32(h[8:], length)
	return h
}

func TestUnderConnCoalesces(t *testing.T) {
	rc := &recordConn{}
	u := newUnderConn(rc)
	small := bytes.Repeat([]byte{1}, 100)
	big := bytes.Repeat([]byte{2}, coalesceMax+1)

	// A data frame with a small body: one write, header then body.
	n, err := u.Write(yamuxHeader(0, uint32(len(small))))
	require.NoError(t, err)
	require.Equal(t, yamuxHeaderLen, n)
	require.Empty(t, rc.writes)
	n, err = u.Write(small)
	require.NoError(t, err)
	require.Equal(t, len(small), n)
	require.Len(t, rc.writes, 1)
	require.Equal(t, append(yamuxHeader(0, 100), small...), rc.writes[0])

	// Window updates, pings and empty data frames pass through at once.
	for _, h := range [][]byte{yamuxHeader(1, 5), yamuxHeader(2, 7), yamuxHeader(0, 0)} {
		rc.writes = nil
		_, err = u.Write(h)
		require.NoError(t, err)
		require.Equal(t, [][]byte{h}, rc.writes)
	}

	// A big body on a non-TCP conn: header, then body.
	rc.writes = nil
	_, err = u.Write(yamuxHeader(0, uint32(len(big))))
	require.NoError(t, err)
	_, err = u.Write(big)
	require.NoError(t, err)
	require.Equal(t, [][]byte{yamuxHeader(0, uint32(len(big))), big}, rc.writes)

	// A body of another length than announced still goes out in order.
	rc.writes = nil
	_, err = u.Write(yamuxHeader(0, 10))
	require.NoError(t, err)
	_, err = u.Write(small)
	require.NoError(t, err)
	require.Equal(t, [][]byte{yamuxHeader(0, 10), small}, rc.writes)

	// The first error is kept as the cause.
	boom := errors.New("boom")
	rc.fail = boom
	_, err = u.Write(yamuxHeader(0, 100))
	require.NoError(t, err) // kept for the body
	_, err = u.Write(small)
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, u.firstErr(), boom)
}
