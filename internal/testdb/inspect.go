package testdb

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Querier is what the inspection helpers need: a pool, conn or tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// RowVersion returns the xmin (the id of the transaction that last wrote the row) of one state
// row, and whether the row exists. A decision that writes nothing leaves it unchanged.
func RowVersion(tb testing.TB, db Querier, name, key string, shard int) (xmin uint32, found bool) {
	tb.Helper()
	err := db.QueryRow(context.Background(),
		"SELECT xmin::text::bigint FROM txlimit_state WHERE name = $1 AND key = $2 AND shard = $3",
		name, key, shard).Scan(&xmin)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false
	}
	if err != nil {
		tb.Fatalf("testdb: read xmin: %v", err)
	}
	return xmin, true
}

// StoredRow returns one state row as stored (its value and its ts in microseconds since the Unix
// epoch), and whether it exists.
func StoredRow(tb testing.TB, db Querier, name, key string, shard int) (value float64, ts int64, found bool) {
	tb.Helper()
	err := db.QueryRow(context.Background(),
		"SELECT value, ts FROM txlimit_state WHERE name = $1 AND key = $2 AND shard = $3",
		name, key, shard).Scan(&value, &ts)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, false
	}
	if err != nil {
		tb.Fatalf("testdb: read a row: %v", err)
	}
	return value, ts, true
}

// LockWait returns the kind of lock the backend pid is waiting for (pg_stat_activity.wait_event
// of a Lock wait: "advisory", "tuple", "transactionid"…), or "" when it is not waiting for a lock.
func LockWait(tb testing.TB, db Querier, pid uint32) string {
	tb.Helper()
	var ev string
	err := db.QueryRow(context.Background(),
		"SELECT CASE WHEN wait_event_type = 'Lock' THEN wait_event ELSE '' END FROM pg_stat_activity WHERE pid = $1::integer",
		int64(pid)).Scan(&ev)
	if err != nil {
		tb.Fatalf("testdb: wait event: %v", err)
	}
	return ev
}

// RowLocker returns the xmax of one state row: 0 when no transaction has locked or replaced this
// version of the row, else the id of the last one that did (it stays after that transaction ends).
func RowLocker(tb testing.TB, db Querier, name, key string, shard int) uint32 {
	tb.Helper()
	var xmax uint32
	err := db.QueryRow(context.Background(),
		"SELECT xmax::text::bigint FROM txlimit_state WHERE name = $1 AND key = $2 AND shard = $3",
		name, key, shard).Scan(&xmax)
	if err != nil {
		tb.Fatalf("testdb: read xmax: %v", err)
	}
	return xmax
}

// CountRows returns the number of rows in txlimit_state.
func CountRows(tb testing.TB, db Querier) int {
	tb.Helper()
	return scalar[int](tb, db, "count rows", "SELECT count(*) FROM txlimit_state")
}

// scalar returns the one value sql selects, failing tb with what it read when it cannot.
func scalar[T any](tb testing.TB, db Querier, what, sql string, args ...any) T {
	tb.Helper()
	var v T
	if err := db.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		tb.Fatalf("testdb: %s: %v", what, err)
	}
	return v
}

// LockRow takes the row lock of one state row in tx (SELECT … FOR UPDATE), as a concurrent
// writer would hold it.
func LockRow(tb testing.TB, tx pgx.Tx, name, key string, shard int) {
	tb.Helper()
	lockRow(tb, tx, "UPDATE", name, key, shard)
}

// KeyShareRow takes a FOR KEY SHARE lock on one state row in tx, as a foreign key referencing the
// row would.
func KeyShareRow(tb testing.TB, tx pgx.Tx, name, key string, shard int) {
	tb.Helper()
	lockRow(tb, tx, "KEY SHARE", name, key, shard)
}

// lockRow locks one state row in tx with SELECT … FOR strength.
func lockRow(tb testing.TB, tx pgx.Tx, strength, name, key string, shard int) {
	tb.Helper()
	var one int
	err := tx.QueryRow(context.Background(),
		"SELECT 1 FROM txlimit_state WHERE name = $1 AND key = $2 AND shard = $3 FOR "+strength,
		name, key, shard).Scan(&one)
	if err != nil {
		tb.Fatalf("testdb: lock row (FOR %s): %v", strength, err)
	}
}

// steerLock is the advisory lock key that steering takes for one shard of a sharded limit (base:
// the hash of the limit's name and key the package computes), in this schema; queueLock is the one
// on which the decision queues lone calls on the pool for a row.
const (
	steerLock = "($1::bigint # ('txlimit_state'::regclass::oid::bigint << 20) # $2::bigint)"
	queueLock = "(" + steerLock + " # 524288)"
)

// QueueWaiters returns how many backends are waiting for the queue lock of one state row.
func QueueWaiters(tb testing.TB, db Querier, base int64, shard int) int {
	tb.Helper()
	return advisoryWaiters(tb, db, queueLock, base, shard)
}

// SteerWaiters returns how many backends are waiting for the steering lock of one shard.
func SteerWaiters(tb testing.TB, db Querier, base int64, shard int) int {
	tb.Helper()
	return advisoryWaiters(tb, db, steerLock, base, shard)
}

// HoldSteerLock takes the steering lock of one shard in tx, as a transaction deciding on that
// shard holds it, without locking its row.
func HoldSteerLock(tb testing.TB, tx pgx.Tx, base int64, shard int) {
	tb.Helper()
	if _, err := tx.Exec(context.Background(), "SELECT pg_advisory_xact_lock("+steerLock+")", base, shard); err != nil {
		tb.Fatalf("testdb: take a steering lock: %v", err)
	}
}

// advisoryWaiters returns how many backends are waiting for the advisory lock whose key the SQL
// expression lock computes from base and shard.
func advisoryWaiters(tb testing.TB, db Querier, lock string, base int64, shard int) int {
	tb.Helper()
	var n int
	err := db.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_locks
		 WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1
		   AND ((classid::bigint << 32) | objid::bigint) = `+lock,
		base, shard).Scan(&n)
	if err != nil {
		tb.Fatalf("testdb: advisory lock waiters: %v", err)
	}
	return n
}

// RowsWrittenByFirstCommand returns how many rows of limit name the first command of tx wrote
// (system column cmin 0): a decision that wrote its rows in its first statement.
func RowsWrittenByFirstCommand(tb testing.TB, tx pgx.Tx, name string) int {
	tb.Helper()
	var n int
	err := tx.QueryRow(context.Background(),
		`SELECT count(*) FROM txlimit_state WHERE name = $1 AND xmin = pg_current_xact_id()::xid AND cmin::text = '0'`, name).Scan(&n)
	if err != nil {
		tb.Fatalf("testdb: rows written by the first command: %v", err)
	}
	return n
}

// BlockedBy returns how many backends are waiting for a lock that the backend pid holds.
func BlockedBy(tb testing.TB, db Querier, pid uint32) int {
	tb.Helper()
	var n int
	err := db.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_stat_activity WHERE $1::integer = ANY (pg_blocking_pids(pid))", int64(pid)).Scan(&n)
	if err != nil {
		tb.Fatalf("testdb: blocked by: %v", err)
	}
	return n
}

// UpdateCounts returns how many row updates of txlimit_state (in the connection's schema) this
// database has counted, and how many of them were HOT (heap-only: no index entry written). It
// first flushes the statistics of the connection it runs on (Postgres 15+), so call it on the
// connection that made the updates.
func UpdateCounts(tb testing.TB, conn *pgx.Conn) (updates, hot int64) {
	tb.Helper()
	ctx := context.Background()
	if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
		tb.Fatalf("testdb: flush stats: %v", err)
	}
	if _, err := conn.Exec(ctx, "SELECT 1"); err != nil { // the flush happens after a statement
		tb.Fatalf("testdb: flush stats: %v", err)
	}
	err := conn.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
		WHERE relid = 'txlimit_state'::regclass`).Scan(&updates, &hot)
	if err != nil {
		tb.Fatalf("testdb: read update counts: %v", err)
	}
	return updates, hot
}

// Conn opens a single connection whose search_path is the schema of pool, closed when the test
// ends.
func Conn(tb testing.TB, pool interface{ Config() *pgxpool.Config }) *pgx.Conn {
	tb.Helper()
	conn, err := pgx.ConnectConfig(context.Background(), pool.Config().ConnConfig.Copy())
	if err != nil {
		tb.Fatalf("testdb: connect: %v", err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// PlanConn opens a single connection like Conn that records the plan of every statement it runs,
// nested ones included (the statements inside a PL/pgSQL function), through Postgres's
// auto_explain module (a superuser may load it in a session), with the rows each node returned
// ("(never executed)" for a node that did not run). plans returns the plans recorded so far, as
// text, and forgets them.
func PlanConn(tb testing.TB, pool interface{ Config() *pgxpool.Config }) (conn *pgx.Conn, plans func() []string) {
	tb.Helper()
	var mu sync.Mutex
	var got []string
	cfg := pool.Config().ConnConfig.Copy()
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, n.Message)
	}
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("testdb: connect: %v", err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	for _, q := range []string{
		"LOAD 'auto_explain'",
		"SET auto_explain.log_min_duration = 0",
		"SET auto_explain.log_nested_statements = on",
		"SET auto_explain.log_level = notice",
		"SET auto_explain.log_analyze = on",
		"SET auto_explain.log_timing = off",
	} {
		if _, err := conn.Exec(context.Background(), q); err != nil {
			tb.Fatalf("testdb: %s: %v", q, err)
		}
	}
	return conn, func() []string {
		mu.Lock()
		defer mu.Unlock()
		out := got
		got = nil
		return out
	}
}

// Analyze runs VACUUM ANALYZE on txlimit_state, so the planner sees its real (small) size.
func Analyze(tb testing.TB, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}) {
	tb.Helper()
	if _, err := db.Exec(context.Background(), "VACUUM ANALYZE txlimit_state"); err != nil {
		tb.Fatalf("testdb: vacuum analyze: %v", err)
	}
}

// RelationPredicateLocks returns how many relation-level SIRead (SERIALIZABLE predicate) locks the
// transaction tx holds on txlimit_state. A sequential scan takes one; primary-key lookups do not.
func RelationPredicateLocks(tb testing.TB, tx pgx.Tx) int {
	tb.Helper()
	return predicateLocks(tb, tx, "relation")
}

// HeapPagePredicateLocks counts the page-level SIRead locks tx holds on txlimit_state's heap (not
// its index). Postgres promotes a transaction's tuple locks to one on the whole page when it has
// read more than max_pred_locks_per_page (2) tuples of it, and a page holds every shard of a key.
func HeapPagePredicateLocks(tb testing.TB, tx pgx.Tx) int {
	tb.Helper()
	return predicateLocks(tb, tx, "page")
}

func predicateLocks(tb testing.TB, tx pgx.Tx, locktype string) int {
	tb.Helper()
	var n int
	err := tx.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
		WHERE pid = pg_backend_pid() AND mode = 'SIReadLock' AND locktype = $1
		  AND relation = 'txlimit_state'::regclass`, locktype).Scan(&n)
	if err != nil {
		tb.Fatalf("testdb: read predicate locks: %v", err)
	}
	return n
}
