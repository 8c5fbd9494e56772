package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/internal/countbound"
	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// Settlement is what a job needs to settle its reservation once the real cost is known: put it in
// the job's args (it marshals to {"name", "key", "reserved"}), with the values passed to
// ReserveTx, and call Settle from the worker. Jobs inserted by ReserveTx or ReserveManyTx need
// none: Scheduler.SettleTx reads what they reserved from the job and settles exactly once.
//
//	type CompletionArgs struct {
//		Prompt string               `json:"prompt"`
//		Budget scheduler.Settlement `json:"budget"`
//	}
type Settlement struct {
	// Name is the limit's name. Required: an empty name is an *ratelimit.ArgumentError.
	Name string `json:"name"`
	// Key is the limit's key. Defaults to "", the global instance.
	Key string `json:"key,omitempty"`
	// Reserved is the count of tokens reserved. Defaults to 0: nothing was reserved, so Settle
	// charges the whole actual cost.
	Reserved float64 `json:"reserved"`
}

// Settle makes the limit reflect actual, the real cost of the work that reserved s.Reserved
// tokens. When actual is less, the difference is credited back (ratelimit.Limiter.Credit). When it
// is more, the overrun is charged as a reservation (LimitN with Reserve) that is never denied: the
// work has been done, so its cost is booked even past MaxReserved, and later reservations wait for
// it to be repaid. Equal costs write nothing, and so do costs that differ by less than 10^-9
// tokens (float rounding), the smallest count package ratelimit takes. actual and s.Reserved must
// be finite, >= 0 and at most 10^15, the largest count it takes. opts.Config, when
// set, is used instead of the limit registered under the name (pass the same one as to ReserveTx);
// a nil opts is the registered config; opts.Reserve or opts.AsError is an *ratelimit.ArgumentError.
// The result says what was charged or credited.
//
// Settle records nothing, so a second call credits or charges again: for a job inserted by
// ReserveTx or ReserveManyTx, prefer Scheduler.SettleTx, which settles each job exactly once and
// pulls waiting jobs forward. Otherwise settle once per job, in the transaction that completes it
// (river.JobCompleteTx).
func (s Settlement) Settle(ctx context.Context, db ratelimit.Executor, l *ratelimit.Limiter, actual float64, opts *ratelimit.LimitOpts) (SettledLimit, error) {
	const op = "Settle"
	if l == nil {
		return SettledLimit{}, argError(op, "limiter", "is nil: pass the *ratelimit.Limiter the tokens were reserved with", nil)
	}
	if err := checkActual(op, "actual", actual); err != nil {
		return SettledLimit{}, err
	}
	if err := checkActual(op, "Settlement.Reserved", s.Reserved); err != nil {
		return SettledLimit{}, err
	}
	if opts == nil {
		opts = &ratelimit.LimitOpts{}
	}
	if opts.Reserve || opts.AsError {
		return SettledLimit{}, argError(op, "opts", "sets Reserve or AsError: Settle reads only opts.Config", nil)
	}
	if err := nilArg(op, "db", db, "pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn"); err != nil {
		return SettledLimit{}, err
	}
	// Refuse a bad name, key or config even when there is nothing to settle.
	cfg, err := l.Lookup(s.Name, s.Key, opts.Config)
	if err != nil {
		return SettledLimit{}, fmt.Errorf("scheduler: %s: %w", op, err)
	}
	out := SettledLimit{Name: s.Name, Key: s.Key, Reserved: s.Reserved, Actual: actual}
	switch diff := settleDiff(actual, s.Reserved); {
	case diff < 0:
		res, err := l.Credit(ctx, db, s.Name, s.Key, -diff, opts)
		if err != nil {
			return SettledLimit{}, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		out.Credited = res.Credited
	case diff > 0:
		if err := charge(ctx, db, l, s.Name, s.Key, diff, cfg); err != nil {
			return SettledLimit{}, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		out.Charged = diff
	}
	return out, nil
}

// charge books count tokens of (name, key), whose config is cfg, as a reservation that
// MaxReserved cannot deny. It tries the config as it is first (one round trip); only when that is
// denied, or count exceeds what it could ever grant, does it charge again with MaxReserved lifted.
func charge(ctx context.Context, db ratelimit.Executor, l *ratelimit.Limiter, name, key string, count float64, cfg ratelimit.Config) error {
	res, err := l.LimitN(ctx, db, name, key, count, &ratelimit.LimitOpts{Config: &cfg, Reserve: true})
	switch {
	case err == nil && res.OK:
		return nil
	case err != nil && !errors.Is(err, ratelimit.ErrInvalid):
		return err
	}
	unbounded := cfg
	unbounded.MaxReserved = ratelimit.Unbounded
	res, err = l.LimitN(ctx, db, name, key, count, &ratelimit.LimitOpts{Config: &unbounded, Reserve: true})
	if err == nil && !res.OK {
		err = fmt.Errorf("overrun of %g tokens of %q key %q was denied without a MaxReserved", count, name, key)
	}
	return err
}

// maxActual is the largest actual cost a settlement takes: the most any call of package ratelimit
// counts (countbound.Max, 10^15 tokens).
const maxActual = countbound.Max

// minDiff is the smallest difference between the actual cost and the reservation that a
// settlement charges or credits: the smallest count package ratelimit takes (countbound.Min,
// 10^-9 tokens). A smaller one (float rounding: 0.1 + 0.2 against 0.3) is settled as an exact cost.
const minDiff = countbound.Min

// checkActual validates an actual cost, arg naming it.
func checkActual(op, arg string, a float64) error {
	if math.IsNaN(a) || math.IsInf(a, 0) || a < 0 || a > maxActual {
		return argError(op, arg, fmt.Sprintf("must be finite, >= 0 and at most %g, got %g", float64(maxActual), a), nil)
	}
	return nil
}

// settleDiff is actual - reserved, the tokens to charge (> 0) or credit (< 0), or 0 when they
// differ by less than minDiff.
func settleDiff(actual, reserved float64) float64 {
	if d := actual - reserved; math.Abs(d) >= minDiff {
		return d
	}
	return 0
}

// SettledLimit is the settlement of one limit: of a job (SettleTx, CancelTx) or of a Settlement
// (Settle).
type SettledLimit struct {
	// Name and Key identify the limit.
	Name string `json:"name"`
	Key  string `json:"key"`
	// Reserved is what the job reserved; Actual what it used.
	Reserved float64 `json:"reserved"`
	Actual   float64 `json:"actual"`
	// Charged is the overrun charged: Actual - Reserved when positive, else 0.
	Charged float64 `json:"charged"`
	// Credited is what was given back: Reserved - Actual when positive, less where the limit was
	// too full to take it all, else 0.
	Credited float64 `json:"credited"`
}

// JobSettlement is the outcome of SettleTx, SettleManyTx and CancelTx.
type JobSettlement struct {
	// JobID is the settled job.
	JobID int64 `json:"job_id"`
	// Job is the cancelled job, as River's JobCancelTx returned it, when CancelTx settled it in
	// this call. Defaults to nil.
	Job *rivertype.JobRow `json:"-"`
	// Limits are the limits settled, in the order the job reserved them.
	Limits []SettledLimit `json:"limits"`
	// PulledForward is how many waiting jobs the credits moved earlier (see docs/scheduler.md).
	PulledForward int `json:"pulled_forward"`
	// Cancelled reports that the settlement was CancelTx's refund: nothing used.
	Cancelled bool `json:"cancelled,omitempty"`
	// Repeated reports that the job had been settled already: this call changed nothing and the
	// other fields are the first settlement's outcome.
	Repeated bool `json:"-"`
}

// SettleTx settles, in tx, the reservation of a job that ReserveTx inserted, with actual, the
// tokens the work really used: it credits back what was not used, or charges the overrun as a
// reservation that MaxReserved cannot deny (the work is done). Credited tokens pull the jobs
// waiting on the limit forward, in the same tx (see CancelTx).
//
// The settlement is recorded in the job's metadata ("txlimit_settled") in the same tx as its credit
// or charge, so it happens exactly once per job: a second SettleTx of the job, after the first
// committed, changes nothing and returns the first outcome with Repeated set; one racing with it
// waits for it (the job's row lock), then does the same. So a retried job, a worker that crashed
// after settling, or two processes settling at once cannot credit twice. Call it from the worker,
// ideally in the transaction that completes the job (river.JobCompleteTx). Settling a job no
// attempt of which has started (one River cancelled or discarded before it ran: refund it with 0
// used) also removes its payment for its first attempt ("txlimit_paid"), as CancelTx does: should
// River bring it back (JobRetry), a Gate over its kind makes it pay. A job still waiting to run is
// not stopped by SettleTx: settled with 0 used, it would then run with its tokens given back
// (unless a Gate over its kind makes it pay); CancelTx is the call that refunds it and keeps it
// from running.
//
// actual must be finite, >= 0 and at most 10^15 (a difference from the reservation under 10^-9
// tokens is settled as none, as by Settlement.Settle), and tx not nil (nor a nil pointer such as a nil *pgxpool.Tx):
// else the error is an *ratelimit.ArgumentError. A job that does not exist is an error matching
// rivertype.ErrNotFound; one without a recorded reservation matches ErrNotReserved; a job of
// ReserveManyTx needs SettleManyTx. The call works in a savepoint of tx: any error leaves tx as it
// was, unless it says to roll tx back.
func (s *Scheduler) SettleTx(ctx context.Context, tx pgx.Tx, jobID int64, actual float64) (*JobSettlement, error) {
	return s.settle(ctx, "SettleTx", tx, jobID, []float64{actual})
}

// SettleManyTx is SettleTx for a job of ReserveManyTx: actual has the tokens used of each limit,
// in the order of its requests (one per request).
func (s *Scheduler) SettleManyTx(ctx context.Context, tx pgx.Tx, jobID int64, actual []float64) (*JobSettlement, error) {
	return s.settle(ctx, "SettleManyTx", tx, jobID, actual)
}

func (s *Scheduler) settle(ctx context.Context, op string, tx pgx.Tx, jobID int64, actual []float64) (*JobSettlement, error) {
	if err := nilArg(op, "tx", tx, "pass the pgx.Tx to settle in"); err != nil {
		return nil, err
	}
	for i, a := range actual {
		if err := checkActual(op, fmt.Sprintf("actual[%d]", i), a); err != nil {
			return nil, err
		}
	}
	return inSavepoint(ctx, op, tx, func(sp pgx.Tx) (*JobSettlement, error) {
		q := schedsql.New()
		claimed, err := q.ClaimSettlement(ctx, sp, schedsql.ClaimSettlementParams{ID: jobID, Claim: `{"claimed": true}`})
		if err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		if len(claimed) == 0 { // settled already, or no such job
			prev, err := q.Settlement(ctx, sp, jobID)
			if err != nil {
				return nil, fmt.Errorf("scheduler: %s: %w", op, err)
			}
			if len(prev) == 0 {
				return nil, fmt.Errorf("scheduler: %s: job %d: %w", op, jobID, rivertype.ErrNotFound)
			}
			var out JobSettlement
			if err := json.Unmarshal(prev[0], &out); err != nil || out.JobID != jobID {
				return nil, fmt.Errorf("scheduler: %s: job %d has an unreadable settlement (metadata key %q): %s", op, jobID, settledKey, prev[0])
			}
			out.Repeated = true
			return &out, nil
		}
		var rec reservation
		if err := json.Unmarshal(claimed[0], &rec); err != nil || len(rec.Limits) == 0 {
			return nil, &notReservedError{op: op, jobID: jobID}
		}
		if len(actual) != len(rec.Limits) {
			reason := fmt.Sprintf("has %d values, the job reserved %d limits", len(actual), len(rec.Limits))
			if len(actual) == 1 {
				reason += ": use SettleManyTx"
			}
			return nil, argError(op, "actual", reason, nil)
		}
		out := &JobSettlement{JobID: jobID, Limits: make([]SettledLimit, len(rec.Limits))}
		amounts := make([]float64, len(rec.Limits))
		for i, l := range rec.Limits {
			amounts[i] = -settleDiff(actual[i], l.Count)
			out.Limits[i] = SettledLimit{Name: l.Name, Key: l.Key, Reserved: l.Count, Actual: actual[i], Charged: max(-amounts[i], 0)}
		}
		credited, n, err := s.give(ctx, sp, jobID, rec.Limits, amounts)
		if err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		for i := range out.Limits {
			out.Limits[i].Credited = credited[i]
		}
		out.PulledForward = n
		b, err := json.Marshal(out)
		if err != nil {
			return nil, err
		}
		if err := q.RecordSettlement(ctx, sp, schedsql.RecordSettlementParams{ID: jobID, Outcome: string(b)}); err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		return out, nil
	})
}
