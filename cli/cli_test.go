package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/cli"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// century is a fixed window of 100 years starting in 2000: values in it do not move while a test
// runs, so the numbers are exact with the database's clock.
var (
	centuryStart = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	century      = ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: ratelimit.MaxPeriod, Start: centuryStart}
)

const configFile = `{
  "century": {"kind": "fixed-window", "rate": 5, "period": "876000h", "start": "2000-01-01T00:00:00Z"},
  "fast":    {"rate": 1000, "period": "1s", "capacity": 1}
}`

type result struct {
	code           int
	stdout, stderr string
}

// run runs the command in-process with DATABASE_URL set to dsn.
func run(t *testing.T, dsn string, opts *cli.Options, args ...string) result {
	t.Helper()
	var stdout, stderr bytes.Buffer
	o := cli.Options{}
	if opts != nil {
		o = *opts
	}
	o.Getenv = func(k string) string {
		if k == "DATABASE_URL" {
			return dsn
		}
		return ""
	}
	code := cli.Run(context.Background(), args, &stdout, &stderr, &o)
	return result{code, stdout.String(), stderr.String()}
}

func TestCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testdb.NewSchema(t)
	dsn := testdb.DSN(t)
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "limits.json")
	require.NoError(t, os.WriteFile(cfgPath, []byte(configFile), 0o600))
	s := []string{"--schema", schema, "--config", cfgPath}

	// Migrations: all pending, then applied, as text and JSON.
	r := run(t, dsn, nil, append([]string{"migrate", "status", "--json"}, s...)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	var st struct{ Migrations []cli.MigrationJSON }
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.NotEmpty(t, st.Migrations)
	for _, m := range st.Migrations {
		require.Equal(t, "pending", m.State)
	}
	r = run(t, dsn, nil, append(s, "migrate", "up")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, len(st.Migrations), strings.Count(r.stdout, "up    "))
	r = run(t, dsn, nil, append(s, "--json", "migrate", "status")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	for _, m := range st.Migrations {
		require.Equal(t, "applied", m.State)
		require.NotNil(t, m.AppliedAt)
	}

	// Seed through the library, as the application would.
	pool, err := pgxpool.New(ctx, testdb.SchemaURL(t, schema))
	require.NoError(t, err)
	defer pool.Close()
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"century": century, "fast": {Rate: 1000, Period: time.Second, Capacity: 1},
	}})
	require.NoError(t, err)
	res, err := lim.LimitN(ctx, pool, "century", "user-42", 5, nil)
	require.NoError(t, err)
	require.True(t, res.OK)
	_, err = lim.Limit(ctx, pool, "fast", "k", nil)
	require.NoError(t, err)

	// inspect, text.
	r = run(t, dsn, nil, append([]string{"inspect", "century", "user-42"}, s...)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	windowEnd := centuryStart.Add(ratelimit.MaxPeriod)
	require.Contains(t, r.stdout, "value   0\n")
	require.Contains(t, r.stdout, "shard 0 0\n")
	require.Contains(t, r.stdout, "next    "+windowEnd.Format(time.RFC3339Nano))
	require.Contains(t, r.stdout, "config  fixed window 5/876000h0m0s")

	// inspect, JSON.
	r = run(t, dsn, nil, append([]string{"inspect", "--json", "century", "user-42"}, s...)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	var in cli.InspectJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &in))
	require.Equal(t, 0.0, in.Value)
	require.Equal(t, []float64{0}, in.Shards)
	require.True(t, in.NextToken.Equal(windowEnd), "next token %s, want %s", in.NextToken, windowEnd)
	require.True(t, in.NextTokenExact)
	require.NotNil(t, in.LastWrite)
	require.False(t, in.At.IsZero())

	// The same limit from the application's own definitions (Options.Limits), and ad hoc.
	r = run(t, dsn, &cli.Options{Limits: map[string]ratelimit.Config{"century": century}}, "--schema", schema, "--json", "inspect", "century", "user-42")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &in))
	require.Equal(t, 0.0, in.Value)
	r = run(t, dsn, nil, "--schema", schema, "--json", "inspect", "century", "user-42",
		"--kind", "fixed-window", "--rate", "5", "--period", "876000h", "--start", "2000-01-01T00:00:00Z", "--capacity", "10")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &in))
	require.Equal(t, 0.0, in.Value) // the row's value; capacity only caps refills
	require.Equal(t, "fixed window 5/876000h0m0s cap 10", in.Config)

	// A key without a row is full; "next" is now.
	r = run(t, dsn, nil, append([]string{"inspect", "century", "nobody"}, s...)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, "value   5\n")
	require.Contains(t, r.stdout, "written never")
	require.Contains(t, r.stdout, "next    now\n")

	// prune: "fast" refilled within a millisecond, "century" owes.
	time.Sleep(5 * time.Millisecond)
	r = run(t, dsn, nil, append([]string{"prune", "--json"}, s...)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	var pr cli.PruneJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &pr))
	require.Equal(t, cli.PruneJSON{Deleted: map[string]int64{"century": 0, "fast": 1}, Total: 1}, pr)

	// reset, then the key is full again.
	r = run(t, dsn, nil, append([]string{"reset", "century", "user-42"}, s...)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	st2, err := lim.State(ctx, pool, "century", "user-42", nil)
	require.NoError(t, err)
	require.Equal(t, 5.0, st2.Value)

	// migrate down removes the last migration; up applies it again.
	r = run(t, dsn, nil, append(s, "migrate", "down")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.True(t, strings.HasPrefix(r.stdout, "down  "), r.stdout)
	r = run(t, dsn, nil, append(s, "migrate", "up", "--json")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Len(t, st.Migrations, 1)
}

func TestCommandExitCodes(t *testing.T) {
	t.Parallel()
	schema := testdb.NewSchema(t)
	dsn := testdb.DSN(t)
	down := "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=5"
	cases := []struct {
		name   string
		dsn    string
		args   []string
		code   int
		stderr string
	}{
		{"no command", dsn, nil, cli.ExitUsage, "no command"},
		{"unknown command", dsn, []string{"frobnicate"}, cli.ExitUsage, `unknown command "frobnicate"`},
		{"unknown flag", dsn, []string{"inspect", "--nope", "a", "b"}, cli.ExitUsage, "flag provided but not defined: -nope"},
		{"bad flag value", dsn, []string{"inspect", "a", "b", "--rate", "x"}, cli.ExitUsage, "invalid value"},
		{"missing key", dsn, []string{"inspect", "a"}, cli.ExitUsage, "inspect takes NAME KEY"},
		{"bad direction", dsn, []string{"migrate", "sideways"}, cli.ExitUsage, "migrate takes one of up, down, status"},
		{"half an ad-hoc config", dsn, []string{"inspect", "a", "b", "--rate", "5"}, cli.ExitUsage, "needs --rate and --period"},
		{"no DSN", "", []string{"inspect", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitUsage, "set DATABASE_URL or pass --dsn"},
		{"nothing to prune", dsn, []string{"prune"}, cli.ExitUsage, "no limits to prune"},
		{"unknown limit", dsn, []string{"inspect", "nope", "k"}, cli.ExitInvalid, `unknown limit "nope"`},
		{"invalid ad-hoc config", dsn, []string{"inspect", "a", "b", "--rate", "-1", "--period", "1s"}, cli.ExitInvalid, "Rate"},
		{"database down: inspect", down, []string{"inspect", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, "connect"},
		{"database down: migrate", down, []string{"migrate", "status"}, cli.ExitDatabase, "connect"},
		{"database down: reset", down, []string{"reset", "a", "b"}, cli.ExitDatabase, "connect"},
		{"not migrated", dsn, []string{"--schema", schema, "inspect", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, "txlimit_state"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := run(t, c.dsn, nil, c.args...)
			require.Equal(t, c.code, r.code, "stderr: %s", r.stderr)
			require.Contains(t, r.stderr, c.stderr)
			require.Empty(t, r.stdout)

			// With --json, the error is one JSON object carrying the same exit code.
			r = run(t, c.dsn, nil, append([]string{"--json"}, c.args...)...)
			require.Equal(t, c.code, r.code)
			var e struct {
				Error    string `json:"error"`
				ExitCode int    `json:"exit_code"`
			}
			require.NoError(t, json.Unmarshal([]byte(r.stderr), &e), r.stderr)
			require.Equal(t, c.code, e.ExitCode)
			require.Contains(t, e.Error, c.stderr)
		})
	}
}

func TestCommandHelp(t *testing.T) {
	t.Parallel()
	r := run(t, "", nil, "-h")
	require.Equal(t, cli.ExitOK, r.code)
	require.Contains(t, r.stderr, "usage: txlimit [flags] migrate up|down|status")
	require.Contains(t, r.stderr, "-rate float")
}

func TestLoadLimits(t *testing.T) {
	t.Parallel()
	limits, err := cli.LoadLimits(strings.NewReader(configFile))
	require.NoError(t, err)
	require.Equal(t, map[string]ratelimit.Config{"century": century, "fast": {Rate: 1000, Period: time.Second, Capacity: 1}}, limits)

	for _, bad := range []string{
		`{"a": {"rate": 1, "period": "1s", "burst": 3}}`, // unknown field
		`{"a": {"rate": 1}}`,                             // no period
		`{"a": {"rate": 1, "period": "soon"}}`,
		`{"a": {"rate": 1, "period": "1s", "kind": "leaky"}}`,
		`[1, 2]`,
	} {
		_, err := cli.LoadLimits(strings.NewReader(bad))
		require.Error(t, err, bad)
		require.NotErrorIs(t, err, ratelimit.ErrInvalid, bad)
	}
	_, err = cli.LoadLimits(strings.NewReader(`{"a": {"rate": 0, "period": "1s"}}`))
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
}
