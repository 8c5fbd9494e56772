package testdb

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
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

// CountRows returns the number of rows in txlimit_state.
func CountRows(tb testing.TB, db Querier) int {
	tb.Helper()
	var n int
	if err := db.QueryRow(context.Background(), "SELECT count(*) FROM txlimit_state").Scan(&n); err != nil {
		tb.Fatalf("testdb: count rows: %v", err)
	}
	return n
}

// LockRow takes the row lock of one state row in tx (SELECT … FOR UPDATE), as a concurrent
// writer would hold it.
func LockRow(tb testing.TB, tx pgx.Tx, name, key string, shard int) {
	tb.Helper()
	var one int
	err := tx.QueryRow(context.Background(),
		"SELECT 1 FROM txlimit_state WHERE name = $1 AND key = $2 AND shard = $3 FOR UPDATE",
		name, key, shard).Scan(&one)
	if err != nil {
		tb.Fatalf("testdb: lock row: %v", err)
	}
}
