package scheduler

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// ErrNotCancellable matches (errors.Is) every *NotCancellableError.
var ErrNotCancellable = errors.New("scheduler: job cannot be cancelled with a refund")

// ErrNotReserved matches (errors.Is) the error of CancelTx or SettleTx on a job that ReserveTx or
// ReserveManyTx did not insert: it has no reservation recorded (job metadata "txlimit_reserved").
// It also matches ratelimit.ErrInvalid.
var ErrNotReserved = errors.New("scheduler: job has no reservation recorded by ReserveTx")

// NotCancellableError is CancelTx's answer for a job that has started, finished or was cancelled
// already: nothing was cancelled and nothing credited. It matches ErrNotCancellable (errors.Is).
type NotCancellableError struct {
	// JobID is the job.
	JobID int64
	// State is the job's River state.
	State rivertype.JobState
	// Started reports that an attempt of the job has started (it is running, or ran). A job River
	// cancelled or discarded before it started (River's own JobCancel, a unique conflict) has not:
	// unless Settled, its reservation was not refunded, and SettleTx with 0 used refunds it.
	Started bool
	// Settled reports that the job's reservation was settled already (SettleTx), so there is
	// nothing left to refund.
	Settled bool
}

func (e *NotCancellableError) Error() string {
	switch {
	case !e.Started && !e.Settled && (e.State == rivertype.JobStateCancelled || e.State == rivertype.JobStateDiscarded):
		return fmt.Sprintf("scheduler: job %d was %s by River before it started, without a refund of its reservation: "+
			"refund it with Scheduler.SettleTx(ctx, tx, %d, 0)", e.JobID, e.State, e.JobID)
	case e.Settled && e.State != rivertype.JobStateCancelled:
		return fmt.Sprintf("scheduler: job %d was settled already (state %s)", e.JobID, e.State)
	case e.State == rivertype.JobStateCancelled:
		return fmt.Sprintf("scheduler: job %d was already cancelled", e.JobID)
	case e.State == rivertype.JobStateRunning:
		return fmt.Sprintf("scheduler: job %d is running", e.JobID)
	default:
		return fmt.Sprintf("scheduler: job %d already ran (state %s)", e.JobID, e.State)
	}
}

// Is reports whether target is ErrNotCancellable.
func (e *NotCancellableError) Is(target error) bool { return target == ErrNotCancellable }

// Running reports that the job is running now.
func (e *NotCancellableError) Running() bool { return e.State == rivertype.JobStateRunning }

// Cancelled reports that the job was already cancelled.
func (e *NotCancellableError) Cancelled() bool { return e.State == rivertype.JobStateCancelled }

// notReservedError is the error of a job without a recorded reservation.
type notReservedError struct {
	op    string
	jobID int64
}

func (e *notReservedError) Error() string {
	return fmt.Sprintf("scheduler: %s: job %d has no reservation recorded by ReserveTx (metadata key %q)", e.op, e.jobID, reservedKey)
}

func (e *notReservedError) Is(target error) bool {
	return target == ErrNotReserved || target == ratelimit.ErrInvalid
}

// CancelTx cancels, in tx, a job that ReserveTx or ReserveManyTx inserted and that has not started,
// and gives back every token it reserved (Limiter.Credit of each limit, never above capacity). It
// returns the job's settlement with Cancelled set: Job is the cancelled job, and each of Limits says
// what the job reserved and what was given back (Credited: Reserved, or less where the limit was
// too full to take it all).
// Jobs waiting on those limits are then pulled forward to when their tokens accrue given the
// refund, in the same tx. The job is cancelled with River's own Client.JobCancelTx, so everything
// commits or rolls back with tx.
//
// The cancel is recorded as the job's settlement (job metadata "txlimit_settled", nothing used), so
// a later SettleTx of the job changes nothing and returns it, and the job's payment for its first
// attempt ("txlimit_paid") is removed: should River bring the job back (Client.JobRetry), it runs
// unpaid, and a Gate over its kind makes it pay like any other job. A job that is running, has run
// (completed, discarded, retryable, or snoozed after it started), was settled or was cancelled
// already is left as it is, nothing is credited, and the error is a *NotCancellableError
// (errors.Is(err, ErrNotCancellable)). A job that does not exist is an error matching
// rivertype.ErrNotFound; one without a recorded reservation matches ErrNotReserved; a nil tx (a
// nil pointer such as a nil *pgxpool.Tx too) is an *ratelimit.ArgumentError. The call works
// in a savepoint of tx: any error leaves tx as it was, unless it says to roll tx back.
// The job's row stays locked until tx ends, so that no worker starts it meanwhile.
func (s *Scheduler) CancelTx(ctx context.Context, tx pgx.Tx, jobID int64) (*JobSettlement, error) {
	const op = "CancelTx"
	if err := nilArg(op, "tx", tx, "pass the pgx.Tx to cancel in"); err != nil {
		return nil, err
	}
	return inSavepoint(ctx, op, tx, func(sp pgx.Tx) (*JobSettlement, error) {
		job, err := schedsql.New().LockJob(ctx, sp, jobID)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("scheduler: %s: job %d: %w", op, jobID, rivertype.ErrNotFound)
		}
		if err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		state := rivertype.JobState(job.State)
		switch {
		case state == rivertype.JobStateRunning || job.Attempted:
			return nil, &NotCancellableError{JobID: jobID, State: state, Started: true}
		case state != rivertype.JobStateAvailable && state != rivertype.JobStateScheduled && state != rivertype.JobStatePending:
			// Not attempted (above): finalized by River before it started, unless completed.
			return nil, &NotCancellableError{JobID: jobID, State: state, Started: state == rivertype.JobStateCompleted, Settled: job.Settled}
		case job.Settled:
			return nil, &NotCancellableError{JobID: jobID, State: state, Settled: true}
		}
		var rec reservation
		if err := json.Unmarshal(job.Reserved, &rec); err != nil || len(rec.Limits) == 0 {
			return nil, &notReservedError{op: op, jobID: jobID}
		}
		row, err := s.client.JobCancelTx(ctx, sp, jobID)
		if err != nil {
			return nil, fmt.Errorf("scheduler: %s: River: %w", op, err)
		}
		if row.State != rivertype.JobStateCancelled { // cannot happen while the row is locked
			return nil, fmt.Errorf("scheduler: %s: River left job %d %s", op, jobID, row.State)
		}
		amounts := make([]float64, len(rec.Limits))
		for i, l := range rec.Limits {
			amounts[i] = l.Count
		}
		credited, n, err := s.give(ctx, sp, jobID, rec.Limits, amounts)
		if err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		// The cancel is the job's settlement (nothing used): a later SettleTx returns it.
		out := &JobSettlement{JobID: jobID, Job: row, Cancelled: true, PulledForward: n, Limits: make([]SettledLimit, len(rec.Limits))}
		for i, l := range rec.Limits {
			out.Limits[i] = SettledLimit{Name: l.Name, Key: l.Key, Reserved: l.Count, Credited: credited[i]}
		}
		b, err := json.Marshal(out)
		if err != nil {
			return nil, err
		}
		// The refund takes back what ReserveTx's payment paid for: should River bring the job back
		// (JobRetry), it pays at its Gates like any other.
		if err := schedsql.New().RecordCancellation(ctx, sp, schedsql.RecordCancellationParams{ID: jobID, Outcome: string(b)}); err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		return out, nil
	})
}

// give credits amounts[i] tokens to limits[i], or charges -amounts[i] when it is negative (an
// overrun, booked even past MaxReserved), skipping zeros, in the global order of (name, key) so
// that concurrent calls never deadlock; then it pulls forward the jobs waiting on the credited
// limits that reserved after job jobID, whose reservation the credits come out of. It returns what each credit gave and how many jobs moved earlier.
func (s *Scheduler) give(ctx context.Context, tx pgx.Tx, jobID int64, limits []reservedLimit, amounts []float64) ([]float64, int, error) {
	order := make([]int, len(limits))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(limits[a].Name, limits[b].Name), cmp.Compare(limits[a].Key, limits[b].Key))
	})
	credited := make([]float64, len(limits))
	total := map[limitID]float64{}
	var now time.Time
	for _, i := range order {
		l := limits[i]
		if amounts[i] < 0 {
			cfg, err := s.limiter.Lookup(l.Name, l.Key, l.Config)
			if err != nil {
				return nil, 0, err
			}
			if err := charge(ctx, tx, s.limiter, l.Name, l.Key, -amounts[i], cfg); err != nil {
				return nil, 0, err
			}
			continue
		}
		if amounts[i] == 0 {
			continue
		}
		res, err := s.limiter.Credit(ctx, tx, l.Name, l.Key, amounts[i], &ratelimit.LimitOpts{Config: l.Config})
		if err != nil {
			return nil, 0, err
		}
		credited[i] = res.Credited
		total[limitID{l.Name, l.Key}] += res.Credited
		if res.Time.After(now) {
			now = res.Time
		}
	}
	n, err := s.pullForward(ctx, tx, jobID, total, now)
	if err != nil {
		return nil, 0, err
	}
	return credited, n, nil
}

// inSavepoint runs fn in a savepoint of tx, rolled back when fn fails, so that a call either
// writes everything or leaves tx as it was. A missing River table is returned as a *SetupError.
// River refusing a job without a database error (arguments it cannot encode, invalid insert
// options) is bad input: an *ratelimit.ArgumentError wrapping River's error.
func inSavepoint[T any](ctx context.Context, op string, tx pgx.Tx, fn func(sp pgx.Tx) (T, error)) (T, error) {
	var zero T
	sp, err := tx.Begin(ctx)
	if err != nil {
		return zero, fmt.Errorf("scheduler: %s: savepoint: %w", op, err)
	}
	v, err := fn(sp)
	if err == nil {
		if err := sp.Commit(ctx); err != nil {
			return zero, fmt.Errorf("scheduler: %s: release savepoint (roll tx back): %w", op, err)
		}
		return v, nil
	}
	if rbErr := sp.Rollback(ctx); rbErr != nil {
		return zero, errors.Join(err, fmt.Errorf("scheduler: %s: roll back to savepoint (roll tx back): %w", op, rbErr))
	}
	if se := missingRiverTable(ctx, op, tx, err); se != nil {
		return zero, se
	}
	var refused *insertError
	var pgErr *pgconn.PgError
	if errors.As(err, &refused) && !errors.As(refused.err, &pgErr) && ctx.Err() == nil {
		return zero, argError(op, "args or insert options", "were refused by River (nothing was reserved)", refused.err)
	}
	// Postgres refusing the job's values (a check constraint of river_job, such as a negative
	// MaxAttempts; a data exception, such as metadata that is not UTF-8) is bad input too.
	if errors.As(err, &refused) && errors.As(refused.err, &pgErr) && (pgErr.Code == "23514" || strings.HasPrefix(pgErr.Code, "22")) {
		return zero, argError(op, "args or insert options", "were refused by the database (nothing was reserved)", refused.err)
	}
	return zero, err
}
