package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/cli"
	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// century is a fixed window of 100 years starting in 2000: values in it do not move while a test
// runs, so the numbers are exact with the database's clock.
var (
	centuryStart = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	centuryLen   = 100 * 365 * 24 * time.Hour // the longest Period ratelimit accepts
	century      = ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: centuryLen, Start: centuryStart}
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

// TestCommand runs every command, and so every statement the command sends, in the exec mode it
// chooses itself (exec) and in each mode docs/deploy.md calls safe behind a transaction pooler,
// chosen by the DSN's default_query_exec_mode.
func TestCommand(t *testing.T) {
	t.Parallel()
	for _, mode := range append([]string{"the command's own"}, safeModeNames()...) {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			schema := testdb.NewSchema(t)
			dsn := withExecMode(t, testdb.DSN(t), mode)
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
			windowEnd := centuryStart.Add(centuryLen)
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

			// names: every name in the table, with its rows and the config the command knows.
			r = run(t, dsn, nil, append([]string{"names"}, s...)...)
			require.Equal(t, cli.ExitOK, r.code, r.stderr)
			require.Equal(t, ""+
				"NAME          ROWS  CONFIG\n"+
				"century          1  fixed window 5/876000h0m0s\n"+
				"fast             1  token bucket 1000/1s cap 1\n"+
				"total            2\n", r.stdout)

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

			// migrate down (confirmed with --yes) removes the last migration; up applies it again.
			r = run(t, dsn, nil, append(s, "migrate", "down", "--yes")...)
			require.Equal(t, cli.ExitOK, r.code, r.stderr)
			require.True(t, strings.HasPrefix(r.stdout, "down  "), r.stdout)
			r = run(t, dsn, nil, append(s, "migrate", "up", "--json")...)
			require.Equal(t, cli.ExitOK, r.code, r.stderr)
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
			require.Len(t, st.Migrations, 1, "the one rolled back, applied again")
		})
	}
}

// safeModeNames are the names of pgbouncertest.SafeModes, the values of default_query_exec_mode
// docs/deploy.md calls safe.
func safeModeNames() []string {
	var names []string
	for _, m := range pgbouncertest.SafeModes {
		names = append(names, m.Name)
	}
	return names
}

// withExecMode is dsn with default_query_exec_mode set to mode, or dsn itself when mode is not
// one of pgx's modes.
func withExecMode(t *testing.T, dsn, mode string) string {
	t.Helper()
	if !slices.Contains(safeModeNames(), mode) {
		return dsn
	}
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return dsn + " default_query_exec_mode=" + mode // a key=value string
	}
	q := u.Query()
	q.Set("default_query_exec_mode", mode)
	u.RawQuery = q.Encode()
	return u.String()
}

func TestCommandExitCodes(t *testing.T) {
	t.Parallel()
	schema := testdb.NewSchema(t)
	dsn := testdb.DSN(t)
	down := "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=5"
	const unknownNope = `txlimit: give limit "nope" a config in --config FILE, or with --rate and --period (unknown limit; no limit is configured: no --config given)` + "\n"
	callsOnly := filepath.Join(t.TempDir(), "calls.json")
	require.NoError(t, os.WriteFile(callsOnly, []byte(`{"calls": {"rate": 10, "period": "1m"}}`), 0o600))
	const unknownNopeConfigured = `txlimit: give limit "nope" a config in --config FILE, or with --rate and --period (unknown limit; configured: calls)` + "\n"
	emptyConfig := filepath.Join(t.TempDir(), "empty.json")
	require.NoError(t, os.WriteFile(emptyConfig, []byte(`{}`), 0o600))
	unknownNopeEmpty := `txlimit: give limit "nope" a config in --config FILE, or with --rate and --period (unknown limit; no limit is configured: ` +
		emptyConfig + ` defines none)` + "\n"
	notMigratedBy := func(missing string) string {
		return `txlimit: not migrated: run "txlimit migrate up --schema ` + schema + `" (on the same database), or pass --schema with the schema txlimit ` +
			`was migrated into (search_path "` + schema + `": ` + missing + `)` + "\n"
	}
	notMigrated := notMigratedBy(`relation "txlimit_state" does not exist, SQLSTATE 42P01`)
	noClock := notMigratedBy(`function txlimit_clock does not exist, SQLSTATE 42883`)      // what prune reads first
	noLevels := notMigratedBy(`function txlimit_levels_v1 does not exist, SQLSTATE 42883`) // what inspect (State) calls
	noReset := notMigratedBy(`function txlimit_reset_v1 does not exist, SQLSTATE 42883`)
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
		{"ad-hoc config without NAME: prune", dsn, []string{"prune", "--rate", "1", "--period", "1s"}, cli.ExitUsage, "an ad-hoc config needs the limit's NAME"},
		{"ad-hoc config: names", dsn, []string{"names", "--rate", "1", "--period", "1s"}, cli.ExitUsage, "names takes no ad-hoc config"},
		{"names takes no argument", dsn, []string{"names", "x"}, cli.ExitUsage, "names takes no argument"},
		{"--yes without down", dsn, []string{"migrate", "up", "--yes"}, cli.ExitUsage, "--yes is for migrate down"},
		{"--create-schema without up", dsn, []string{"migrate", "status", "--create-schema"}, cli.ExitUsage, "--create-schema is for migrate up"},
		{"unknown limit: inspect", dsn, []string{"inspect", "nope", "k"}, cli.ExitInvalid, unknownNope},
		{"unknown limit: reset", dsn, []string{"reset", "nope", "k"}, cli.ExitInvalid, unknownNope},
		{"unknown limit: prune", dsn, []string{"prune", "nope"}, cli.ExitInvalid, unknownNope},
		{"unknown limit with --config: reset", dsn, []string{"--schema", schema, "--config", callsOnly, "reset", "nope", "k"}, cli.ExitInvalid, unknownNopeConfigured},
		{"unknown limit with --config: inspect", dsn, []string{"--schema", schema, "--config", callsOnly, "inspect", "nope", "k"}, cli.ExitInvalid, unknownNopeConfigured},
		{"unknown limit with an empty --config: reset", dsn, []string{"--schema", schema, "--config", emptyConfig, "reset", "nope", "k"}, cli.ExitInvalid, unknownNopeEmpty},
		{"bad key: reset", dsn, []string{"reset", "nope", "a\x00b", "--rate", "1", "--period", "1s"}, cli.ExitInvalid,
			"KEY contains a NUL byte, which Postgres text cannot hold"},
		{"invalid ad-hoc config", dsn, []string{"inspect", "a", "b", "--rate", "-1", "--period", "1s"}, cli.ExitInvalid, "--rate must not be negative (got -1)"},
		{"invalid ad-hoc config: kind", dsn, []string{"inspect", "a", "b", "--rate", "1", "--period", "1s", "--start", "2026-01-01T00:00:00Z"},
			cli.ExitInvalid, "--start applies only to a fixed window: give --kind fixed-window, or no --start (got 2026-01-01 00:00:00 +0000 UTC)"},
		{"database down: inspect", down, []string{"inspect", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, "connect"},
		{"database down: migrate", down, []string{"migrate", "status"}, cli.ExitDatabase, "connect"},
		{"database down: reset", down, []string{"reset", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, "connect"},
		{"database down: names", down, []string{"names"}, cli.ExitDatabase, "connect"},
		{"not migrated: inspect", dsn, []string{"--schema", schema, "inspect", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, noLevels},
		{"not migrated: reset", dsn, []string{"--schema", schema, "reset", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, noReset},
		{"not migrated: prune NAME", dsn, []string{"--schema", schema, "prune", "a", "--rate", "1", "--period", "1s"}, cli.ExitDatabase, noClock},
		{"not migrated: prune", dsn, []string{"--schema", schema, "prune"}, cli.ExitDatabase, notMigrated},
		{"not migrated: names", dsn, []string{"--schema", schema, "names"}, cli.ExitDatabase, notMigrated},
		{"no schema: inspect", dsn, []string{"--schema", "txlimit_no_such_schema", "inspect", "a", "b", "--rate", "1", "--period", "1s"}, cli.ExitDatabase,
			`txlimit: not migrated: run "txlimit migrate up --schema txlimit_no_such_schema --create-schema" (on the same database), ` +
				`or pass --schema with the schema txlimit was migrated into (no schema of search_path "txlimit_no_such_schema" exists: ` +
				`function txlimit_levels_v1 does not exist, SQLSTATE 42883)` + "\n"},
		{"no schema: migrate up", dsn, []string{"--schema", "txlimit_no_such_schema", "migrate", "up"}, cli.ExitDatabase,
			`txlimit: run "txlimit migrate up --schema txlimit_no_such_schema --create-schema" to create the schema, ` +
				`or pass --schema with an existing one (no schema of search_path "txlimit_no_such_schema" exists)` + "\n"},
		{"no schema: migrate status", dsn, []string{"--schema", "txlimit_no_such_schema", "migrate", "status"}, cli.ExitDatabase,
			`txlimit: pass --schema with the schema txlimit was migrated into: nothing is migrated here (no schema of search_path "txlimit_no_such_schema" exists)` + "\n"},
		{"no schema: migrate down", dsn, []string{"--schema", "txlimit_no_such_schema", "migrate", "down", "--yes"}, cli.ExitDatabase,
			`txlimit: pass --schema with the schema txlimit was migrated into: nothing is migrated here (no schema of search_path "txlimit_no_such_schema" exists)` + "\n"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := run(t, c.dsn, nil, c.args...)
			require.Equal(t, c.code, r.code, "stderr: %s", r.stderr)
			if strings.HasPrefix(c.stderr, "txlimit: ") { // the whole message
				require.Equal(t, c.stderr, r.stderr)
			} else {
				require.Contains(t, r.stderr, c.stderr)
			}
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
			require.Contains(t, e.Error, strings.TrimSuffix(strings.TrimPrefix(c.stderr, "txlimit: "), "\n"))
		})
	}
}

func TestCommandHelp(t *testing.T) {
	t.Parallel()
	r := run(t, "", nil, "-h")
	require.Equal(t, cli.ExitOK, r.code)
	require.Contains(t, r.stderr, "usage: txlimit [flags] migrate up|down|status | names | inspect NAME KEY | reset NAME KEY | prune [NAME]\n")
	require.Contains(t, r.stderr, "-yes")
	require.Contains(t, r.stderr, "-create-schema")
	require.Contains(t, r.stderr, "-rate float")
}

// TestGoInstallAtAVersionIsAllowed: the README and cmd/txlimit install the command with
// go install github.com/txlimit/txlimit/cmd/txlimit@latest, which the go command refuses for a
// module whose go.mod has a replace or exclude directive ("The go.mod file for the module providing
// named packages contains one or more replace directives"). Before, go.mod replaced
// github.com/Azure/go-ansiterm (an indirect dependency of the tests), so that command failed.
func TestGoInstallAtAVersionIsAllowed(t *testing.T) {
	t.Parallel()
	mod, err := os.ReadFile("../go.mod")
	require.NoError(t, err)
	for _, line := range strings.Split(string(mod), "\n") {
		directive, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		require.NotContains(t, []string{"replace", "exclude"}, directive,
			"go.mod: %q makes go install ...@version refuse the module", line)
	}
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
		`null`, // no object at all: it read as no limits
		`{"a": {"rate": 1, "period": "1s"}, "a": {"rate": 2, "period": "1s"}}`, // the second "a" won, silently
		`{"a": null}`,
		`{"a": {"rate": 1, "period": "1s", "rate": 100}}`, // a field given twice: the last won, silently
		`{"a": {"rate": 1, "period": "1s", "RATE": 100}}`, // the same field, matched without case
		`{"a": {"Rate": 1, "Period": "1s"}}`,              // not the file's field names
		`{"a": 5}`,
		`{"a": [{"rate": 1, "period": "1s"}]}`,
		`{"a": {"rate": 1, "period": "1s"}`,   // no closing brace
		`{"a": {"rate": 1, "period": "1s"},}`, // a trailing comma
	} {
		_, err := cli.LoadLimits(strings.NewReader(bad))
		require.Error(t, err, bad)
		require.NotErrorIs(t, err, ratelimit.ErrInvalid, bad)
	}
	_, err = cli.LoadLimits(strings.NewReader(`{"a": {"rate": 0, "period": "1s"}}`))
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
}

// tty is a standard input that reports a terminal, as an *os.File on one does.
type tty struct{ io.Reader }

func (tty) Stat() (os.FileInfo, error) { return ttyInfo{}, nil }

type ttyInfo struct{ os.FileInfo }

func (ttyInfo) Mode() os.FileMode { return os.ModeDevice | os.ModeCharDevice | 0o620 }

// migrated returns a migrated schema and the arguments that select it.
func migrated(t *testing.T, dsn string) (schema string, args []string) {
	t.Helper()
	schema = testdb.NewSchema(t)
	r := run(t, dsn, nil, "--schema", schema, "migrate", "up")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	return schema, []string{"--schema", schema}
}

// migratedPool is migrated with a pool on the schema, closed when the test ends.
func migratedPool(t *testing.T, dsn string) (pool *pgxpool.Pool, schema string, args []string) {
	t.Helper()
	schema, args = migrated(t, dsn)
	pool, err := pgxpool.New(context.Background(), testdb.SchemaURL(t, schema))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, schema, args
}

// TestCommandNamesAndPrune: names lists every name in the table, configured or not; prune without
// NAME refuses, before deleting anything, when the table holds a name it has no config for (rows
// an httplimit policy wrote, say), and prunes every name once each has one (issue 31, item 5).
func TestCommandNamesAndPrune(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.DSN(t)
	pool, _, s := migratedPool(t, dsn)

	// The application decides "fast" and, through its middleware, "perIP"; the operator's config
	// file knows only "fast".
	perIP := ratelimit.Config{Rate: 1000, Period: time.Second, Capacity: 2}
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"fast": {Rate: 1000, Period: time.Second, Capacity: 1}, "perIP": perIP,
	}})
	require.NoError(t, err)
	for _, call := range []struct{ name, key string }{{"fast", "k"}, {"perIP", "203.0.113.7"}, {"perIP", "203.0.113.8"}} {
		_, err := lim.Limit(ctx, pool, call.name, call.key, nil)
		require.NoError(t, err)
	}
	dir := t.TempDir()
	fastOnly := filepath.Join(dir, "fast.json")
	require.NoError(t, os.WriteFile(fastOnly, []byte(`{"fast": {"rate": 1000, "period": "1s", "capacity": 1}}`), 0o600))
	both := filepath.Join(dir, "both.json")
	require.NoError(t, os.WriteFile(both, []byte(`{"fast": {"rate": 1000, "period": "1s", "capacity": 1},
		"perIP": {"rate": 1000, "period": "1s", "capacity": 2}}`), 0o600))

	r := run(t, dsn, nil, append(s, "names", "--config", fastOnly)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, ""+
		"NAME        ROWS  CONFIG\n"+
		"fast           1  token bucket 1000/1s cap 1\n"+
		"perIP          2  none (prune needs one: --config FILE)\n"+
		"total          3\n", r.stdout)
	r = run(t, dsn, nil, append(s, "names", "--json")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	var names cli.NamesJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &names))
	require.Equal(t, cli.NamesJSON{Names: []cli.NameJSON{{Name: "fast", Rows: 1}, {Name: "perIP", Rows: 2}}, Total: 3}, names)

	time.Sleep(5 * time.Millisecond) // every row refills: each could go
	r = run(t, dsn, nil, append(s, "prune", "--config", fastOnly)...)
	require.Equal(t, cli.ExitInvalid, r.code, r.stderr)
	require.Equal(t, `txlimit: prune: the table holds limits with no config here: "perIP" (2 rows); a row is pruned only when it holds `+
		`its limit's full capacity, so pruning needs the limit's config: give it in --config FILE, or prune the limit alone with `+
		`"txlimit prune perIP --rate R --period D" (and --capacity, --kind, --shards, --start as it is configured); nothing was deleted`+"\n", r.stderr)
	require.Empty(t, r.stdout)
	require.Equal(t, 3, testdb.CountRows(t, pool), "a refused prune deleted rows")
	r = run(t, dsn, nil, append(s, "prune", "--json")...) // no config at all
	require.Equal(t, cli.ExitInvalid, r.code, r.stderr)
	var e struct {
		Error        string           `json:"error"`
		ExitCode     int              `json:"exit_code"`
		Unconfigured map[string]int64 `json:"unconfigured"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stderr), &e), r.stderr)
	require.Equal(t, cli.ExitInvalid, e.ExitCode)
	require.Equal(t, map[string]int64{"fast": 1, "perIP": 2}, e.Unconfigured)
	require.Contains(t, e.Error, `no config here: "fast" (1 row), "perIP" (2 rows);`)
	require.Contains(t, e.Error, `"txlimit prune NAME --rate R --period D"`)
	require.Equal(t, 3, testdb.CountRows(t, pool))

	// The one name, with its config on the command line; then every name from a complete file.
	r = run(t, dsn, nil, append(s, "prune", "perIP", "--rate", "1000", "--period", "1s", "--capacity", "2")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "perIP                2 rows deleted\ntotal                2 rows deleted\n", r.stdout)
	_, err = lim.Limit(ctx, pool, "perIP", "203.0.113.7", nil)
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond)
	r = run(t, dsn, nil, append(s, "prune", "--config", both)...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "fast                 1 rows deleted\nperIP                1 rows deleted\ntotal                2 rows deleted\n", r.stdout)
	r = run(t, dsn, nil, append(s, "names")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "NAME        ROWS  CONFIG\ntotal          0\n", r.stdout)
	r = run(t, dsn, nil, append(s, "prune")...) // an empty table and no config: nothing to do
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "total                0 rows deleted\n", r.stdout)
}

// TestCommandMigrateDownAsks: migrate down drops every limit's state, so it rolls back only when
// confirmed: "yes" typed on a terminal, or --yes; elsewhere it refuses with exit 2 (issue 31).
func TestCommandMigrateDownAsks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.DSN(t)
	pool, schema, s := migratedPool(t, dsn)
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"century": century}})
	require.NoError(t, err)
	_, err = lim.Limit(ctx, pool, "century", "user-42", nil)
	require.NoError(t, err)
	// The last three migrations hold the functions; the first one the table.
	for _, m := range []string{"00004_txlimit_operations.sql", "00003_txlimit_decide.sql", "00002_txlimit_rules.sql"} {
		r := run(t, dsn, nil, append(s, "migrate", "down", "--yes")...)
		require.Equal(t, cli.ExitOK, r.code, r.stderr)
		require.Equal(t, "down  "+m+"\n", r.stdout)
	}
	what := `migrate down rolls back 00001_txlimit_table.sql in schema "` + schema + `": it drops txlimit_state, the state of every limit (1 row of 1 limit)`
	down := append(s, "migrate", "down")
	steps := []struct {
		stdin          io.Reader
		args           []string
		code           int
		stdout, stderr string
	}{
		{stdin: strings.NewReader("yes\n"), args: down, code: cli.ExitUsage, // not a terminal: no one to ask
			stderr: "txlimit: " + what + "; pass --yes to roll back where no terminal can confirm: nothing was rolled back\n"},
		{stdin: devNull(t), args: down, code: cli.ExitUsage, // a character device, but no one there (cron, systemd)
			stderr: "txlimit: " + what + "; pass --yes to roll back where no terminal can confirm: nothing was rolled back\n"},
		{stdin: tty{strings.NewReader("no\n")}, args: down, code: cli.ExitUsage,
			stderr: what + ".\nType yes to roll back: txlimit: migrate down not confirmed: nothing was rolled back\n"},
		{stdin: tty{strings.NewReader("")}, args: down, code: cli.ExitUsage,
			stderr: what + ".\nType yes to roll back: txlimit: migrate down not confirmed: nothing was rolled back\n"},
		{stdin: tty{strings.NewReader("yes\n")}, args: down, code: cli.ExitOK,
			stdout: "down  00001_txlimit_table.sql\n", stderr: what + ".\nType yes to roll back: "},
		{stdin: strings.NewReader(""), args: append(s, "migrate", "up"), code: cli.ExitOK,
			stdout: "up    00001_txlimit_table.sql\nup    00002_txlimit_rules.sql\nup    00003_txlimit_decide.sql\nup    00004_txlimit_operations.sql\n"},
		{stdin: strings.NewReader(""), args: append(s, "migrate", "down", "--yes"), code: cli.ExitOK, stdout: "down  00004_txlimit_operations.sql\n"},
		{stdin: strings.NewReader(""), args: append(s, "migrate", "down", "--yes"), code: cli.ExitOK, stdout: "down  00003_txlimit_decide.sql\n"},
		{stdin: strings.NewReader(""), args: append(s, "migrate", "down", "--yes"), code: cli.ExitOK, stdout: "down  00002_txlimit_rules.sql\n"},
		{stdin: strings.NewReader(""), args: append(s, "migrate", "down", "--yes"), code: cli.ExitOK, stdout: "down  00001_txlimit_table.sql\n"},
		{stdin: strings.NewReader(""), args: down, code: cli.ExitOK, stdout: "nothing to roll back\n"}, // asks nothing
	}
	for i, st := range steps {
		r := run(t, dsn, &cli.Options{Stdin: st.stdin}, st.args...)
		if r.code != st.code || r.stdout != st.stdout || r.stderr != st.stderr {
			t.Fatalf("step %d: got exit %d, stdout %q, stderr %q; want %d, %q, %q", i, r.code, r.stdout, r.stderr, st.code, st.stdout, st.stderr)
		}
		if i == 3 {
			require.Equal(t, 1, testdb.CountRows(t, pool), "step %d: the state is gone", i)
		}
	}
}

// TestCommandMigrateUpCreateSchema: migrate up into a schema that does not exist says how to
// create it, and does with --create-schema.
func TestCommandMigrateUpCreateSchema(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	schema := testdb.NewSchema(t) + "_new" // a name no schema has; dropped at the end
	t.Cleanup(func() {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		require.NoError(t, err)
	})
	r := run(t, dsn, nil, "--schema", schema, "migrate", "up")
	require.Equal(t, cli.ExitDatabase, r.code)
	require.Equal(t, `txlimit: run "txlimit migrate up --schema `+schema+` --create-schema" to create the schema, `+
		`or pass --schema with an existing one (no schema of search_path "`+schema+`" exists)`+"\n", r.stderr)
	r = run(t, dsn, nil, "--schema", schema, "migrate", "up", "--create-schema")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "up    00001_txlimit_table.sql\nup    00002_txlimit_rules.sql\nup    00003_txlimit_decide.sql\nup    00004_txlimit_operations.sql\n", r.stdout)
	r = run(t, dsn, nil, "--schema", schema, "migrate", "up", "--create-schema")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "up to date\n", r.stdout)
}

// devNull opens /dev/null for reading, closed when the test ends.
func devNull(t *testing.T) *os.File {
	f, err := os.Open(os.DevNull)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f
}

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

// Everything after "--" is positional: a key that starts with "-" follows one "--". Each such
// argument needed its own "--" (the flags were parsed again after every positional argument).
func TestCommandArgumentsAfterDoubleDash(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	_, s := migrated(t, dsn)
	r := run(t, dsn, nil, append(s, "--json", "--rate", "1", "--period", "1s", "inspect", "--", "x", "-k")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Contains(t, r.stdout, `"key": "-k"`)
}
