package cli_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/cli"
	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
)

// tables lists the tables of schema, sorted.
func tables(t *testing.T, dsn, schema string) []string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY tablename", schema)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

// exec runs sql on the test database as its user.
func exec(t *testing.T, dsn, sql string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	require.NoError(t, err, sql)
}

// allUp is migrate up's text output on a schema with nothing applied.
const allUp = "up    00001_txlimit_table.sql\nup    00002_txlimit_rules.sql\nup    00003_txlimit_decide.sql\nup    00004_txlimit_operations.sql\n"

// TestCommandMigrateUpNamedSchema: migrate up reports the migrations it applied to the first
// schema named in --schema, also when that schema is new and the search_path led to another,
// migrated one before; and its look at the state before writes nothing to that other schema.
func TestCommandMigrateUpNamedSchema(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	old, _ := migrated(t, dsn)
	fresh := testdb.NewSchema(t) + "_new" // a name no schema has; dropped at the end
	t.Cleanup(func() { exec(t, dsn, "DROP SCHEMA IF EXISTS "+pgx.Identifier{fresh}.Sanitize()+" CASCADE") })

	path := fresh + ", " + old
	r := run(t, dsn, nil, "--schema", path, "--json", "migrate", "up", "--create-schema")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	var got struct{ Migrations []cli.MigrationJSON }
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &got))
	require.Len(t, got.Migrations, int(migrations.Latest()), r.stdout)
	for i, m := range got.Migrations {
		require.Equal(t, int64(i+1), m.Version)
		require.Equal(t, "up", m.State)
	}
	r = run(t, dsn, nil, "--schema", path, "migrate", "up", "--create-schema")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "up to date\n", r.stdout)

	// Text output too, into yet another new schema in front of the migrated one.
	fresh2 := testdb.NewSchema(t) + "_new"
	t.Cleanup(func() { exec(t, dsn, "DROP SCHEMA IF EXISTS "+pgx.Identifier{fresh2}.Sanitize()+" CASCADE") })
	r = run(t, dsn, nil, "--schema", fresh2+", "+old, "migrate", "up", "--create-schema")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, allUp, r.stdout)

	// Without --create-schema, up into a missing first schema fails, and the existing schema
	// the search_path leads to meanwhile is left as it was: no goose table appears there.
	empty := testdb.NewSchema(t)
	missing := testdb.NewSchema(t) + "_missing"
	r = run(t, dsn, nil, "--schema", missing+", "+empty, "migrate", "up")
	require.Equal(t, cli.ExitDatabase, r.code, r.stderr)
	require.Contains(t, r.stderr, fmt.Sprintf("schema %q, the first of search_path", missing))
	require.Empty(t, tables(t, dsn, empty))
}

// newRole creates a login role with no privileges, dropped when the test ends, and returns its
// name and a DSN that connects as it.
func newRole(t *testing.T, dsn string) (role, roleDSN string) {
	t.Helper()
	var b [6]byte
	_, err := rand.Read(b[:])
	require.NoError(t, err)
	role = "txlimit_cli_ro_" + hex.EncodeToString(b[:])
	password := hex.EncodeToString(b[:]) + "-pw"
	q := pgx.Identifier{role}.Sanitize()
	exec(t, dsn, fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD '%s' NOSUPERUSER NOCREATEDB NOCREATEROLE", q, password))
	t.Cleanup(func() {
		exec(t, dsn, fmt.Sprintf("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '%s'", role))
		exec(t, dsn, "DROP OWNED BY "+q)
		exec(t, dsn, "DROP ROLE "+q)
	})
	cfg, err := pgx.ParseConfig(dsn)
	require.NoError(t, err)
	return role, fmt.Sprintf("host=%s port=%s dbname=%s user=%s password=%s sslmode=disable",
		cfg.Host, strconv.Itoa(int(cfg.Port)), cfg.Database, role, password)
}

// TestCommandSchemaWithoutUsage: a role that may not use the schema of --schema (no USAGE: Postgres
// then skips it in the search_path) is told to get the grant, not that the schema does not exist
// and to create it with migrate up --create-schema.
func TestCommandSchemaWithoutUsage(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	schema, _ := migrated(t, dsn)
	role, roleDSN := newRole(t, dsn)
	grant := fmt.Sprintf("txlimit: no USAGE on schema %q (of search_path %q) for role %s: connect as the schema's owner, or run "+
		"GRANT USAGE ON SCHEMA %q TO %q as the owner, with the README's other grants (a role that decides but does not migrate)",
		schema, schema, role, schema, role)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"names"}, grant + ` (relation "txlimit_state" does not exist, SQLSTATE 42P01)` + "\n"},
		{[]string{"inspect", "a", "k", "--rate", "1", "--period", "1s"}, grant + ` (function txlimit_levels_v1 does not exist, SQLSTATE 42883)` + "\n"},
		{[]string{"migrate", "status"}, grant + "\n"},
		{[]string{"migrate", "up"}, grant + "\n"},
		{[]string{"migrate", "up", "--create-schema"}, grant + "\n"},
	} {
		r := run(t, roleDSN, nil, append([]string{"--schema", schema}, c.args...)...)
		require.Equal(t, cli.ExitDatabase, r.code, "%v: %s", c.args, r.stderr)
		require.Equal(t, c.want, r.stderr, c.args)
		require.Empty(t, r.stdout)
	}
}

// TestCommandMigrateUpReportsWhatItApplied: migrate up lists the migrations it applied itself, not
// those another migrator applied while it waited for the migration lock (then it is up to date).
func TestCommandMigrateUpReportsWhatItApplied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testdb.NewSchema(t)
	holder := testdb.PoolOn(t, schema)
	db, release := testdb.HoldMigrationLock(t, holder, schema)
	app := "txlimit_cli_" + schema
	done := make(chan result, 1)
	go func() { done <- run(t, testdb.SchemaURL(t, schema)+"&application_name="+app, nil, "migrate", "up") }()
	// Once the command waits for the lock, the other migrator applies every migration.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, holder.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'INSERT INTO "+
			migrations.LockTable+"%'", app).Scan(&n))
		return n > 0
	}, 30*time.Second, 10*time.Millisecond)
	p, err := goose.NewProvider(goose.DialectPostgres, db, migrations.FS, goose.WithTableName(migrations.VersionTable), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	applied, err := p.Up(ctx)
	require.NoError(t, err)
	require.Len(t, applied, int(migrations.Latest()))
	release()
	r := <-done
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "up to date\n", r.stdout)
}

// TestCommandMigrateUpTimeoutOnTheLock: migrate up that waits for a lock another migrator holds
// until --timeout expires says so: the flag that expired, and the lock it waited for.
func TestCommandMigrateUpTimeoutOnTheLock(t *testing.T) {
	t.Parallel()
	schema := testdb.NewSchema(t)
	_, release := testdb.HoldMigrationLock(t, testdb.PoolOn(t, schema), schema)
	defer release()
	r := run(t, testdb.DSN(t), nil, "--schema", schema, "migrate", "up", "--timeout", "1s")
	require.Equal(t, cli.ExitDatabase, r.code, r.stderr)
	require.Equal(t, fmt.Sprintf("txlimit: --timeout 1s expired: migrate up: migrations: waited for the migration lock of schema %q, "+
		"which another migrator holds (a row of %s; one that died releases it after 30s): acquire lock %d after retries: context deadline exceeded\n",
		schema, migrations.LockTable, migrations.LockID(schema)), r.stderr)
	require.Empty(t, r.stdout)
	require.Equal(t, []string{migrations.LockTable}, tables(t, testdb.DSN(t), schema), "migrated while the lock was held")
}

// TestCommandMigrateStatusReadsOnly: migrate status, and migrate down with nothing to roll back,
// only read: they create no table in an unmigrated schema, and a role that may only SELECT the
// version table lists the migrations.
func TestCommandMigrateStatusReadsOnly(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	empty := testdb.NewSchema(t)
	r := run(t, dsn, nil, "--schema", empty, "migrate", "status")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	pending := "pending" + strings.Repeat(" ", 24)
	require.Equal(t, pending+"00001_txlimit_table.sql\n"+pending+"00002_txlimit_rules.sql\n"+pending+"00003_txlimit_decide.sql\n"+pending+"00004_txlimit_operations.sql\n", r.stdout)
	r = run(t, dsn, nil, "--schema", empty, "migrate", "down", "--yes")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "nothing to roll back\n", r.stdout)
	require.Empty(t, tables(t, dsn, empty), "a read-only command created tables")

	// A role with USAGE on a migrated schema and SELECT on its version table, nothing more.
	schema, _ := migrated(t, dsn)
	role, roleDSN := newRole(t, dsn)
	q := pgx.Identifier{role}.Sanitize()
	exec(t, dsn, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s; GRANT SELECT ON %s TO %s",
		pgx.Identifier{schema}.Sanitize(), q, pgx.Identifier{schema, migrations.VersionTable}.Sanitize(), q))
	r = run(t, roleDSN, nil, "--schema", schema, "--json", "migrate", "status")
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	var st struct{ Migrations []cli.MigrationJSON }
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Len(t, st.Migrations, int(migrations.Latest()))
	for _, m := range st.Migrations {
		require.Equal(t, "applied", m.State, r.stdout)
		require.NotNil(t, m.AppliedAt)
		require.WithinDuration(t, time.Now(), *m.AppliedAt, time.Hour)
	}
}

// TestCommandMigrateDownPromptEnds: the confirmation prompt of migrate down gives up when the
// command's context ends, by --timeout or an interrupt (the caller cancelling the context): not
// confirmed, exit 2, nothing rolled back.
func TestCommandMigrateDownPromptEnds(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	_, s := migrated(t, dsn)
	for _, tc := range []struct {
		name string
		args []string
		ctx  func() (context.Context, context.CancelFunc)
		why  string
	}{
		{"timeout", []string{"--timeout", "2s"}, func() (context.Context, context.CancelFunc) {
			return context.WithCancel(context.Background())
		}, "--timeout expired"},
		{"interrupt", nil, func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(2*time.Second, cancel) // Ctrl-C while the prompt waits
			return ctx, cancel
		}, "interrupted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr, pw := io.Pipe() // a terminal on which no one types
			t.Cleanup(func() { pw.Close() })
			ctx, cancel := tc.ctx()
			defer cancel()
			var stdout, stderr bytes.Buffer
			done := make(chan int, 1)
			go func() {
				done <- cli.Run(ctx, append(append(s, "migrate", "down"), tc.args...), &stdout, &stderr, &cli.Options{
					Stdin:  tty{pr},
					Getenv: func(k string) string { return map[string]string{"DATABASE_URL": dsn}[k] },
				})
			}()
			select {
			case code := <-done:
				require.Equal(t, cli.ExitUsage, code, stderr.String())
			case <-time.After(30 * time.Second):
				pw.Close() // let the command end
				<-done
				t.Fatalf("the prompt ignored the end of the context: stderr %q", stderr.String())
			}
			require.Empty(t, stdout.String())
			require.True(t, strings.HasSuffix(stderr.String(), "Type yes to roll back: \ntxlimit: migrate down not confirmed ("+tc.why+
				" before an answer): nothing was rolled back\n"), stderr.String())
		})
	}
	r := run(t, dsn, nil, append(s, "--json", "migrate", "status")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.NotContains(t, r.stdout, "pending", "a migration was rolled back")
}

// TestCommandMigrateDownRollsBackWhatWasConfirmed: migrate down rolls back the migration its prompt
// named, or nothing: when another migrator rolled that one back while the prompt waited, the "yes"
// does not roll back the next one, which for 00001 drops txlimit_state without having said so.
func TestCommandMigrateDownRollsBackWhatWasConfirmed(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	schema, s := migrated(t, dsn)
	for range 2 {
		r := run(t, dsn, nil, append(s, "migrate", "down", "--yes")...)
		require.Equal(t, cli.ExitOK, r.code, r.stderr)
	}
	pr, pw := io.Pipe()
	t.Cleanup(func() { pw.Close() })
	var stdout, stderr metrictest.Logs
	done := make(chan int, 1)
	go func() {
		done <- cli.Run(context.Background(), append(s, "migrate", "down"), &stdout, &stderr, &cli.Options{
			Stdin:  tty{pr},
			Getenv: func(k string) string { return map[string]string{"DATABASE_URL": dsn}[k] },
		})
	}()
	const prompt = "migrate down rolls back 00002_txlimit_rules.sql in schema "
	require.Eventually(t, func() bool { return strings.Contains(stderr.String(), "Type yes") }, 30*time.Second, 10*time.Millisecond)
	require.True(t, strings.HasPrefix(stderr.String(), prompt), stderr.String())
	r := run(t, dsn, nil, append(s, "migrate", "down", "--yes")...) // another operator, meanwhile
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "down  00002_txlimit_rules.sql\n", r.stdout)
	_, err := io.WriteString(pw, "yes\n")
	require.NoError(t, err)
	code := <-done
	require.Equal(t, cli.ExitDatabase, code, stderr.String())
	require.Empty(t, stdout.String())
	require.True(t, strings.HasSuffix(stderr.String(), "Type yes to roll back: txlimit: migrate down: 00002_txlimit_rules.sql "+
		"is no longer applied (another migrator rolled it back meanwhile): nothing was rolled back\n"), stderr.String())
	require.Contains(t, tables(t, dsn, schema), "txlimit_state", "the unconfirmed 00001 was rolled back")
}

// aheadOf returns a schema that looks migrated by a newer txlimit (one more migration recorded,
// and the function drop, when not "", dropped by it), and the arguments that select it.
func aheadOf(t *testing.T, dsn, drop string) (schema string, args []string) {
	t.Helper()
	schema, args = migrated(t, dsn)
	sql := fmt.Sprintf("INSERT INTO %s (version_id, is_applied) VALUES (%d, true)",
		pgx.Identifier{schema, migrations.VersionTable}.Sanitize(), migrations.Latest()+1)
	if drop != "" {
		sql += "; DROP FUNCTION " + pgx.Identifier{schema, drop}.Sanitize()
	}
	exec(t, dsn, sql)
	return schema, args
}

// TestCommandMigrateDownNewerSchema: migrate down on a schema that a newer txlimit migrated
// further than this one's latest migration refuses, before asking, naming both versions.
func TestCommandMigrateDownNewerSchema(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	schema, s := aheadOf(t, dsn, "")
	latest := migrations.Latest()
	want := fmt.Sprintf("txlimit: migrate down: schema is at version %d, newer than this txlimit's latest (%d): "+
		"roll it back with the txlimit that migrated it (schema %q): nothing was rolled back\n", latest+1, latest, schema)
	r := run(t, dsn, nil, append(s, "migrate", "down", "--yes")...)
	require.Equal(t, cli.ExitDatabase, r.code, r.stderr)
	require.Equal(t, want, r.stderr)
	r = run(t, dsn, &cli.Options{Stdin: tty{strings.NewReader("yes\n")}}, append(s, "migrate", "down")...)
	require.Equal(t, cli.ExitDatabase, r.code, r.stderr)
	require.Equal(t, want, r.stderr, "asked before refusing")
	r = run(t, dsn, nil, append(s, "--json", "migrate", "status")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.NotContains(t, r.stdout, "pending", "a migration was rolled back")

	// status shows the newer migration too, which this txlimit does not embed.
	var st struct{ Migrations []cli.MigrationJSON }
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Len(t, st.Migrations, int(latest)+1, r.stdout)
	newer := st.Migrations[latest]
	require.NotNil(t, newer.AppliedAt)
	require.Equal(t, cli.MigrationJSON{Version: latest + 1, State: "applied", AppliedAt: newer.AppliedAt}, newer)
	r = run(t, dsn, nil, append(s, "migrate", "status")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	require.Len(t, lines, int(latest)+1, r.stdout)
	require.Equal(t, fmt.Sprintf("applied  %s  version %d, not in this txlimit: a newer txlimit migrated the schema",
		newer.AppliedAt.Format(time.RFC3339), latest+1), lines[latest])
}

// TestCommandNewerSchemaWithoutAFunction: on a schema a newer txlimit migrated and dropped a
// function of (CONTRIBUTING.md: a function's old version goes a release after its new one), a
// command that calls it names the fix, a newer txlimit, not migrate up, which finds nothing to do.
func TestCommandNewerSchemaWithoutAFunction(t *testing.T) {
	t.Parallel()
	dsn := testdb.DSN(t)
	schema, s := aheadOf(t, dsn, "txlimit_levels_v1")
	latest := migrations.Latest()
	r := run(t, dsn, nil, append(s, "inspect", "a", "k", "--rate", "1", "--period", "1s")...)
	require.Equal(t, cli.ExitDatabase, r.code, r.stderr)
	require.Equal(t, fmt.Sprintf("txlimit: install a newer txlimit: the schema (search_path %q) is at migration version %d, newer than "+
		"this txlimit's latest (%d), and has no function txlimit_levels_v1, which this txlimit calls (SQLSTATE 42883)\n", schema, latest+1, latest), r.stderr)
	require.Empty(t, r.stdout)
	r = run(t, dsn, nil, append(s, "migrate", "up")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	require.Equal(t, "up to date\n", r.stdout)

	// At this txlimit's own version (another build's in-place migrations, or a dropped function):
	// neither a newer txlimit nor migrate up restores it; rolling back to version 1 and up does.
	schema, s = migrated(t, dsn)
	exec(t, dsn, "DROP FUNCTION "+pgx.Identifier{schema, "txlimit_levels_v1"}.Sanitize())
	r = run(t, dsn, nil, append(s, "inspect", "a", "k", "--rate", "1", "--period", "1s")...)
	require.Equal(t, cli.ExitDatabase, r.code, r.stderr)
	require.Equal(t, fmt.Sprintf("txlimit: run \"txlimit migrate down --yes --schema %s\" %d times (down to version 1, which keeps txlimit_state), "+
		"then \"txlimit migrate up --schema %s\": the schema (search_path %q) is at this txlimit's migration version (%d) but has no "+
		"function txlimit_levels_v1, which this txlimit calls (SQLSTATE 42883)\n", schema, latest-1, schema, schema, latest), r.stderr)
	for range latest - 1 {
		r = run(t, dsn, nil, append(s, "migrate", "down", "--yes")...)
		require.Equal(t, cli.ExitOK, r.code, r.stderr)
	}
	r = run(t, dsn, nil, append(s, "migrate", "up")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
	r = run(t, dsn, nil, append(s, "inspect", "a", "k", "--rate", "1", "--period", "1s")...)
	require.Equal(t, cli.ExitOK, r.code, r.stderr)
}

// TestCommandReviewedFlags: a limits file with anything after its object is malformed JSON (exit
// 2, as any malformed file); --json applies to a usage error even when it comes after the bad
// flag; migrate refuses the limit-config flags it would ignore.
func TestCommandReviewedFlags(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		`{"a":{"rate":1,"period":"1m"}} garbage`,
		`{"a":{"rate":1,"period":"1m"}} {"b":{"rate":1,"period":"1m"}}`,
		`{"a":{"rate":1,"period":"1m"}}}`,
	} {
		_, err := cli.LoadLimits(strings.NewReader(in))
		require.Error(t, err, in)
	}
	_, err := cli.LoadLimits(strings.NewReader("{\"a\":{\"rate\":1,\"period\":\"1m\"}}\n\t "))
	require.NoError(t, err, "white space after the object is fine")

	dsn := testdb.DSN(t)
	r := run(t, dsn, nil, "--bogus", "--json", "names")
	require.Equal(t, cli.ExitUsage, r.code)
	require.JSONEq(t, `{"error":"flag provided but not defined: -bogus","exit_code":2}`, strings.TrimSpace(r.stderr))

	r = run(t, dsn, nil, "--config", "/nonexistent", "migrate", "status")
	require.Equal(t, cli.ExitUsage, r.code, "an unreadable config file: %s", r.stderr)
	r = run(t, dsn, nil, "--rate", "1", "migrate", "status")
	require.Equal(t, cli.ExitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "--rate is not for migrate")
}
