package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txlimit/txlimit/migrations"
)

// ErrSetup is matched (errors.Is) by every *SetupError, whichever package found it: the database
// is reachable, but txlimit (package ratelimit) or its scheduler (package scheduler) is not set up
// to work there. It is not bad input: it does not match ErrInvalid. scheduler.ErrSetup is the same
// value.
var ErrSetup = errors.New("txlimit: not set up")

// SetupError reports a set-up mistake rather than a failed decision, found by package ratelimit or
// package scheduler (scheduler.SetupError is this type). Its message leads with the fix, naming the
// call that found it. It matches ErrSetup and, when set, Problem (errors.Is), and unwraps to Err.
//
// Package ratelimit reports txlimit's schema: a table or function of txlimit that Postgres did not
// find (SQLSTATE 42P01 or 42883: a forgotten migration, a search_path that does not name the
// migrated schema, a schema migrated by an older txlimit), or, from CheckSchema, a schema whose
// migration version is behind this build, or which no longer has a function this build calls (a
// newer txlimit migrated it). Nothing was written. Package scheduler reports River's
// side (its Problem says what: scheduler.ErrNoPreciseHook, ErrNoRiverTables, ErrQueueNotWorked).
type SetupError struct {
	// Package is the package whose call found the mistake: "ratelimit" or "scheduler". Defaults to
	// "" (read as "ratelimit").
	Package string
	// Op is the call that found it, e.g. "Limit", "CheckSchema", "ReserveTx" or "Check"; "Batcher"
	// when a Batcher's batch found it (a batch holds calls of any kind).
	Op string
	// Problem is the mistake, when its package names one with a sentinel error (package scheduler's
	// ErrNoPreciseHook, ErrNoRiverTables, ErrQueueNotWorked), or the functions this build calls that
	// a schema at its migration version or later does not have (found by CheckSchema, or by a call
	// that did not find one: Fix is then not migrations.Up, which would find nothing to do, but "deploy
	// a newer build of txlimit" when a newer txlimit migrated the schema, or "roll back to migration
	// version 1 and run migrations.Up again" when it is at this build's version). Defaults to nil:
	// txlimit's schema is missing (Err says what Postgres did not find) or behind (Version and Want).
	Problem error
	// Fix is what to do: for txlimit's schema the call that creates the missing objects, for package
	// scheduler a sentence. Defaults to "" (read as "migrations.Up").
	Fix string
	// Queue is the queue no River client works (scheduler.ErrQueueNotWorked). Defaults to "".
	Queue string
	// SearchPath is the connection's search_path, read after the failure; empty when it could not be
	// read (inside a transaction the failure has aborted) or does not matter. Defaults to "".
	SearchPath string
	// Version is the migration version found in the schema and Want the version this build needs
	// (migrations.Latest()), when the error comes from CheckSchema or names a newer build; both 0
	// otherwise.
	Version, Want int64
	// Err is the database's error (a *pgconn.PgError, reachable with errors.As), or nil when the
	// schema is merely behind or the mistake is not the database's. Defaults to nil.
	Err error
}

// Error leads with the fix, then says what is wrong. For txlimit's schema: the call that creates
// the missing objects, then what Postgres did not find and where it looked (the object without its
// argument types, and the SQLSTATE); Postgres's own message stays available through Unwrap. A
// forgotten migration, on search_path "app":
//
//	ratelimit: Limit: run migrations.Up(ctx, pool) at start-up with this search_path (adding migrations.CreateSchema() if its schema does not exist yet), or set search_path to the schema it ran in: function txlimit_clock does not exist in search_path "app" (SQLSTATE 42883; see docs/deploy.md)
//
// For package scheduler's problems: "scheduler: <Op>: <Fix> (<Problem>)", then the database's
// error, if any.
func (e *SetupError) Error() string {
	pkg := e.Package
	if pkg == "" {
		pkg = "ratelimit"
	}
	if e.Problem != nil {
		s := fmt.Sprintf("%s: %s: %s (%s", pkg, e.Op, e.Fix, strings.TrimPrefix(e.Problem.Error(), pkg+": "))
		if e.Queue != "" {
			s += fmt.Sprintf(" %q", e.Queue)
		}
		if e.SearchPath != "" {
			s += fmt.Sprintf("; the connection's search_path is %q", e.SearchPath)
		}
		s += ")"
		var pgErr *pgconn.PgError
		switch {
		case (e.Fix == newerBuild || e.Fix == reapply) && errors.As(e.Err, &pgErr): // Problem says what is missing, without argument types
			s += " (SQLSTATE " + pgErr.Code + "; see docs/deploy.md)"
		case e.Err != nil:
			s += ": " + e.Err.Error()
		}
		return s
	}
	fix := e.Fix
	if fix == "" {
		fix = "migrations.Up"
	}
	where := fmt.Sprintf("search_path %q", e.SearchPath)
	if e.Err != nil && e.SearchPath == "" {
		where = "this connection's search_path"
	}
	if e.Err == nil {
		return fmt.Sprintf("%s: %s: run %s(ctx, pool) at start-up with this search_path: %s leads to a schema at migration version %d, this build of txlimit needs %d (see docs/deploy.md)",
			pkg, e.Op, fix, where, e.Version, e.Want)
	}
	missing, code := "txlimit's tables and functions do not exist", ""
	var pgErr *pgconn.PgError
	if errors.As(e.Err, &pgErr) {
		missing, code = shortMissing(pgErr.Message), "SQLSTATE "+pgErr.Code+"; "
	}
	aborted := ""
	if e.SearchPath == "" {
		aborted = "the transaction is aborted, so the search_path could not be read: run SHOW search_path on that connection; "
	}
	return fmt.Sprintf("%s: %s: run %s(ctx, pool) at start-up with this search_path (adding migrations.CreateSchema() if its schema does not exist yet), or set search_path to the schema it ran in: %s in %s (%s%ssee docs/deploy.md)",
		pkg, e.Op, fix, missing, where, code, aborted)
}

// shortMissing is Postgres's "does not exist" message without a function's argument types:
// "function txlimit_written_v1(double precision, bigint, ...) does not exist" becomes
// "function txlimit_written_v1 does not exist"; `relation "txlimit_state" does not exist` is kept.
func shortMissing(msg string) string {
	if i, j := strings.IndexByte(msg, '('), strings.LastIndexByte(msg, ')'); i >= 0 && j > i {
		return msg[:i] + msg[j+1:]
	}
	return msg
}

// Is reports whether target is ErrSetup or e.Problem.
func (e *SetupError) Is(target error) bool {
	return target == ErrSetup || (e.Problem != nil && target == e.Problem)
}

// Unwrap returns Err, the database's error.
func (e *SetupError) Unwrap() error { return e.Err }

// dbError wraps an error of op's database call. When ctx has ended, the error also wraps
// ctx.Err(), whichever driver reported it (lib/pq reports a cancelled statement as SQLSTATE 57014
// alone). A missing txlimit table or function becomes a *SetupError, at the price of one or two
// more queries on db: for a missing function, the schema's migration version (a newer txlimit's
// schema needs a newer build, not migrations.Up), then, unless that answered, the search_path;
// anything else is returned as "ratelimit: op: err".
func dbError(ctx context.Context, db Executor, op string, err error) error {
	var arg *ArgumentError
	if errors.As(err, &arg) { // refused before any SQL ran (LimiterConfig.Now): no database error
		return err
	}
	if ce := ctx.Err(); ce != nil && !errors.Is(err, ce) {
		return fmt.Errorf("ratelimit: %s: %w: %w", op, ce, err)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != "42P01" && pgErr.Code != "42883") ||
		!strings.Contains(pgErr.Message, "txlimit_") {
		return fmt.Errorf("ratelimit: %s: %w", op, err)
	}
	if pgErr.Code == "42883" {
		// A function gone from a schema that a newer txlimit migrated (it drops a function's old
		// version a release after the new one): migrations.Up would find nothing to do there.
		row, verr := via(on(db), ctx, struct{}{}, schemaVersion, otherSchemaVersion)
		if verr == nil && row.Version >= migrations.Latest() {
			se := missingFunctions(row.Version, row.SearchPath, row.Missing, pgErr)
			se.Op, se.Err = op, err
			return se
		}
	}
	searchPath, _ := via(on(db), ctx, struct{}{}, searchPath, otherSearchPath) // fails in an aborted transaction: left empty
	return &SetupError{Package: "ratelimit", Op: op, Fix: "migrations.Up", SearchPath: searchPath, Err: err}
}

// The Fix of a schema at this build's migration version or later without a function this build
// calls: newerBuild when a newer txlimit migrated it (and dropped the function a release after
// its new version), reapply when it is at this build's own version (migrated by a build whose
// migrations differed, or the function was dropped), which neither a newer build nor
// migrations.Up (nothing to do) restores.
const (
	newerBuild = "deploy a newer build of txlimit"
	reapply    = "roll back to migration version 1 and run migrations.Up again"
)

// missingFunctions is the *SetupError of a schema at migration version, this build's or later,
// without the functions missing that this build calls (or, when the list is empty, the one pgErr
// names).
func missingFunctions(version int64, searchPath string, missing []string, pgErr *pgconn.PgError) *SetupError {
	names := strings.Join(missing, ", ")
	if names == "" && pgErr != nil {
		names = strings.TrimSuffix(strings.TrimPrefix(shortMissing(pgErr.Message), "function "), " does not exist")
	}
	want := migrations.Latest()
	se := &SetupError{Package: "ratelimit", Op: "CheckSchema", Fix: newerBuild, SearchPath: searchPath, Version: version, Want: want}
	if version > want {
		se.Problem = fmt.Errorf("the schema, at migration version %d, has no function %s, which this build (version %d) calls: "+
			"a newer txlimit migrated it and dropped what this build needs", version, names, want)
		return se
	}
	se.Fix = reapply
	se.Problem = fmt.Errorf("the schema, at this build's migration version %d, has no function %s, which this build calls: "+
		"another build's migrations made it (they change in place until txlimit's first release), or the function was dropped; "+
		"version 1 keeps txlimit_state", version, names)
	return se
}

// CheckSchema verifies, in one query, that the schema db's search_path leads to holds txlimit's
// tables at the migration version this build needs (migrations.Latest(), or later: code keeps
// working on a schema migrated by a newer txlimit) and every txlimit function this build calls (a
// schema migrated two releases ahead may have dropped one: CONTRIBUTING.md; see SetupError.Problem
// for one at this build's version). Call it once at
// start-up, after migrating: it returns nil, a *SetupError (errors.Is(err, ErrSetup)) naming the fix
// and the search_path, or the database error.
func CheckSchema(ctx context.Context, db Executor) error {
	const op = "CheckSchema"
	if err := checkExecutor(op, db); err != nil {
		return err
	}
	row, err := via(on(db), ctx, struct{}{}, schemaVersion, otherSchemaVersion)
	if err != nil {
		return dbError(ctx, db, op, err)
	}
	if want := migrations.Latest(); row.Version < want {
		return &SetupError{Package: "ratelimit", Op: op, Fix: "migrations.Up", SearchPath: row.SearchPath, Version: row.Version, Want: want}
	}
	if len(row.Missing) > 0 {
		return missingFunctions(row.Version, row.SearchPath, row.Missing, nil)
	}
	return nil
}
