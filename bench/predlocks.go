package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// predicateLocks makes one txlimit decision inside a SERIALIZABLE transaction on the bench table as
// it stands and lists the predicate (SIRead) locks it took, then rolls back. A lock on the whole
// relation means every concurrent SERIALIZABLE writer of txlimit_state, whatever its key or shard,
// is a read/write conflict: it explains retries that sharding or per-user keys cannot remove.
func predicateLocks(ctx context.Context, env *Env) (string, error) {
	lim, err := newTxlimit(env, 16)
	if err != nil {
		return "", err
	}
	tx, err := env.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return "", err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := lim.Limit(ctx, tx, limitAllow.Name, "predicate-lock-probe", nil); err != nil {
		return "", err
	}
	locks, err := tx.Query(ctx, `SELECT locktype, relation::regclass::text, count(*)
FROM pg_locks WHERE pid = pg_backend_pid() AND mode = 'SIReadLock'
GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return "", err
	}
	var parts []string
	for locks.Next() {
		var kind, rel string
		var n int64
		if err := locks.Scan(&kind, &rel, &n); err != nil {
			return "", err
		}
		parts = append(parts, fmt.Sprintf("%d %s lock(s) on %s", n, kind, rel))
	}
	if err := locks.Err(); err != nil {
		return "", err
	}
	// Only now the table's size: counting it is a sequential scan, which takes a relation-level
	// predicate lock of its own.
	var rows, pages int64
	if err := tx.QueryRow(ctx, "SELECT count(*), pg_relation_size('txlimit_state') / current_setting('block_size')::bigint FROM txlimit_state").Scan(&rows, &pages); err != nil {
		return "", err
	}
	return fmt.Sprintf("one 16-shard decision in SERIALIZABLE on txlimit_state as it stood after the run (%d rows, %d pages) took SIRead locks: %s",
		rows, pages, strings.Join(parts, ", ")), nil
}
