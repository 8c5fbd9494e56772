package cli_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/cli"
	"github.com/txlimit/txlimit/internal/testdb"
)

// inspect shows the state of every limit ratelimit accepts, including one that can never grant a
// whole token at once (a capacity below 1, or two of 1024 shards holding less than 1 together):
// it reports that no single token is ever due, instead of failing with exit 3 and "Check: count 1
// exceeds the capacity", a call and an argument the user never gave.
func TestCommandInspectCapacityBelowOne(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	_, s := migrated(t, dsn)
	for _, adhoc := range [][]string{
		{"--rate", "0.5", "--period", "1s"},
		{"--rate", "100", "--period", "1s", "--shards", "1024"},
	} {
		r := run(t, dsn, nil, append(append(append([]string{}, s...), "inspect", "bytes", "u1"), adhoc...)...)
		require.Equal(t, cli.ExitOK, r.code, "%v: %s", adhoc, r.stderr)
		require.Contains(t, r.stdout, "next    never", adhoc)

		r = run(t, dsn, nil, append(append(append([]string{}, s...), "--json", "inspect", "bytes", "u1"), adhoc...)...)
		require.Equal(t, cli.ExitOK, r.code, "%v: %s", adhoc, r.stderr)
		var in cli.InspectJSON
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &in))
		require.Nil(t, in.NextToken, adhoc)
		require.Positive(t, in.Value, adhoc)
	}
}

// A --timeout of zero or less is a usage error naming the flag (exit 2), not a database failure:
// it was "connect: context deadline exceeded", exit 1, before any connection was tried.
func TestCommandTimeoutNotPositive(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	for _, d := range []string{"0", "-1s"} {
		for _, args := range [][]string{
			{"inspect", "x", "k", "--rate", "1", "--period", "1s"},
			{"migrate", "status"},
		} {
			r := run(t, dsn, nil, append(args, "--timeout", d)...)
			require.Equal(t, cli.ExitUsage, r.code, "%v --timeout %s: %s", args, d, r.stderr)
			require.Contains(t, r.stderr, "--timeout must be > 0")
		}
	}
}
