package rdma

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestErrors(t *testing.T) {
	unsup := &StatusError{Op: "ucp_mem_map", Status: statusUnsupported, Msg: "Unsupported operation"}
	require.ErrorIs(t, unsup, ErrNotSupported)
	require.Contains(t, unsup.Error(), "ucp_mem_map")
	require.NotErrorIs(t, &StatusError{Op: "x", Status: statusConnReset}, ErrNotSupported)

	ee := newEndpointError("endpoint", statusConnReset, "Connection reset by remote peer")
	var se *StatusError
	require.ErrorAs(t, ee, &se)
	require.Equal(t, statusConnReset, se.Status)
	require.Contains(t, ee.Error(), "Connection reset")

	var te error = &timeoutError{op: "read"}
	var ne net.Error
	require.ErrorAs(t, te, &ne)
	require.True(t, ne.Timeout())
	require.ErrorIs(t, te, os.ErrDeadlineExceeded)

	require.ErrorIs(t, closedError("read"), net.ErrClosed)
	require.ErrorIs(t, errPeerClosed, io.EOF)
	require.False(t, errors.Is(ErrBadKey, ErrNotSupported))
}

func TestMayUseMM(t *testing.T) {
	for _, tt := range []struct {
		tls  string
		want bool
	}{
		{"", true}, {"all", true}, {"tcp", false}, {"tcp,self", false}, {"posix,sysv,cma,tcp", true},
		{"^posix", true}, {"sm", true}, {" SHM ", true}, {"rc,ud", false},
	} {
		require.Equal(t, tt.want, mayUseMM(tt.tls), tt.tls)
	}
}
