package ratelimit

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// fakePgx has the methods of a pgx handle and runs nothing.
type fakePgx struct{}

func (*fakePgx) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, nil
}
func (*fakePgx) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, nil }
func (*fakePgx) QueryRow(context.Context, string, ...any) pgx.Row        { return nil }

// TestDriverBoundaryAllocatesNothing: resolving a pgx handle to its statements, as every call does,
// allocates nothing (the pgx driver is held by value, not behind an interface).
func TestDriverBoundaryAllocatesNothing(t *testing.T) {
	var db Executor = &fakePgx{}
	allocs := testing.AllocsPerRun(100, func() {
		s := on(db)
		if s.other != nil {
			t.Fatal("a pgx handle resolved to another driver")
		}
	})
	if allocs != 0 {
		t.Fatalf("got %v allocations per resolution; want 0", allocs)
	}
}
