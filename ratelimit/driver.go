package ratelimit

import (
	"context"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// stmts is an Executor's handle resolved to its driver, on which via sends the library's statements
// (internal/driver.Executor). A pgx handle goes straight to sqlc's generated pgx code (package
// dbsqlc, whose methods take the handle as an argument), so that the pgx path pays no allocation
// and no interface call for the boundary; the handle of another driver (package sqldb) goes
// through its driver.Executor.
type stmts struct {
	pgx   dbsqlc.DBTX     // nil for another driver's handle
	other driver.Executor // nil for a pgx handle
}

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

// searchPath and schemaVersion (and their other-driver forms) are the statements without an
// argument, in via's shape.
func searchPath(q *dbsqlc.Queries, ctx context.Context, db dbsqlc.DBTX, _ struct{}) (string, error) {
	return q.SearchPath(ctx, db)
}

func otherSearchPath(e driver.Executor, ctx context.Context, _ struct{}) (string, error) {
	return e.SearchPath(ctx)
}

func schemaVersion(q *dbsqlc.Queries, ctx context.Context, db dbsqlc.DBTX, _ struct{}) (dbsqlc.SchemaVersionRow, error) {
	return q.SchemaVersion(ctx, db)
}

func otherSchemaVersion(e driver.Executor, ctx context.Context, _ struct{}) (dbsqlc.SchemaVersionRow, error) {
	return e.SchemaVersion(ctx)
}
