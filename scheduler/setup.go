package scheduler

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river"

	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// ErrSetup matches (errors.Is) every *SetupError: txlimit or its scheduler is not set up to work,
// whatever the call. It is ratelimit.ErrSetup, so one check covers both packages. It is not bad
// input (it does not match ratelimit.ErrInvalid): fix the set-up.
var ErrSetup = ratelimit.ErrSetup

// ErrNoPreciseHook matches (errors.Is) the *SetupError of a River client without PreciseHook.
var ErrNoPreciseHook = errors.New("scheduler: PreciseHook is not registered on the River client")

// ErrNoRiverTables matches (errors.Is) the *SetupError of a database without River's tables on
// the connection's search_path (SQLSTATE 42P01 for river_job and the like).
var ErrNoRiverTables = errors.New("scheduler: River's tables are missing")

// ErrQueueNotWorked matches (errors.Is) the *SetupError of a reserved job headed for a queue that
// no River client works (Config.Queues says which do): it would wait there, its tokens reserved,
// until someone cancels it. ReserveTx and ReserveManyTx return it before anything is reserved.
var ErrQueueNotWorked = errors.New("scheduler: no River client works the job's queue")

// SetupError is a set-up mistake found by Check or by a call: ratelimit.SetupError, with Package
// "scheduler" and Problem one of ErrNoPreciseHook, ErrNoRiverTables, ErrQueueNotWorked. It says how
// to fix it, then what is wrong; it matches ErrSetup and its Problem (errors.Is), and unwraps to
// the database's error when there is one. A call of package ratelimit made for the scheduler
// (ReserveTx's decision) returns ratelimit's own, with Package "ratelimit".
type SetupError = ratelimit.SetupError

// pkgScheduler is the Package of this package's *SetupError.
const pkgScheduler = "scheduler"

const (
	fixHook   = "add &scheduler.PreciseHook{} to river.Config.Hooks of the client, or set scheduler.Config.AllowImprecise to accept River's ~5 s lateness"
	fixTables = "run scheduler.Migrate (River's migrator) on this database and schema, or set the connection's search_path to the schema that has River's tables"
)

// noHookError is the error of a call whose insert did not go through PreciseHook.
func noHookError(op string) error {
	return &SetupError{Package: pkgScheduler, Op: op, Problem: ErrNoPreciseHook, Fix: fixHook}
}

// missingRiverTable returns err as a *SetupError when it is Postgres's "undefined table" or
// "undefined function" (42P01, 42883) for one of River's objects; db, when not nil and usable,
// gives the search_path. Otherwise it returns nil.
func missingRiverTable(ctx context.Context, op string, db schedsql.DBTX, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != "42P01" && pgErr.Code != "42883") || !strings.Contains(pgErr.Message, "river_") {
		return nil
	}
	se := &SetupError{Package: pkgScheduler, Op: op, Problem: ErrNoRiverTables, Fix: fixTables, Err: err}
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
// db's search_path; River's clients work the queues reserved jobs go to (ErrQueueNotWorked: the
// queue of probe, as ReserveTx checks it, and every queue of Config.Queues, when River's queue
// table lists any queue at all); and PreciseHook is registered on the River client (unless
// Config.AllowImprecise). It returns a *SetupError (errors.Is(err, ErrSetup)) naming the fix, or
// the database's error. It writes nothing: the hook is probed with an insert that it stops before
// anything is written, inside a transaction (a savepoint when db is a pgx.Tx) that is rolled back.
//
// probe is the args of the probe insert: pass the args of your reserved jobs. Their queue (their
// InsertOpts().Queue, else river.QueueDefault) is checked; a queue a call names in
// ReserveOpts.InsertOpts.Queue is checked by that call. A River client with Workers refuses args of
// a kind it has no worker for before its hooks run, so they must be of one of its kinds (nothing is
// inserted). nil uses a kind of this package, which works for insert-only clients and clients with
// SkipUnknownJobCheck, and checks no queue but those of Config.Queues. Defaults to nil. A nil db,
// a nil pointer as db or probe, or a probe whose queue is a name River refuses, is an
// *ratelimit.ArgumentError.
func (s *Scheduler) Check(ctx context.Context, db Beginner, probe river.JobArgs) error {
	const op = "Check"
	if err := nilArg(op, "db", db, "pass the *pgxpool.Pool of the River client"); err != nil {
		return err
	}
	if probe != nil {
		if err := nilArg(op, "probe", probe, "pass args of your reserved jobs, or nil"); err != nil {
			return err
		}
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
		return &SetupError{Package: pkgScheduler, Op: op, Problem: ErrNoRiverTables, Fix: fixTables, SearchPath: row.SearchPath}
	}
	if err := s.checkQueues(ctx, op, tx, probe); err != nil {
		return err
	}
	if s.allowImprecise {
		return nil
	}
	if probe == nil {
		probe = checkArgs{}
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

// checkQueues returns the *SetupError of the first queue reserved jobs go to that no River client
// works: probe's, when not nil, and those of Config.Queues, when River's queue table lists any.
func (s *Scheduler) checkQueues(ctx context.Context, op string, tx pgx.Tx, probe river.JobArgs) error {
	if probe != nil {
		queue := jobQueue(probe, river.InsertOpts{})
		if err := checkQueueName(op, "probe's InsertOpts().Queue", queue); err != nil {
			return err
		}
		if err := s.workedQueue(ctx, op, tx, queue); err != nil {
			return err
		}
	}
	if s.queues == nil {
		return nil
	}
	names, err := schedsql.New().WorkedQueues(ctx, tx)
	if err != nil {
		return fmt.Errorf("scheduler: %s: read River's queues (river_queue): %w", op, err)
	}
	for _, q := range s.queues {
		if len(names) > 0 && !slices.Contains(names, q) {
			return &SetupError{Package: pkgScheduler, Op: op, Problem: ErrQueueNotWorked, Queue: q, Fix: fmt.Sprintf(
				"have a River client work %q (river.Config.Queues; River's clients work %s), or remove it from scheduler.Config.Queues",
				q, quoted(names))}
		}
	}
	return nil
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
