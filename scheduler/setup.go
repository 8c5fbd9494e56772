package scheduler

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river"

	"github.com/txlimit/txlimit/internal/schedsql"
)

// ErrSetup matches (errors.Is) every *SetupError: the scheduler is not set up to work, whatever
// the call. It is not bad input (it does not match ratelimit.ErrInvalid): fix the set-up.
var ErrSetup = errors.New("scheduler: not set up")

// ErrNoPreciseHook matches (errors.Is) the *SetupError of a River client without PreciseHook.
var ErrNoPreciseHook = errors.New("scheduler: PreciseHook is not registered on the River client")

// ErrNoRiverTables matches (errors.Is) the *SetupError of a database without River's tables on
// the connection's search_path (SQLSTATE 42P01 for river_job and the like).
var ErrNoRiverTables = errors.New("scheduler: River's tables are missing")

// SetupError is a set-up mistake found by Check or by a call: it names what is wrong and how to
// fix it. It matches ErrSetup and one of ErrNoPreciseHook, ErrNoRiverTables (errors.Is), and
// unwraps to the database's error when there is one.
type SetupError struct {
	// Op is the call that found it, e.g. "ReserveTx" or "Check".
	Op string
	// Problem is ErrNoPreciseHook or ErrNoRiverTables.
	Problem error
	// Fix says what to do.
	Fix string
	// SearchPath is the connection's search_path when the tables were missing ("" when it could
	// not be read or does not matter).
	SearchPath string
	// Err is the underlying error, if any (the *pgconn.PgError of a missing table).
	Err error
}

func (e *SetupError) Error() string {
	s := fmt.Sprintf("scheduler: %s: %v: %s", e.Op, strings.TrimPrefix(e.Problem.Error(), "scheduler: "), e.Fix)
	if e.SearchPath != "" {
		s += fmt.Sprintf(" (the connection's search_path is %q)", e.SearchPath)
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is reports whether target is ErrSetup or e.Problem.
func (e *SetupError) Is(target error) bool { return target == ErrSetup || target == e.Problem }

// Unwrap returns the underlying error.
func (e *SetupError) Unwrap() error { return e.Err }

const (
	fixHook   = "add &scheduler.PreciseHook{} to river.Config.Hooks of the client (or set scheduler.Config.AllowImprecise to accept River's ~5 s lateness)"
	fixTables = "run scheduler.Migrate on this database and schema (it runs River's migrator), or set the connection's search_path to the schema that has them"
)

// noHookError is the error of a call whose insert did not go through PreciseHook.
func noHookError(op string) error {
	return &SetupError{Op: op, Problem: ErrNoPreciseHook, Fix: fixHook}
}

// missingRiverTable returns err as a *SetupError when it is Postgres's "undefined table" or
// "undefined function" (42P01, 42883) for one of River's objects; db, when not nil and usable,
// gives the search_path. Otherwise it returns nil.
func missingRiverTable(ctx context.Context, op string, db schedsql.DBTX, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != "42P01" && pgErr.Code != "42883") || !strings.Contains(pgErr.Message, "river_") {
		return nil
	}
	se := &SetupError{Op: op, Problem: ErrNoRiverTables, Fix: fixTables, Err: err}
	if db != nil {
		if path, perr := schedsql.New().SearchPath(ctx, db); perr == nil {
			se.SearchPath = path
		}
	}
	return se
}

// checkArgs is the job of Check's probe insert, which PreciseHook stops before it is written.
type checkArgs struct{}

func (checkArgs) Kind() string { return "txlimit_scheduler_check" }

// errProbe is what PreciseHook returns for Check's probe, to stop the insert.
var errProbe = errors.New("scheduler: check probe (not an error)")

// Check verifies the set-up the scheduler needs, once, e.g. at start-up: River's tables are on
// db's search_path, and PreciseHook is registered on the River client (unless
// Config.AllowImprecise). It returns a *SetupError (errors.Is(err, ErrSetup)) naming the fix, or
// the database's error. It writes nothing: the hook is probed with an insert that it stops before
// anything is written, inside a transaction (a savepoint when db is a pgx.Tx) that is rolled back.
//
// probe is the args of the probe insert. A River client with Workers refuses args of a kind it has
// no worker for before its hooks run, so pass args of one of its kinds (nothing is inserted); nil
// uses a kind of this package, which works for insert-only clients and clients with
// SkipUnknownJobCheck. Defaults to nil.
func (s *Scheduler) Check(ctx context.Context, db Beginner, probe river.JobArgs) error {
	const op = "Check"
	if db == nil {
		return argError(op, "db", "is nil: pass the *pgxpool.Pool of the River client", nil)
	}
	if probe == nil {
		probe = checkArgs{}
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("scheduler: %s: %w", op, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the check writes nothing
	row, err := schedsql.New().RiverTables(ctx, tx)
	if err != nil {
		return fmt.Errorf("scheduler: %s: %w", op, err)
	}
	if !row.Present {
		return &SetupError{Op: op, Problem: ErrNoRiverTables, Fix: fixTables, SearchPath: row.SearchPath}
	}
	if s.allowImprecise {
		return nil
	}
	seen := false
	pctx := context.WithValue(withHookSeen(WithPrecise(ctx), &seen), probeKey{}, true)
	_, err = s.client.InsertTx(pctx, tx, probe, &river.InsertOpts{ScheduledAt: time.Now().Add(time.Hour)})
	switch {
	case seen && errors.Is(err, errProbe):
		return nil
	case err == nil:
		return noHookError(op)
	}
	if se := missingRiverTable(ctx, op, nil, err); se != nil {
		return se
	}
	if !seen && isRiverRefusal(err) {
		return fmt.Errorf("scheduler: %s: River refused the probe before its hooks ran (pass args of a kind the client works as probe): %w", op, err)
	}
	return fmt.Errorf("scheduler: %s: %w", op, err)
}

// Beginner begins a transaction, or a savepoint of one: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// isRiverRefusal reports whether err is River refusing an insert without a database error.
func isRiverRefusal(err error) bool {
	var pgErr *pgconn.PgError
	return !errors.As(err, &pgErr)
}

type (
	hookSeenKey struct{}
	probeKey    struct{}
)

// withHookSeen returns a context in which PreciseHook sets *seen when it runs.
func withHookSeen(ctx context.Context, seen *bool) context.Context {
	return context.WithValue(ctx, hookSeenKey{}, seen)
}

// markHookSeen is called by PreciseHook: it records that the hook ran, and stops Check's probe.
func markHookSeen(ctx context.Context) error {
	if seen, ok := ctx.Value(hookSeenKey{}).(*bool); ok && seen != nil {
		*seen = true
	}
	if probe, _ := ctx.Value(probeKey{}).(bool); probe {
		return errProbe
	}
	return nil
}
