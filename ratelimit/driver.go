package ratelimit

import (
	"context"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// stmts sends the library's statements (internal/driver.Executor) on an Executor's handle. A pgx
// handle goes straight to sqlc's generated pgx code (package dbsqlc, whose methods take the handle
// as an argument), so that the pgx path pays no allocation and no interface call for the boundary;
// the handle of another driver (package sqldb) goes through its driver.Executor.
type stmts struct {
	pgx   dbsqlc.DBTX     // nil for another driver's handle
	other driver.Executor // nil for a pgx handle
}

// stmts sends every statement of the boundary, so that a statement added to driver.Executor is
// added here too.
var _ driver.Executor = stmts{}

// queries is stateless: sqlc's pgx methods take the handle as an argument.
var queries = dbsqlc.New()

// stmtsFor resolves db to its driver; ok is false for a value no driver runs on (a bare *sql.Tx,
// say), which checkExecutor refuses before any call gets here.
func stmtsFor(db Executor) (s stmts, ok bool) {
	switch d := db.(type) {
	case driver.Executor:
		return stmts{other: d}, true
	case dbsqlc.DBTX:
		return stmts{pgx: d}, true
	}
	return stmts{}, false
}

// on returns the statements of db, which checkExecutor has accepted.
func on(db Executor) stmts {
	s, _ := stmtsFor(db)
	return s
}

// via sends one statement with argument arg: through sqlc's pgx method viaPgx on a pgx handle,
// else through the other driver's method viaOther.
func via[A, R any](s stmts, ctx context.Context, arg A,
	viaPgx func(*dbsqlc.Queries, context.Context, dbsqlc.DBTX, A) (R, error),
	viaOther func(driver.Executor, context.Context, A) (R, error)) (R, error) {
	if s.other != nil {
		return viaOther(s.other, ctx, arg)
	}
	return viaPgx(queries, ctx, s.pgx, arg)
}

func (s stmts) DecideOne(ctx context.Context, arg dbsqlc.DecideOneParams) ([]byte, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).DecideOne, driver.Executor.DecideOne)
}

func (s stmts) Decide(ctx context.Context, arg dbsqlc.DecideParams) ([]dbsqlc.DecideRow, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).Decide, driver.Executor.Decide)
}

func (s stmts) WaitForShard(ctx context.Context, arg dbsqlc.WaitForShardParams) error {
	if s.other != nil {
		return s.other.WaitForShard(ctx, arg)
	}
	return queries.WaitForShard(ctx, s.pgx, arg)
}

func (s stmts) Levels(ctx context.Context, arg dbsqlc.LevelsParams) ([]dbsqlc.LevelsRow, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).Levels, driver.Executor.Levels)
}

func (s stmts) Reset(ctx context.Context, arg dbsqlc.ResetParams) (int64, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).Reset, driver.Executor.Reset)
}

func (s stmts) Credit(ctx context.Context, arg dbsqlc.CreditParams) ([]dbsqlc.CreditRow, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).Credit, driver.Executor.Credit)
}

func (s stmts) PruneCandidates(ctx context.Context, arg dbsqlc.PruneCandidatesParams) ([]dbsqlc.PruneCandidatesRow, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).PruneCandidates, driver.Executor.PruneCandidates)
}

func (s stmts) PruneDelete(ctx context.Context, arg dbsqlc.PruneDeleteParams) (int64, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).PruneDelete, driver.Executor.PruneDelete)
}

func (s stmts) OutOfDebtAt(ctx context.Context, arg dbsqlc.OutOfDebtAtParams) ([]dbsqlc.OutOfDebtAtRow, error) {
	return via(s, ctx, arg, (*dbsqlc.Queries).OutOfDebtAt, driver.Executor.OutOfDebtAt)
}

func (s stmts) SearchPath(ctx context.Context) (string, error) {
	if s.other != nil {
		return s.other.SearchPath(ctx)
	}
	return queries.SearchPath(ctx, s.pgx)
}

func (s stmts) SchemaVersion(ctx context.Context) (dbsqlc.SchemaVersionRow, error) {
	if s.other != nil {
		return s.other.SchemaVersion(ctx)
	}
	return queries.SchemaVersion(ctx, s.pgx)
}
