// Package pgxdriver is txlimit's driver for pgx/v5 (driver.Executor): the calls of sqlc's
// generated package dbsqlc on a pgx.Tx, *pgxpool.Pool, *pgx.Conn or anything else with their
// Exec, Query and QueryRow. Package ratelimit holds an Executor as a value, so that a decision on
// pgx pays no allocation for the boundary.
package pgxdriver

import (
	"context"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// Executor runs the statements on DB. The zero value has no handle and must not be used.
type Executor struct {
	// DB is the pgx handle. Required.
	DB dbsqlc.DBTX
}

var _ driver.Executor = Executor{}

// queries is stateless: sqlc's methods take the handle as an argument.
var queries = dbsqlc.New()

// DecideOne implements driver.Executor.
func (e Executor) DecideOne(ctx context.Context, arg dbsqlc.DecideOneParams) ([]byte, error) {
	return queries.DecideOne(ctx, e.DB, arg)
}

// Decide implements driver.Executor.
func (e Executor) Decide(ctx context.Context, arg dbsqlc.DecideParams) ([]dbsqlc.DecideRow, error) {
	return queries.Decide(ctx, e.DB, arg)
}

// WaitForShard implements driver.Executor.
func (e Executor) WaitForShard(ctx context.Context, arg dbsqlc.WaitForShardParams) error {
	return queries.WaitForShard(ctx, e.DB, arg)
}

// Levels implements driver.Executor.
func (e Executor) Levels(ctx context.Context, arg dbsqlc.LevelsParams) ([]dbsqlc.LevelsRow, error) {
	return queries.Levels(ctx, e.DB, arg)
}

// Reset implements driver.Executor.
func (e Executor) Reset(ctx context.Context, arg dbsqlc.ResetParams) (int64, error) {
	return queries.Reset(ctx, e.DB, arg)
}

// Credit implements driver.Executor.
func (e Executor) Credit(ctx context.Context, arg dbsqlc.CreditParams) ([]dbsqlc.CreditRow, error) {
	return queries.Credit(ctx, e.DB, arg)
}

// PruneCandidates implements driver.Executor.
func (e Executor) PruneCandidates(ctx context.Context, arg dbsqlc.PruneCandidatesParams) ([]dbsqlc.PruneCandidatesRow, error) {
	return queries.PruneCandidates(ctx, e.DB, arg)
}

// PruneDelete implements driver.Executor.
func (e Executor) PruneDelete(ctx context.Context, arg dbsqlc.PruneDeleteParams) (int64, error) {
	return queries.PruneDelete(ctx, e.DB, arg)
}

// OutOfDebtAt implements driver.Executor.
func (e Executor) OutOfDebtAt(ctx context.Context, arg dbsqlc.OutOfDebtAtParams) ([]dbsqlc.OutOfDebtAtRow, error) {
	return queries.OutOfDebtAt(ctx, e.DB, arg)
}

// SearchPath implements driver.Executor.
func (e Executor) SearchPath(ctx context.Context) (string, error) {
	return queries.SearchPath(ctx, e.DB)
}

// SchemaVersion implements driver.Executor.
func (e Executor) SchemaVersion(ctx context.Context) (dbsqlc.SchemaVersionRow, error) {
	return queries.SchemaVersion(ctx, e.DB)
}
