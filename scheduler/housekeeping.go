package scheduler

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/riverqueue/river"
	"go.opentelemetry.io/otel/metric"

	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// HousekeepingConfig configures Housekeeping. A nil *HousekeepingConfig is the zero value.
type HousekeepingConfig struct {
	// Logger receives the jobs' lines: the rows each prune deleted per limit (Info), and a warning
	// per queue with jobs found stranded, with the fix. Defaults to nil: slog.Default().
	Logger *slog.Logger

	// MeterProvider provides the meter (named "github.com/txlimit/txlimit/scheduler", the package's
	// path) of the counter txlimit.scheduler.stranded: the reserved jobs the stranded check found not
	// started more than StrandedAfter past their time, or ended by River before they started without
	// their refund, each stranding once, by queue (attribute txlimit.queue).
	// An increase means tokens reserved for work that is not running: alert on it. Defaults to nil:
	// the global one, otel.GetMeterProvider() (a no-op until the application sets one with
	// otel.SetMeterProvider).
	MeterProvider metric.MeterProvider

	// PruneBatchSize is how many rows each round of the prune reads and deletes, as
	// ratelimit.PruneOpts.BatchSize. Must not be negative. Defaults to 0: Prune's default, 1000.
	PruneBatchSize int

	// PruneInterval is the time between two prune jobs. Pruning only keeps txlimit_state small (a
	// limit that refilled is the same as a missing row), so it trades table size against work,
	// never correctness. Must be 0 or at least one second (each run is unique per interval, and
	// River refuses a shorter unique period). Defaults to one hour.
	PruneInterval time.Duration

	// PruneTimeout bounds one run of the prune job, as river.Worker's Timeout. Must not be
	// negative. Defaults to 0: the client's JobTimeout (River's default is one minute).
	PruneTimeout time.Duration

	// Queue is the River queue both jobs are inserted in; a client must work it, or they never
	// run. A name River refuses is an *ratelimit.ArgumentError. Defaults to river.QueueDefault.
	Queue string

	// RunOnStart inserts both jobs as soon as the client is elected leader, besides every interval,
	// as river.PeriodicJobOpts.RunOnStart. Defaults to false.
	RunOnStart bool

	// StrandedAfter is how long past its scheduled time a reserved job that has not started counts
	// as stranded. A PreciseQueue starts a reserved job within about 60 ms of its time, so the
	// default leaves room for workers that are busy. Must not be negative. Defaults to 5 minutes.
	StrandedAfter time.Duration

	// StrandedInterval is the time between two stranded checks. Must be 0 or at least one second,
	// as PruneInterval. Defaults to one minute.
	StrandedInterval time.Duration
}

// withDefaults validates c and applies the defaults.
func (c *HousekeepingConfig) withDefaults(op string) (HousekeepingConfig, error) {
	var out HousekeepingConfig
	if c != nil {
		out = *c
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{{"PruneInterval", out.PruneInterval}, {"PruneTimeout", out.PruneTimeout}, {"StrandedAfter", out.StrandedAfter}, {"StrandedInterval", out.StrandedInterval}} {
		if d.v < 0 {
			return out, argError(op, "HousekeepingConfig."+d.field, fmt.Sprintf("must not be negative, got %s", d.v), nil)
		}
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{{"PruneInterval", out.PruneInterval}, {"StrandedInterval", out.StrandedInterval}} {
		if d.v > 0 && d.v < time.Second { // each job is unique per interval (periodicJob)
			return out, argError(op, "HousekeepingConfig."+d.field, fmt.Sprintf("must be 0 (the default) or at least 1s, "+
				"the shortest unique period River takes, got %s", d.v), nil)
		}
	}
	if out.PruneBatchSize < 0 {
		return out, argError(op, "HousekeepingConfig.PruneBatchSize", fmt.Sprintf("must not be negative, got %d", out.PruneBatchSize), nil)
	}
	if out.PruneInterval == 0 {
		out.PruneInterval = time.Hour
	}
	if out.StrandedAfter == 0 {
		out.StrandedAfter = 5 * time.Minute
	}
	if out.StrandedInterval == 0 {
		out.StrandedInterval = time.Minute
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.Queue == "" {
		out.Queue = river.QueueDefault
	} else if err := checkQueueName(op, "HousekeepingConfig.Queue", out.Queue); err != nil {
		return out, err
	}
	return out, nil
}

// Housekeeping adds to workers the workers of txlimit's two periodic jobs, and returns the jobs
// for river.Config.PeriodicJobs:
//
//   - The prune job (kind and ID "txlimit_prune", every PruneInterval) runs Limiter.PruneAll of
//     limiter through db (a pool: pruning works in short rounds of its own, not inside the job's
//     transaction), records the rows deleted per limit and their total as the job's output
//     ({"deleted": {...}, "total": n}) and logs them.
//   - The stranded check (kind and ID "txlimit_stranded", every StrandedInterval) finds, in one
//     statement through db, the reserved jobs (ReserveTx, ReserveManyTx) not settled that have not
//     started StrandedAfter past their time (waiting to run, or pending), or that River cancelled
//     or discarded before they started, StrandedAfter ago, without the refund (River's own
//     JobCancel; a unique conflict discarded by River's scheduler: refund them with SettleTx and 0
//     used). Such a job holds its tokens until it runs, settles or is cancelled; one that nothing
//     starts (its queue is one no River client works, or the workers are stopped) holds them for
//     good. The check marks each (job metadata "txlimit_stranded", {"at", "scheduled_at",
//     "state"}) so that it is counted once until it is stranded anew (in another state, or at
//     another scheduled time), counts them by queue (txlimit.scheduler.stranded),
//     logs a warning per queue with the fix, and records what it found as the job's output. At
//     most 1000 jobs are marked per run; the next runs find the rest.
//
// River's leader alone inserts periodic jobs, and each is unique per interval, so a cluster of
// clients runs each once per interval. Give every client that may be elected leader these jobs:
// while a leader without them leads, neither check runs, and nothing says so. A failed run is an error, retried by River like any job's.
// A nil workers, limiter or db, or an invalid config, is an *ratelimit.ArgumentError.
//
//	jobs, err := scheduler.Housekeeping(workers, limiter, pool, nil)
//	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
//		PeriodicJobs: jobs, Workers: workers, ...})
func Housekeeping(workers *river.Workers, limiter *ratelimit.Limiter, db ratelimit.Executor, config *HousekeepingConfig) ([]*river.PeriodicJob, error) {
	const op = "Housekeeping"
	switch {
	case workers == nil:
		return nil, argError(op, "workers", "is nil: pass the *river.Workers of the client that works HousekeepingConfig.Queue", nil)
	case limiter == nil:
		return nil, argError(op, "limiter", "is nil: pass the *ratelimit.Limiter whose limits to prune", nil)
	}
	if err := nilArg(op, "db", db, "pass the *pgxpool.Pool of the River client"); err != nil {
		return nil, err
	}
	pgxDB, ok := db.(schedsql.DBTX) // River's tables are read through pgx
	if !ok {
		return nil, argError(op, "db", fmt.Sprintf("is a %T: pass the *pgxpool.Pool of the River client", db), nil)
	}
	cfg, err := config.withDefaults(op)
	if err != nil {
		return nil, err
	}
	if err := river.AddWorkerSafely(workers, &pruneWorker{limiter: limiter, db: db, cfg: cfg}); err != nil {
		return nil, fmt.Errorf("scheduler: %s: %w", op, err)
	}
	if err := river.AddWorkerSafely(workers, newStrandedWorker(pgxDB, cfg)); err != nil {
		return nil, fmt.Errorf("scheduler: %s: %w", op, err)
	}
	return []*river.PeriodicJob{
		periodicJob(pruneArgs{}, cfg.PruneInterval, cfg),
		periodicJob(strandedArgs{}, cfg.StrandedInterval, cfg),
	}, nil
}

// periodicJob is the periodic job that inserts args every interval in cfg.Queue, unique per
// interval, with the args' kind as its ID.
func periodicJob(args river.JobArgs, interval time.Duration, cfg HousekeepingConfig) *river.PeriodicJob {
	return river.NewPeriodicJob(
		river.PeriodicInterval(interval),
		func() (river.JobArgs, *river.InsertOpts) {
			return args, &river.InsertOpts{Queue: cfg.Queue, UniqueOpts: river.UniqueOpts{ByPeriod: interval}}
		},
		&river.PeriodicJobOpts{ID: args.Kind(), RunOnStart: cfg.RunOnStart},
	)
}
