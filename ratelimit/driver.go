package ratelimit

import (
	"context"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
	"github.com/txlimit/txlimit/internal/driver/pgxdriver"
)

// stmts sends the library's statements (internal/driver.Executor) on an Executor's handle. A pgx
// handle goes through pgxdriver, held here as a value so that the pgx path pays no allocation and
// no interface call for the boundary; the handle of another driver (package sqldb) through its
// driver.Executor.
type stmts struct {
	pgx   pgxdriver.Executor
	other driver.Executor // nil for a pgx handle
}

// stmts sends every statement of the boundary, so that a statement added to driver.Executor is
// added here too.
var _ driver.Executor = stmts{}

// stmtsFor resolves db to its driver; ok is false for a value no driver runs on (a bare *sql.Tx,
// say), which checkExecutor refuses before any call gets here.
func stmtsFor(db Executor) (s stmts, ok bool) {
	switch d := db.(type) {
	case driver.Executor:
		return stmts{other: d}, true
	case dbsqlc.DBTX:
		return stmts{pgx: pgxdriver.Executor{DB: d}}, true
	}
	return stmts{}, false
}

// on returns the statements of db, which checkExecutor has accepted.
func on(db Executor) stmts {
	s, _ := stmtsFor(db)
	return s
}

func (s stmts) DecideOne(ctx context.Context, arg dbsqlc.DecideOneParams) ([]byte, error) {
	if s.other != nil {
		return s.other.DecideOne(ctx, arg)
	}
	return s.pgx.DecideOne(ctx, arg)
}

func (s stmts) Decide(ctx context.Context, arg dbsqlc.DecideParams) ([]dbsqlc.DecideRow, error) {
	if s.other != nil {
		return s.other.Decide(ctx, arg)
	}
	return s.pgx.Decide(ctx, arg)
}

func (s stmts) WaitForShard(ctx context.Context, arg dbsqlc.WaitForShardParams) error {
	if s.other != nil {
		return s.other.WaitForShard(ctx, arg)
	}
	return s.pgx.WaitForShard(ctx, arg)
}

func (s stmts) Levels(ctx context.Context, arg dbsqlc.LevelsParams) ([]dbsqlc.LevelsRow, error) {
	if s.other != nil {
		return s.other.Levels(ctx, arg)
	}
	return s.pgx.Levels(ctx, arg)
}

func (s stmts) Reset(ctx context.Context, arg dbsqlc.ResetParams) (int64, error) {
	if s.other != nil {
		return s.other.Reset(ctx, arg)
	}
	return s.pgx.Reset(ctx, arg)
}

func (s stmts) Credit(ctx context.Context, arg dbsqlc.CreditParams) ([]dbsqlc.CreditRow, error) {
	if s.other != nil {
		return s.other.Credit(ctx, arg)
	}
	return s.pgx.Credit(ctx, arg)
}

func (s stmts) PruneCandidates(ctx context.Context, arg dbsqlc.PruneCandidatesParams) ([]dbsqlc.PruneCandidatesRow, error) {
	if s.other != nil {
		return s.other.PruneCandidates(ctx, arg)
	}
	return s.pgx.PruneCandidates(ctx, arg)
}

func (s stmts) PruneDelete(ctx context.Context, arg dbsqlc.PruneDeleteParams) (int64, error) {
	if s.other != nil {
		return s.other.PruneDelete(ctx, arg)
	}
	return s.pgx.PruneDelete(ctx, arg)
}

func (s stmts) OutOfDebtAt(ctx context.Context, arg dbsqlc.OutOfDebtAtParams) ([]dbsqlc.OutOfDebtAtRow, error) {
	if s.other != nil {
		return s.other.OutOfDebtAt(ctx, arg)
	}
	return s.pgx.OutOfDebtAt(ctx, arg)
}

func (s stmts) SearchPath(ctx context.Context) (string, error) {
	if s.other != nil {
		return s.other.SearchPath(ctx)
	}
	return s.pgx.SearchPath(ctx)
}

func (s stmts) SchemaVersion(ctx context.Context) (dbsqlc.SchemaVersionRow, error) {
	if s.other != nil {
		return s.other.SchemaVersion(ctx)
	}
	return s.pgx.SchemaVersion(ctx)
}
