package scheduler

import (
	"context"
	"fmt"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/ratelimit"
)

// maxSnooze is the longest single snooze a Gate asks for. River stores a snooze of up to its
// scheduler interval (5 s) as available with a future scheduled_at, so a PreciseQueue fetches the
// job on time; a longer snooze would be stored as scheduled and promoted up to 5 s late. A longer
// wait is therefore split into snoozes of at most maxSnooze; each wake-up of a job whose tokens are
// already paid for, or that waits out a denial's jitter, only snoozes again.
const maxSnooze = 4500 * time.Millisecond

// GateRequest names the limit a job pays to run.
type GateRequest struct {
	// Config, when set, is used instead of the limit registered under Name. Defaults to nil: the
	// registered config.
	Config *ratelimit.Config

	// Count is the number of tokens the job takes. Must be finite and > 0 when set. Defaults to 1.
	Count float64

	// JitterKey makes the jitter of the job's snoozes deterministic (JitterFor). Defaults to "":
	// uniformly random.
	JitterKey string

	// Key is the limit's key, e.g. the tenant the job works for. Defaults to "", the global
	// instance.
	Key string

	// Name is the limit's name. Required.
	Name string
}

// GateConfig configures a Gate.
type GateConfig struct {
	// DB runs the Gate's limit decisions, each a round trip of its own outside any job's
	// transaction: usually the *pgxpool.Pool of the River client. Required.
	DB ratelimit.Executor

	// Jitter bounds a delay added to a denied job's snooze, in [0, Jitter), so that jobs denied
	// together do not all come back together. Reserved jobs do not need it: their RetryAts are
	// already spread at the limit's rate. Defaults to 0: no jitter.
	Jitter time.Duration

	// Limit maps a job to the limit it pays before it runs; false lets the job run without one.
	// It is called for every job the middleware sees, so it should be quick, e.g. a switch on
	// job.Kind. Required.
	Limit func(job *rivertype.JobRow) (GateRequest, bool)

	// Limiter decides the limits. Required.
	Limiter *ratelimit.Limiter
}

// Gate is a River worker middleware that makes jobs pay a rate limit before they run. Install it
// in river.Config.Middleware (it applies to the jobs GateConfig.Limit selects), or return it from
// a worker's Middleware method for one kind.
//
// When the job's tokens are there, it takes them and runs the job. When they are not, it reserves
// them (ratelimit.LimitOpts.Reserve), records the payment in the job's metadata ("txlimit_paid") and
// snoozes the job until they are due; when the job comes back it runs without paying again. So
// jobs start at the limit's rate, each one once, in the order they asked. When the reservation
// would go past the limit's MaxReserved nothing is taken and the job is snoozed until the RetryAt
// of the denial plus its jitter (GateConfig.Jitter), then tries again: both times are recorded with
// the job's payments; until one snooze before the RetryAt it asks again at every wake-up (the
// limit may have been credited or changed: it then runs), from then on it waits for the jitter,
// so that a wait longer than one snooze keeps its jitter.
//
// River does not count a snooze as an attempt: it stores attempt-1, and the next fetch brings the
// attempt number back to where it was, so a job can wait on a limit indefinitely without being
// discarded; only its metadata's "snoozes" counter grows. A payment is good for the attempt that
// made it: if the job then fails, its retry pays again. The Gate clears its payment when it lets
// the job through, so a job that runs, fails, or is snoozed by its worker pays again next time.
// A job that is cancelled or deleted while it waits does not give its tokens back (the limit errs
// on the side of granting less). A database error from the decision fails the attempt (River
// retries it later); it never lets the job through.
//
// A Gate's payment is for its own limit (name and key): a job behind two Gates (one in
// river.Config.Middleware, one of its worker) pays each, once. The job's payments are recorded
// side by side, and when a Gate further in snoozes the job, the payments of the Gates it passed
// stay recorded (also for tokens they took at once), so the job comes back paid for those. Jobs
// inserted by Scheduler.ReserveTx carry a payment for their first attempt that stands for
// whatever they reserved, so every Gate over their kind lets that attempt through: gate such jobs
// only by the limits they reserve.
type Gate struct {
	river.MiddlewareDefaults

	db      ratelimit.Executor
	jitter  time.Duration
	limit   func(job *rivertype.JobRow) (GateRequest, bool)
	limiter *ratelimit.Limiter
	now     func() time.Time // tests replace it
}

var _ rivertype.WorkerMiddleware = (*Gate)(nil)

// NewGate returns a Gate. It returns an error naming the first missing field of config.
func NewGate(config *GateConfig) (*Gate, error) {
	if config == nil {
		return nil, argError("NewGate", "config", "is nil: set DB, Limit and Limiter", nil)
	}
	if err := nilArg("NewGate", "GateConfig.DB", config.DB, "set it to the *pgxpool.Pool of the River client"); err != nil {
		return nil, err
	}
	switch {
	case config.Limit == nil:
		return nil, argError("NewGate", "GateConfig.Limit", "is nil: set it to a func that maps a job to its limit", nil)
	case config.Limiter == nil:
		return nil, argError("NewGate", "GateConfig.Limiter", "is nil: set it to a *ratelimit.Limiter", nil)
	case config.Jitter < 0:
		return nil, argError("NewGate", "GateConfig.Jitter", fmt.Sprintf("must be >= 0, got %s", config.Jitter), nil)
	}
	return &Gate{db: config.DB, jitter: config.Jitter, limit: config.Limit, limiter: config.Limiter, now: time.Now}, nil
}

// Work implements rivertype.WorkerMiddleware.
func (g *Gate) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	req, ok := g.limit(job)
	if !ok {
		return doInner(ctx)
	}
	run, ctx := gateRunOf(ctx, job)
	id := limitID{req.Name, req.Key}
	p, ok := run.paid(id)
	switch {
	case ok && p.RetryAt.IsZero():
		if wait := p.Due.Sub(g.now()); !p.Due.IsZero() && wait > 0 {
			run.snoozed = true
			return river.JobSnooze(min(wait, maxSnooze))
		}
		return g.pass(ctx, run, job, p, doInner)
	case ok: // denied: from one snooze before the denial's RetryAt (Due) to that plus its jitter
		// (RetryAt), waits for the jitter to pass; before, it asks again at every wake-up (the
		// limit may have been changed or credited meanwhile) and records the new answer. The
		// snooze of margin keeps a wake-up just after the RetryAt, by a clock a little behind the
		// one that recorded it, from asking and running without its jitter. (A denial recorded
		// without Due, by an earlier version, is asked about at once.)
		if now := g.now(); !p.Due.IsZero() && !now.Before(p.Due.Add(-maxSnooze)) && now.Before(p.RetryAt) {
			run.snoozed = true
			return river.JobSnooze(min(p.RetryAt.Sub(now), maxSnooze))
		}
	}
	count := req.Count
	if count == 0 {
		count = 1
	}
	// A limit whose MaxReserved is 0 allows no reservation: its jobs take tokens or wait.
	cfg, err := g.limiter.Lookup(req.Name, req.Key, req.Config)
	if err != nil {
		return fmt.Errorf("scheduler: Gate: job %d (%s): %w", job.ID, job.Kind, err)
	}
	asked := g.now() // no later than the database's clock reading for the answer
	res, err := g.limiter.LimitN(ctx, g.db, req.Name, req.Key, count, &ratelimit.LimitOpts{Config: req.Config, Reserve: cfg.MaxReserved != 0})
	if err != nil {
		return fmt.Errorf("scheduler: Gate: job %d (%s): %w", job.ID, job.Kind, err)
	}
	switch {
	case !res.OK: // past MaxReserved (or none allowed): nothing taken, try again when it could succeed
		// Times, not a sum of Durations: RetryAfter saturates at the largest Duration.
		// due counts from when the Gate asked, not when the answer came (a lock wait, the trip
		// back): never after the denial's own RetryAt, so that a wake-up after that RetryAt waits
		// for the jitter instead of asking again.
		due := asked.Add(res.RetryAfter())
		retryAt := due.Add(jitter(req.JitterKey, g.jitter))
		run.set(gatePayment{Name: req.Name, Key: req.Key, Attempt: job.Attempt, Due: due, RetryAt: retryAt})
		if err := run.store(ctx); err != nil {
			return fmt.Errorf("scheduler: Gate: job %d (%s): record denial: %w", job.ID, job.Kind, err)
		}
		run.snoozed = true
		return river.JobSnooze(min(max(retryAt.Sub(g.now()), time.Millisecond), maxSnooze))
	case !res.Reserved:
		return g.pass(ctx, run, job, gatePayment{Name: req.Name, Key: req.Key, Attempt: job.Attempt, Due: g.now()}, doInner)
	}
	wait := res.RetryAfter()
	run.set(gatePayment{Name: req.Name, Key: req.Key, Attempt: job.Attempt, Due: g.now().Add(wait)})
	if err := run.store(ctx); err != nil {
		return fmt.Errorf("scheduler: Gate: job %d (%s): record payment: %w", job.ID, job.Kind, err)
	}
	run.snoozed = true
	return river.JobSnooze(min(wait, maxSnooze))
}

// pass works the job, whose attempt paid p, behind the Gate. The payment is cleared first, so that
// a job that runs, fails, or is snoozed by its worker pays again next time. When a Gate inside
// this one snoozes the job instead, the payment is recorded again: the job comes back paid for
// this Gate's limit, and pays only the inner one.
func (g *Gate) pass(ctx context.Context, run *gateRun, job *rivertype.JobRow, p gatePayment, doInner func(context.Context) error) error {
	run.clear(p)
	if err := run.store(ctx); err != nil {
		return fmt.Errorf("scheduler: Gate: job %d (%s): %w", job.ID, job.Kind, err)
	}
	run.snoozed = false
	err := doInner(ctx)
	if !run.snoozed {
		return err
	}
	run.set(p)
	if serr := run.store(ctx); serr != nil { // the job did not run: a Gate inside snoozed it
		return fmt.Errorf("scheduler: Gate: job %d (%s): record payment: %w", job.ID, job.Kind, serr)
	}
	return err
}
