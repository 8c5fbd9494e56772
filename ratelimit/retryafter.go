package ratelimit

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// Row is the state of one row of a limit (docs/spec.md §1): its value and ts, e.g. as a grant left
// it (Result.Value and Result.TS of an unsharded limit).
type Row struct {
	// Name is the limit's name. Required.
	Name string
	// Key is the limit's key. Defaults to "", the global instance.
	Key string
	// Config, when set, is used instead of the limit registered under the name, as
	// LimitOpts.Config. Defaults to nil: the registered config.
	Config *Config
	// Value is the row's value: tokens, negative while reservations are owed. Defaults to 0: no
	// tokens, no debt.
	Value float64
	// TS is the row's ts. Required.
	TS time.Time
}

// OutOfDebtAt returns, for each row, the first microsecond at or after from at which the row,
// refilled by its limit's rules, holds >= 0 tokens (from itself when it does already): for the row
// a reservation left (Result.Value, Result.TS), its Result.RetryAt; with tokens credited since
// added to Value, when those credits make it due. It is computed by the SQL that computes every
// RetryAt (txlimit_retry_at), on each config resolved as a decision resolves it, so it is as exact
// and as bounded (at most from plus 2^61 µs). A sharded limit's numbers are per shard,
// so a Row there stands for one shard's row. The rows are evaluated in one statement and the
// answers come in their order; nothing is locked or written.
//
// from defaults, when zero, to the time a decision reads: LimiterConfig.Now when set, else the
// database's clock. Bad input (a name, key or config a call would refuse, a Value that is not
// finite, a zero TS, a from or TS more than 2^62 µs, about 146,000 years, from the Unix epoch, or
// a TS more than 2^62 µs from from) is an error matching ErrInvalid, with no SQL run. A zero from
// is checked as the time LimiterConfig.Now returns; the database's clock, within 2^61 µs of the
// epoch for any year before 73,000, needs no check.
func (l *Limiter) OutOfDebtAt(ctx context.Context, db Executor, from time.Time, rows []Row) ([]time.Time, error) {
	const op = "OutOfDebtAt"
	if err := checkExecutor(op, db); err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, nil
	}
	var p dbsqlc.OutOfDebtAtParams // NowUs NULL: the database's clock
	if !from.IsZero() {
		if !timeInRange(from) {
			return nil, &ArgumentError{Op: op, Arg: "from", Reason: fmt.Sprintf("must lie within 2^62 µs (about 146,000 years) of the Unix epoch, got %s", from)}
		}
		p.NowUs = pgtype.Int8{Int64: from.UnixMicro(), Valid: true}
	} else if l.now != nil {
		now := l.now()
		if !timeInRange(now) {
			return nil, &ArgumentError{Op: op, Arg: "from", Reason: fmt.Sprintf("is zero, so it is LimiterConfig.Now, which returned %s: it must lie within 2^62 µs (about 146,000 years) of the Unix epoch", now)}
		}
		p.NowUs = pgtype.Int8{Int64: now.UnixMicro(), Valid: true}
	}
	for i, r := range rows {
		s, err := l.resolve(op, r.Name, r.Key, r.Config)
		if err != nil {
			return nil, err
		}
		switch {
		case math.IsNaN(r.Value) || math.IsInf(r.Value, 0):
			return nil, &ArgumentError{Op: op, Arg: fmt.Sprintf("rows[%d].Value", i), Reason: fmt.Sprintf("must be finite, got %g", r.Value)}
		case r.TS.IsZero():
			return nil, &ArgumentError{Op: op, Arg: fmt.Sprintf("rows[%d].TS", i), Reason: "is zero: pass the row's ts (Result.TS)"}
		case !timeInRange(r.TS):
			return nil, &ArgumentError{Op: op, Arg: fmt.Sprintf("rows[%d].TS", i), Reason: fmt.Sprintf("must lie within 2^62 µs (about 146,000 years) of the Unix epoch, got %s", r.TS)}
		case p.NowUs.Valid && microsApart(r.TS.UnixMicro(), p.NowUs.Int64) > maxTimeMicros:
			return nil, &ArgumentError{Op: op, Arg: fmt.Sprintf("rows[%d].TS", i), Reason: fmt.Sprintf("must lie within 2^62 µs (about 146,000 years) of from (%s), got %s", usTime(p.NowUs.Int64), r.TS)}
		}
		p.Rates = append(p.Rates, s.rate)
		p.PeriodUs = append(p.PeriodUs, s.periodUs)
		p.StepUs = append(p.StepUs, s.stepUs)
		p.Caps = append(p.Caps, s.capacity)
		p.Values = append(p.Values, r.Value)
		p.TsUs = append(p.TsUs, r.TS.UnixMicro())
	}
	got, err := via(on(db), ctx, p, (*dbsqlc.Queries).OutOfDebtAt, driver.Executor.OutOfDebtAt)
	if err != nil {
		return nil, dbError(ctx, db, op, err)
	}
	if len(got) != len(rows) {
		return nil, fmt.Errorf("ratelimit: %s: got %d answers for %d rows", op, len(got), len(rows))
	}
	out := make([]time.Time, len(rows))
	for i, g := range got {
		if int(g.I) != i+1 {
			return nil, fmt.Errorf("ratelimit: %s: answer %d is for row %d", op, i+1, g.I)
		}
		out[i] = usTime(g.RetryAtUs)
	}
	return out, nil
}

// maxTimeMicros bounds the times OutOfDebtAt accepts, in microseconds either side of the Unix
// epoch, and how far a row's ts may lie from from: far enough for any row's ts, near enough that
// the search's arithmetic stays within a bigint. It computes from + 2^61 µs (its bound), steps of
// up to 2^61 µs from an instant before that bound, ts − from, and t − ts for every instant t it
// tests, from from to from + 2^61 µs; with from and ts within 2^62 µs of the epoch and of each
// other, each is at most 2^63 − 1 in magnitude.
const maxTimeMicros = 1 << 62

// microsApart is |a − b|, which does not fit an int64 when a and b lie 2^63 µs or more apart.
func microsApart(a, b int64) uint64 {
	if a >= b {
		return uint64(a) - uint64(b)
	}
	return uint64(b) - uint64(a)
}

// timeInRange reports whether t lies within maxTimeMicros of the Unix epoch (checked on the
// time.Time: UnixMicro wraps beyond about 292,000 years).
func timeInRange(t time.Time) bool {
	return !t.Before(time.UnixMicro(-maxTimeMicros)) && !t.After(time.UnixMicro(maxTimeMicros))
}
