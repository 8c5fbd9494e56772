package scheduler

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/ratelimit"
)

// Config configures a Scheduler. A nil *Config is the zero value.
type Config struct {
	// AllowImprecise accepts reserved jobs that River inserted as scheduled, which happens when the
	// client lacks PreciseHook: River's scheduler then starts them up to ~5 s after their time.
	// Defaults to false: ReserveTx returns an error saying to install PreciseHook, so that the
	// mistake shows on the first call rather than as lateness in production.
	AllowImprecise bool

	// Queues are the River queues some River client works (the keys of river.Config.Queues of
	// your workers, which River does not let other packages read; each a name River accepts, or
	// New returns an *ratelimit.ArgumentError): ReserveTx and ReserveManyTx
	// insert reserved jobs into these only. A job headed for another queue (its InsertOpts.Queue,
	// else its args' InsertOpts().Queue, else river.QueueDefault) is refused with a *SetupError
	// (ErrQueueNotWorked) before anything is reserved, with no query. Set it in a process whose
	// client only inserts, to refuse at once what no worker would run.
	//
	// Defaults to nil: River's queue table decides, in the caller's transaction. River's clients
	// write each queue they work there when they start and every 10 minutes after, and River deletes
	// a queue 24 h after its last report; a queue found there is trusted for a minute. A table that
	// lists no queue at all (no client has worked one on this database yet, e.g. before the first
	// worker starts) refuses nothing: the stranded check (Housekeeping) reports the jobs that then
	// wait in a queue no client works.
	Queues []string
}

// Scheduler reserves rate-limit tokens and schedules River jobs for when they are due, in the
// caller's transaction. Its only state is which queues River's queue table listed in the last
// minute (Config.Queues): it is safe for concurrent use, and one per River client is enough.
type Scheduler struct {
	client         *river.Client[pgx.Tx]
	limiter        *ratelimit.Limiter
	allowImprecise bool
	queues         []string // Config.Queues; nil: River's queue table decides
	worked         sync.Map // queue -> time.Time until which River's queue table is known to list it
}

// New returns a Scheduler that inserts jobs with client and decides limits with limiter. The
// client may be insert-only (no Queues). It should have PreciseHook among its Hooks (see
// Config.AllowImprecise), and the queue of the reserved jobs should be one a client works (see
// Config.Queues), configured with PreciseQueue.
func New(client *river.Client[pgx.Tx], limiter *ratelimit.Limiter, config *Config) (*Scheduler, error) {
	if client == nil {
		return nil, argError("New", "client", "is nil: pass the *river.Client that inserts the jobs", nil)
	}
	if limiter == nil {
		return nil, argError("New", "limiter", "is nil: pass a *ratelimit.Limiter from ratelimit.New", nil)
	}
	if config == nil {
		config = &Config{}
	}
	s := &Scheduler{client: client, limiter: limiter, allowImprecise: config.AllowImprecise}
	if len(config.Queues) > 0 {
		for i, q := range config.Queues {
			if q == "" {
				return nil, argError("New", fmt.Sprintf("Config.Queues[%d]", i), "is empty: name a queue your River clients work, e.g. river.QueueDefault", nil)
			}
			if err := checkQueueName("New", fmt.Sprintf("Config.Queues[%d]", i), q); err != nil {
				return nil, err
			}
		}
		s.queues = slices.Clone(config.Queues)
	}
	return s, nil
}

// ReserveOpts are the options of ReserveTx and ReserveManyTx. A nil *ReserveOpts is the zero value.
type ReserveOpts struct {
	// Config, when set, is used by ReserveTx instead of the limit registered under the name, as
	// ratelimit.LimitOpts.Config. ReserveManyTx takes configs in its requests and ignores it.
	// Defaults to nil: the registered config.
	Config *ratelimit.Config

	// InsertOpts are the job's River insert options. Their ScheduledAt (else that of the args' own
	// InsertOpts, as River picks it) is honoured when it is later than the reservation's, and the
	// job never moves before it. Metadata, when set, must be a JSON object; the job gets it with the
	// package's own keys written anew: "txlimit_paid" and "txlimit_reserved" are set, and
	// "txlimit_settled" and "txlimit_stranded" are dropped, so that metadata copied from another job
	// (to run it again, say) does not carry over that job's payment, reservation, settlement or
	// stranded mark, which would make the new reservation look settled and never refundable. The
	// caller's other keys are kept as they are. Defaults to nil: River's defaults and the args' own
	// InsertOpts.
	InsertOpts *river.InsertOpts

	// Jitter bounds a delay added to the RetryAt of a job that has to wait, so that jobs reserved
	// together do not all start together: the job is scheduled in [RetryAt, RetryAt+Jitter). A job
	// that runs now gets none. Defaults to 0: no jitter, the job is scheduled at RetryAt.
	Jitter time.Duration

	// JitterKey makes the jitter deterministic: JitterFor(JitterKey, Jitter), the same for every
	// reservation of that identity (a user, a tenant). Defaults to "": uniformly random.
	JitterKey string
}

// Reservation is the outcome of ReserveTx or ReserveManyTx.
type Reservation struct {
	// Duplicate reports that River skipped the insert because an equivalent job exists under the
	// job's UniqueOpts. The reserved tokens were credited back in the same transaction, and the
	// Reservation describes the existing job: Job is that job, ScheduledAt its time, RetryAt and
	// Jitter zero.
	Duplicate bool

	// Jitter is the delay added to RetryAt, in [0, ReserveOpts.Jitter). Zero when RetryAt is zero.
	Jitter time.Duration

	// Job is the job as River's insert returned it; on a duplicate, the existing job, in whatever
	// state it is. A new job is available, also when it is due in the future (PreciseHook keeps
	// its future ScheduledAt), except that it is pending when InsertOpts.Pending is set, and
	// scheduled when ScheduledAt is set but the client lacks PreciseHook (Config.AllowImprecise).
	Job *rivertype.JobRow

	// Results are the limit decisions, one per limit in request order, all granted. On a duplicate
	// they were credited back.
	Results []ratelimit.Result

	// RetryAt is when the reserved tokens will have accrued: the latest RetryAt of Results. Zero
	// when they were all there, and on a duplicate (nothing stays reserved).
	RetryAt time.Time

	// ScheduledAt is when the job was inserted to be due: the later of RetryAt plus Jitter and
	// the ScheduledAt the insert asked for (ReserveOpts.InsertOpts.ScheduledAt, else that of the
	// args' own InsertOpts). Zero when neither is set (the tokens were all there and no time was
	// asked for): the job is due at once, and Job.ScheduledAt is when it was inserted. On a
	// duplicate, the existing job's Job.ScheduledAt. Tokens given back later by the jobs ahead of
	// it (SettleTx, CancelTx) can move the job earlier, never before the time asked for.
	ScheduledAt time.Time
}

// ReserveTx reserves count tokens of the limit name for key and inserts a River job with args, both
// in tx, so that the job exists if and only if tx commits. When the tokens are there the job runs
// now; otherwise it is scheduled for the reservation's RetryAt (plus opts.Jitter) and runs then,
// without checking the limit again. The job settles its reservation with SettleTx (SettleManyTx
// for a job of ReserveManyTx) in the transaction that completes it, once its real cost is known,
// and CancelTx cancels it with a refund before it starts: both read what it reserved from the job,
// give tokens back exactly once, and pull the jobs waiting behind it forward.
//
// The job's queue must be one River's clients work (see Config.Queues): a job headed for a queue
// no client works would wait there with its tokens reserved, so it is refused with a *SetupError
// (errors.Is(err, ErrQueueNotWorked)), nothing reserved, nothing inserted, tx as it was. A queue
// name River refuses is bad input (ratelimit.ErrInvalid) instead, checked first.
//
// When the reservation would leave more than the limit's MaxReserved owed, nothing is reserved,
// no job is inserted, tx is left as it was and the error is a *ratelimit.LimitedError (errors.As)
// with the RetryAt at which the same call could succeed. Bad input is an error matching
// ratelimit.ErrInvalid (an *ratelimit.ArgumentError), also with nothing written: a nil tx or args
// (a nil pointer in the interface too, such as a nil *pgxpool.Tx), for instance; so is a job that River refuses to insert
// (arguments it cannot encode, invalid insert options) or whose values Postgres refuses (a
// negative MaxAttempts, metadata that is not UTF-8), an *ratelimit.ArgumentError wrapping
// River's or Postgres's error, a ScheduledAt or an inline Config.Start outside the years 0 to 9999
// (in UTC), and a reservation due after the year 9999 (an unbounded MaxReserved lets one wait
// up to 2^61 µs) or, by a LimiterConfig.Now before the year 0, before it: the job's JSON metadata
// holds no other time. The reservation and the job are
// written in a savepoint of tx (two more round
// trips: SAVEPOINT and RELEASE), so any failure leaves tx as it was, unless the error says to roll
// tx back (the savepoint itself could not be rolled back). Each call is a subtransaction: one
// transaction that reserves more than 64 times makes Postgres track its subtransactions in a
// slower way (a "suboverflowed" snapshot) until it ends.
func (s *Scheduler) ReserveTx(ctx context.Context, tx pgx.Tx, name, key string, count float64, args river.JobArgs, opts *ReserveOpts) (*Reservation, error) {
	var config *ratelimit.Config
	if opts != nil {
		config = opts.Config
	}
	return s.reserve(ctx, "ReserveTx", tx, []ratelimit.Request{{Name: name, Key: key, Count: count, Config: config}}, true, args, opts)
}

// ReserveManyTx is ReserveTx for several limits at once: it reserves every request (each as with
// Reserve set, whatever its Reserve field says) or none, in one round trip, and schedules the job
// for the latest RetryAt. When any limit is past its MaxReserved nothing is reserved, no job is
// inserted, and the *ratelimit.LimitedError names every such limit.
func (s *Scheduler) ReserveManyTx(ctx context.Context, tx pgx.Tx, reqs []ratelimit.Request, args river.JobArgs, opts *ReserveOpts) (*Reservation, error) {
	return s.reserve(ctx, "ReserveManyTx", tx, reqs, false, args, opts)
}

// reserve is ReserveTx (single: one request, decided by LimitN) and ReserveManyTx (LimitMany).
func (s *Scheduler) reserve(ctx context.Context, op string, tx pgx.Tx, reqs []ratelimit.Request, single bool, args river.JobArgs, opts *ReserveOpts) (*Reservation, error) {
	if opts == nil {
		opts = &ReserveOpts{}
	}
	insertOpts, err := prepare(op, tx, args, opts)
	if err != nil {
		return nil, err
	}
	queue := jobQueue(args, insertOpts)
	if err := checkQueueName(op, jobQueueArg(insertOpts), queue); err != nil {
		return nil, err
	}
	if err := s.configuredQueue(op, queue); err != nil {
		return nil, err
	}
	reqs = slices.Clone(reqs)
	credits := make([]credit, len(reqs))
	for i := range reqs {
		if c := reqs[i].Config; c != nil && !c.Start.IsZero() { // recorded with the reservation
			arg := fmt.Sprintf("reqs[%d].Config.Start", i)
			if single {
				arg = "ReserveOpts.Config.Start"
			}
			if err := checkJSONYear(op, arg, c.Start); err != nil {
				return nil, err
			}
		}
		reqs[i].Reserve = true
		credits[i] = credit{name: reqs[i].Name, key: reqs[i].Key, count: reqs[i].Count, config: reqs[i].Config}
		if credits[i].count == 0 && !single {
			credits[i].count = 1 // ratelimit.Request's default
		}
	}
	return inSavepoint(ctx, op, tx, func(tx pgx.Tx) (*Reservation, error) {
		if err := s.workedQueue(ctx, op, tx, queue); err != nil {
			return nil, err
		}
		var res ratelimit.ManyResult
		if single {
			r := reqs[0]
			var one ratelimit.Result
			one, err = s.limiter.LimitN(ctx, tx, r.Name, r.Key, r.Count, &ratelimit.LimitOpts{Config: r.Config, Reserve: true})
			res = ratelimit.ManyResult{OK: one.OK, RetryAt: one.RetryAt, Results: []ratelimit.Result{one}, Time: one.Time}
		} else {
			res, err = s.limiter.LimitMany(ctx, tx, reqs, nil)
		}
		if err == nil {
			err = res.Err() // past MaxReserved: a *LimitedError, nothing written
		}
		if err != nil {
			return nil, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		return s.schedule(ctx, op, tx, res.Results, res.RetryAt, credits, args, insertOpts, opts)
	})
}

// insertError is River's error from inserting the job.
type insertError struct{ err error }

func (e *insertError) Error() string { return "insert job: " + e.err.Error() }
func (e *insertError) Unwrap() error { return e.err }

// credit is what schedule gives back when River skips the insert as a duplicate.
type credit struct {
	name, key string
	count     float64
	config    *ratelimit.Config
}

// schedule inserts the job of a granted reservation, with what it reserved recorded in its
// metadata (reservedKey).
func (s *Scheduler) schedule(ctx context.Context, op string, tx pgx.Tx, results []ratelimit.Result, retryAt time.Time, credits []credit, args river.JobArgs, insertOpts river.InsertOpts, opts *ReserveOpts) (*Reservation, error) {
	r := &Reservation{Results: results}
	rec := reservation{NotBefore: insertOpts.ScheduledAt.UTC()}
	if insertOpts.ScheduledAt.IsZero() {
		rec.NotBefore = time.Time{}
	}
	reserved := false
	for i, res := range results {
		reserved = reserved || res.Reserved
		rec.Limits = append(rec.Limits, newReservedLimit(res, credits[i].count, credits[i].config))
	}
	if reserved {
		r.RetryAt = retryAt
		r.Jitter = jitter(opts.JitterKey, opts.Jitter)
		r.ScheduledAt = retryAt.Add(r.Jitter)
		rec.Jitter = r.Jitter
	}
	if insertOpts.ScheduledAt.After(r.ScheduledAt) {
		r.ScheduledAt = insertOpts.ScheduledAt
	}
	insertOpts.ScheduledAt = r.ScheduledAt
	for i, l := range rec.Limits { // before the year 0 only by an injected clock
		if (l.Row != nil && l.Row.TS.Year() < 0) || l.RetryAt.Year() < 0 {
			return nil, argError(op, "LimiterConfig.Now", fmt.Sprintf("read %s, so the reservation of limit %q is due before the year 0 "+
				"that the job's metadata (JSON) can hold", results[i].Time.Format(time.RFC3339), l.Name), nil)
		}
	}
	if r.ScheduledAt.UTC().Year() > 9999 { // ratelimit reserves up to about year 75,000 when unbounded
		return nil, argError(op, "count", fmt.Sprintf("reserves tokens due only at %s, after the year 9999 that the job's metadata "+
			"(JSON) can hold: reserve less, or schedule the work another way", r.ScheduledAt.Format(time.RFC3339)), nil)
	}
	md, err := withKey(insertOpts.Metadata, reservedKey, &rec)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %s: record the reservation: %w", op, err)
	}
	insertOpts.Metadata = md

	hooked := false
	ins, err := s.client.InsertTx(withHookSeen(WithPrecise(ctx), &hooked), tx, args, &insertOpts)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %s: %w", op, &insertError{err: err})
	}
	r.Job = ins.Job
	if ins.UniqueSkippedAsDuplicate {
		// The Reservation describes the existing job: nothing stays reserved for this call.
		r.Duplicate = true
		r.RetryAt, r.Jitter, r.ScheduledAt = time.Time{}, 0, ins.Job.ScheduledAt
		for _, c := range credits {
			if _, err := s.limiter.Credit(ctx, tx, c.name, c.key, c.count, &ratelimit.LimitOpts{Config: c.config}); err != nil {
				return nil, fmt.Errorf("scheduler: %s: credit back the reservation of a duplicate job: %w", op, err)
			}
		}
		return r, nil
	}
	if !hooked && !s.allowImprecise {
		// Every reservation needs the hook, also one that runs now: the next one may have to wait.
		return nil, noHookError(op)
	}
	if !r.ScheduledAt.IsZero() && ins.Job.State == rivertype.JobStateScheduled && !s.allowImprecise {
		return nil, fmt.Errorf("scheduler: %s: River inserted job %d as scheduled, so it would start up to ~5 s late: %w", op, ins.Job.ID, noHookError(op))
	}
	return r, nil
}

// prepare checks the arguments and returns the job's insert options with the payment recorded
// in its metadata, before anything is written.
func prepare(op string, tx pgx.Tx, args river.JobArgs, opts *ReserveOpts) (river.InsertOpts, error) {
	var insertOpts river.InsertOpts
	if err := nilArg(op, "tx", tx, "pass the pgx.Tx the job and the reservation belong to"); err != nil {
		return insertOpts, err
	}
	if err := nilArg(op, "args", args, "pass the job's river.JobArgs"); err != nil {
		return insertOpts, err
	}
	if opts.Jitter < 0 {
		return insertOpts, argError(op, "ReserveOpts.Jitter", fmt.Sprintf("must be >= 0, got %s", opts.Jitter), nil)
	}
	if opts.InsertOpts != nil {
		insertOpts = *opts.InsertOpts
	}
	if a, ok := args.(river.JobArgsWithInsertOpts); ok && insertOpts.ScheduledAt.IsZero() {
		// River's precedence: the args' own ScheduledAt when the call sets none. The reservation's
		// time replaces it in the insert, so it is kept here, as the earliest the job may run.
		insertOpts.ScheduledAt = a.InsertOpts().ScheduledAt
	}
	if err := checkJSONYear(op, "ReserveOpts.InsertOpts.ScheduledAt", insertOpts.ScheduledAt); err != nil {
		return insertOpts, err
	}
	md, err := withPaid(insertOpts.Metadata)
	if err != nil {
		return insertOpts, argError(op, "ReserveOpts.InsertOpts.Metadata", err.Error(), nil)
	}
	insertOpts.Metadata = md
	return insertOpts, nil
}

// checkJSONYear returns the *ratelimit.ArgumentError of op's argument arg, a time the job's
// metadata records, when t lies outside the years 0 to 9999 that JSON can hold. The year is
// that of t in UTC, as the metadata records it: the year in the time's own zone may differ.
func checkJSONYear(op, arg string, t time.Time) error {
	if y := t.UTC().Year(); y < 0 || y > 9999 {
		return argError(op, arg, fmt.Sprintf("is %s, outside the years 0 to 9999 that the job's metadata (JSON) can hold",
			t.UTC().Format(time.RFC3339)), nil)
	}
	return nil
}
