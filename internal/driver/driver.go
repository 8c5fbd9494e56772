// Package driver is the boundary between package ratelimit and a database package: Executor is
// the handful of statements the library sends, implemented once per database package on the code
// sqlc generates from internal/dbsqlc/queries: for pgx/v5, sqlc's pgx output itself (package
// dbsqlc, whose methods package ratelimit calls with the handle, with nothing in between); for
// database/sql, package sqldb on sqlc's database/sql output (internal/dbsqlcstd).
// Package drivertest holds the contract suite every driver passes.
//
// The parameters and rows are those sqlc generates for pgx (package dbsqlc), which the engine
// builds anyway, so that pgx takes them as they are; another driver converts them to its own. The package is internal: the interface changes with the statements.
package driver

import (
	"context"

	"github.com/txlimit/txlimit/internal/dbsqlc"
)

// Executor runs txlimit's statements on one database handle: a pool, a connection or a
// transaction. Every method is one statement and one round trip; internal/dbsqlc/queries says
// what each does. An error that carries an SQLSTATE matches *pgconn.PgError under errors.As,
// whatever the database package, so that the SQLSTATE checks of package ratelimit (IsRetryable, a
// missing migration's *SetupError) work alike.
type Executor interface {
	DecideOneRow(ctx context.Context, arg dbsqlc.DecideOneRowParams) ([]byte, error)
	DecideOne(ctx context.Context, arg dbsqlc.DecideOneParams) ([]byte, error)
	Decide(ctx context.Context, arg dbsqlc.DecideParams) ([]dbsqlc.DecideRow, error)
	Levels(ctx context.Context, arg dbsqlc.LevelsParams) ([]dbsqlc.LevelsRow, error)
	Reset(ctx context.Context, arg dbsqlc.ResetParams) (int64, error)
	Credit(ctx context.Context, arg dbsqlc.CreditParams) ([]dbsqlc.CreditRow, error)
	PruneCandidates(ctx context.Context, arg dbsqlc.PruneCandidatesParams) ([]dbsqlc.PruneCandidatesRow, error)
	PruneDelete(ctx context.Context, arg dbsqlc.PruneDeleteParams) (int64, error)
	OutOfDebtAt(ctx context.Context, arg dbsqlc.OutOfDebtAtParams) ([]dbsqlc.OutOfDebtAtRow, error)
	SearchPath(ctx context.Context) (string, error)
	SchemaVersion(ctx context.Context) (dbsqlc.SchemaVersionRow, error)
}

// Pooled is implemented by an Executor whose handle may be a pool shared by goroutines, each
// statement a transaction of its own on a connection of its own (database/sql's *sql.DB). Package
// ratelimit admits the lone calls of a sharded key on such a handle as it does those on a
// *pgxpool.Pool (ratelimit/admission.go).
type Pooled interface {
	// Pool returns the pool the handle is, as a value that is equal (==) for every Executor of
	// that pool, so that their calls share a key's slots; nil when the handle is not such a pool.
	Pool() any
}
