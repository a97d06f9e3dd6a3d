package rdma

import (
	"bytes"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPollTime(t *testing.T) {
	tests := []struct {
		name string
		env  string // "" leaves PollEnv unset
		opts []Option
		want time.Duration
		warn bool
	}{
		{name: "default", want: DefaultPollTime},
		{name: "env", env: "250us", want: 250 * time.Microsecond},
		{name: "env zero", env: "0", want: 0},
		{name: "env bad", env: "soon", want: DefaultPollTime, warn: true},
		{name: "env negative", env: "-1ms", want: DefaultPollTime, warn: true},
		{name: "option over env", env: "250us", opts: []Option{WithPollTime(2 * time.Millisecond)}, want: 2 * time.Millisecond},
		{name: "option negative", opts: []Option{WithPollTime(-time.Second)}, want: 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(PollEnv, tc.env) // restored after the test
			if tc.env == "" {
				require.NoError(t, os.Unsetenv(PollEnv))
			}
			var log bytes.Buffer
			o := buildOptions(append(tc.opts, WithLogger(slog.New(slog.NewTextHandler(&log, nil)))))
			require.Equal(t, tc.want, o.pollTime)
			if tc.warn {
				require.Contains(t, log.String(), PollEnv)
			} else {
				require.Empty(t, log.String())
			}
		})
	}
}
