// Package migrations holds txlimit's schema as goose migrations embedded in the binary.
//
// The migrations keep their own goose version table, txlimit_goose_version, so they never touch an
// application's goose_db_version. Tables are created in the first schema of the connection's
// search_path, the same schema the library's queries use.
//
// Concurrent migrators of one schema are kept apart by a lock row in a table of that schema,
// txlimit_goose_lock (goose's table locker), not by a session-level advisory lock: a session lock
// does not survive a transaction pooler such as PgBouncer in transaction mode, which may run the
// lock and the unlock on different server connections. See docs/deploy.md.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// FS holds txlimit's migrations, the goose SQL files (0000N_<what>.sql) that Up and NewProvider
// apply.
//
//go:embed *.sql
var FS embed.FS

// VersionTable is the name of the goose version table these migrations keep.
const VersionTable = "txlimit_goose_version"

// LockTable is the name of the table holding the lock row that concurrent migrators of one schema
// take in turn. It is created next to VersionTable on first use.
const LockTable = "txlimit_goose_lock"

// The table locker's timing: a dead migrator's lock expires after lockLease (its heartbeat renews
// it every lockHeartbeat while it runs); a waiting migrator retries every lockRetry, for at most
// lockRetries times (5 minutes). A release that fails is retried every lockRetry for at most
// unlockRetries times (5 s), whatever the context (goose's locker ignores it there): longer would
// keep a command past its deadline for a lock whose lease ends it anyway.
const (
	lockLease     = 30 * time.Second
	lockHeartbeat = 5 * time.Second
	lockRetry     = 250 * time.Millisecond
	lockRetries   = 1200
	unlockRetries = 20
)

// Latest returns the highest migration version embedded in this package: the version a schema
// must be at for this build of txlimit. It panics if an embedded file name has no version, which
// a test rules out.
func Latest() int64 {
	names, err := fs.Glob(FS, "*.sql")
	if err != nil {
		panic(err)
	}
	var latest int64
	for _, name := range names {
		v, err := goose.NumericComponent(name)
		if err != nil {
			panic(fmt.Sprintf("migrations: %s: %v", name, err))
		}
		latest = max(latest, v)
	}
	return latest
}

// NewProvider returns a goose Provider for txlimit's migrations on db, with txlimit's own version
// table and goose's table locker, so that concurrent migrators of the same schema wait for each
// other even through a transaction pooler. The lock is txlimit's own, per schema (a row of
// LockTable in that schema): migrating one schema never waits for another, nor for the
// application's goose. A waiting migrator retries every 250 ms for up to 5 minutes; a migrator that
// died holding the lock releases it after 30 s. Use the Provider for anything beyond Up: status,
// down, a target version. Its locked operations need two connections of db (goose holds one for
// the migrations, the locker uses another); Up needs only one.
func NewProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	locker, _, err := newLocker(ctx, db)
	if err != nil {
		return nil, err
	}
	return newProvider(db, goose.WithLocker(locker))
}

func newProvider(db *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	return goose.NewProvider(goose.DialectPostgres, db, FS, append([]goose.ProviderOption{
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true),
	}, opts...)...)
}

// newLocker returns goose's table locker on the lock row of db's current schema, and the schema.
func newLocker(ctx context.Context, db *sql.DB) (lock.Locker, string, error) {
	var schema sql.NullString
	if err := db.QueryRowContext(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		return nil, "", fmt.Errorf("migrations: find the schema: %w", err)
	}
	if !schema.Valid {
		return nil, "", errors.New("migrations: no schema of the connection's search_path exists: create it, or call Up with CreateSchema()")
	}
	l, err := lock.NewPostgresTableLocker(
		lock.WithTableName(LockTable),
		lock.WithTableLockID(LockID(schema.String)),
		lock.WithTableLeaseDuration(lockLease),
		lock.WithTableHeartbeatInterval(lockHeartbeat),
		lock.WithTableLockTimeout(lockRetry, lockRetries),
		lock.WithTableUnlockTimeout(lockRetry, unlockRetries),
		lock.WithTableRetryPolicy(retryable),
	)
	return l, schema.String, err
}

// retryable says whether a failed attempt to take or release the lock is worth another try: yes
// when the lock is held by another migrator, the connection failed, or the attempt lost a
// serialization race (40001, 40P01: a role or database whose default_transaction_isolation is
// REPEATABLE READ or SERIALIZABLE, while the holder touches the lock row); no when Postgres
// refused the statement (a permission error, say), which a retry would only repeat for five
// minutes, nor when the lock row to release is no longer this migrator's (deleted, or taken by
// another once the lease expired), which no retry changes.
func retryable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "40001" || pgErr.Code == "40P01"
	}
	return !strings.Contains(err.Error(), "not held by this instance") // goose's locker has no error value for it
}

// Option changes what Up does.
type Option func(*upConfig)

type upConfig struct {
	createSchema bool
	applied      *[]*goose.MigrationResult
}

// CreateSchema makes Up create the schema it migrates, the first schema named in the connection's
// search_path ("$user" counts only when such a schema exists, as in Postgres), when it does not
// exist yet. Without it, Up fails when that schema is missing rather than migrating into a later
// schema of the search_path. Defaults to off.
func CreateSchema() Option { return func(c *upConfig) { c.createSchema = true } }

// Applied makes Up store in *dst the migrations it applied, in the order it applied them: none when
// the schema was up to date, also when another migrator applied them while Up waited for the lock.
// Defaults to nil: nothing stored.
func Applied(dst *[]*goose.MigrationResult) Option { return func(c *upConfig) { c.applied = dst } }

// Up applies every pending migration through the pool, in the first schema of the connection's
// search_path. It is safe to call at every start-up and from several processes at once, also
// through PgBouncer in transaction pooling mode (see docs/deploy.md for the pool's exec mode and
// search_path there). It refuses, creating nothing, to migrate a schema that exists and holds no
// txlimit_state when a later schema of the search_path holds one (a schema named after the role,
// created after migrating into public, say): the new table would hide the limits' state, and
// every key would start full. Its error says how to go on with that state or to start afresh. A
// schema Up creates itself (CreateSchema) is migrated.
func Up(ctx context.Context, pool *pgxpool.Pool, opts ...Option) error {
	var cfg upConfig
	for _, o := range opts {
		o(&cfg)
	}
	if err := ensureSchema(ctx, pool, cfg.createSchema); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	// The lock is taken around goose's whole run rather than by goose itself: goose would hold one
	// connection for the migrations while its locker waits for a second, which a pool of one
	// connection never gives. Held this way, the lock also covers goose's check for pending
	// migrations, so concurrent first migrators do not race to create the version table.
	locker, schema, err := newLocker(ctx, db)
	if err != nil {
		return err
	}
	if err := locker.Lock(ctx, db); err != nil {
		var pgErr *pgconn.PgError
		if ctx.Err() != nil || !errors.As(err, &pgErr) { // not refused: held by another migrator until now
			return fmt.Errorf("migrations: waited for the migration lock of schema %q, which another migrator holds "+
				"(a row of %s; one that died releases it after %s): %w", schema, LockTable, lockLease, err)
		}
		return fmt.Errorf("migrations: take the migration lock: %w", err)
	}
	p, err := newProvider(db)
	if err == nil {
		var res []*goose.MigrationResult
		res, err = p.Up(ctx)
		if cfg.applied != nil {
			*cfg.applied = res
		}
	}
	if uerr := locker.Unlock(ctx, db); uerr != nil && err == nil {
		err = fmt.Errorf("release the migration lock: %w", uerr)
	}
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	return nil
}

// ensureSchema finds the schema Up is to migrate (the first of the search_path) and creates it
// when asked to; otherwise a missing schema is an error that names it.
func ensureSchema(ctx context.Context, pool *pgxpool.Pool, create bool) error {
	var searchPath, user string
	if err := pool.QueryRow(ctx, "SELECT current_setting('search_path'), current_user").Scan(&searchPath, &user); err != nil {
		return fmt.Errorf("read the search_path: %w", err)
	}
	entries := splitSearchPath(searchPath)
	target := ""
	for _, e := range entries {
		if e == "$user" {
			var exists bool
			if err := pool.QueryRow(ctx, "SELECT to_regnamespace($1) IS NOT NULL", pgx.Identifier{user}.Sanitize()).Scan(&exists); err != nil {
				return fmt.Errorf("look up schema %q: %w", user, err)
			}
			if exists {
				target = user
				break
			}
			continue
		}
		target = e
		break
	}
	if target == "" {
		return fmt.Errorf("search_path %q names no schema to migrate: set it to the schema txlimit is to live in", searchPath)
	}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regnamespace($1) IS NOT NULL", pgx.Identifier{target}.Sanitize()).Scan(&exists); err != nil {
		return fmt.Errorf("look up schema %q: %w", target, err)
	}
	if !exists {
		if !create {
			return fmt.Errorf("schema %q, the first of search_path %q, does not exist: create it, or call Up with CreateSchema()", target, searchPath)
		}
		_, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{target}.Sanitize())
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
			err = nil // created concurrently by another migrator between the check and the CREATE
		}
		if err != nil {
			return fmt.Errorf("create schema %q: %w", target, err)
		}
	}
	// goose and the lock create their tables in current_schema(): the first schema of the
	// search_path that exists and that the role may use. Anything but the target would migrate a
	// later schema.
	var current pgtype.Text
	if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&current); err != nil {
		return fmt.Errorf("read current_schema(): %w", err)
	}
	if current.String != target {
		return fmt.Errorf("schema %q, the first of search_path %q, is not the one Postgres uses (current_schema() is %q): "+
			"grant the role USAGE and CREATE on %q, or set search_path to the schema txlimit is to live in",
			target, searchPath, current.String, target)
	}
	if !exists {
		return nil // created by this call, as asked: a new schema is what the caller wants
	}
	// A table created in target would hide the state of a later schema of the search_path (one
	// named after the role, created after txlimit was migrated into public, say): every key of
	// every limit would start full again, and the old rows would be left behind unseen. A target
	// holding the migration lock's table is being migrated by another migrator, which found it so.
	var hidden string
	if err := pool.QueryRow(ctx, `SELECT coalesce((
	        SELECT p.s FROM unnest(current_schemas(false)) WITH ORDINALITY AS p(s, i)
	        WHERE p.s <> current_schema() AND to_regclass(format('%I.txlimit_state', p.s)) IS NOT NULL
	          AND to_regclass(format('%I.txlimit_state', current_schema())) IS NULL
	          AND to_regclass(format('%I.txlimit_goose_lock', current_schema())) IS NULL
	        ORDER BY p.i LIMIT 1), '')`).Scan(&hidden); err != nil {
		return fmt.Errorf("look for txlimit_state later in the search_path: %w", err)
	}
	if hidden != "" {
		return fmt.Errorf("schema %q, the first of search_path %q, holds no txlimit_state but schema %q, later in it, does: "+
			"a new, empty table in %q would hide it and every limit would start full again. To go on with that state, "+
			"set search_path to %q; to start afresh in %q, migrate with search_path set to %q alone",
			target, searchPath, hidden, target, hidden, target, target)
	}
	return nil
}

// splitSearchPath splits a search_path setting into schema names as Postgres reads them:
// double-quoted names keep their case and "" stands for one quote; other names are folded to lower
// case (A to Z only, as Postgres does in a multibyte encoding); "$user" is returned as it is.
func splitSearchPath(s string) []string {
	var out []string
	for i := 0; i < len(s); {
		for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == ',') {
			i++
		}
		if i >= len(s) {
			break
		}
		var name strings.Builder
		if s[i] == '"' {
			i++
			for i < len(s) {
				if s[i] == '"' {
					if i+1 < len(s) && s[i+1] == '"' {
						name.WriteByte('"')
						i += 2
						continue
					}
					i++
					break
				}
				name.WriteByte(s[i])
				i++
			}
		} else {
			start := i
			for i < len(s) && s[i] != ',' {
				i++
			}
			name.WriteString(asciiLower(strings.TrimSpace(s[start:i])))
		}
		for i < len(s) && s[i] != ',' {
			i++
		}
		out = append(out, name.String())
	}
	return out
}

// LockID is the ID of the lock row (in LockTable) that NewProvider's migrations hold while they
// run in schema: a positive 63-bit FNV-1a hash of "txlimit migrations" and the schema name.
func LockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("txlimit migrations\x00"))
	h.Write([]byte(schema))
	return int64(h.Sum64()>>1) | 1
}

// asciiLower folds A to Z to lower case and leaves every other byte as it is.
func asciiLower(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + ('a' - 'A')
		}
	}
	return string(b)
}
