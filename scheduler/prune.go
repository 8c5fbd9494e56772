package scheduler

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/riverqueue/river"

	"github.com/txlimit/txlimit/ratelimit"
)

// DefaultPruneInterval is how often the periodic prune job runs unless PruneConfig.Interval says
// otherwise: once an hour. Pruning only keeps txlimit_state small (a limit that refilled is the
// same as a missing row), so its interval trades table size against work, never correctness.
const DefaultPruneInterval = time.Hour

// PruneArgs are the arguments of the prune job: none, the worker holds the limiter and the
// database handle. Its kind is "txlimit_prune".
type PruneArgs struct{}

// Kind returns "txlimit_prune".
func (PruneArgs) Kind() string { return "txlimit_prune" }

// PruneOutput is what a prune job reports: recorded as the job's output (river.RecordOutput, read
// back with rivertype.JobRow.Output) and logged.
type PruneOutput struct {
	// Deleted is the number of rows deleted per registered limit, as Limiter.PruneAll returns it.
	Deleted map[string]int64 `json:"deleted"`
	// Total is the sum of Deleted.
	Total int64 `json:"total"`
}

// PruneConfig configures NewPruneWorker and PrunePeriodicJob. A nil *PruneConfig is the zero value.
type PruneConfig struct {
	// Interval is the time between two prune jobs. Must not be negative. Defaults to
	// DefaultPruneInterval (one hour).
	Interval time.Duration

	// BatchSize is how many rows each round of Prune reads and deletes, as
	// ratelimit.PruneOpts.BatchSize. Defaults to 0: Prune's default, 1000.
	BatchSize int

	// Queue is the River queue the job is inserted in; the client must work it. Defaults to
	// river.QueueDefault.
	Queue string

	// RunOnStart inserts a job as soon as the client is elected leader, besides every Interval, as
	// river.PeriodicJobOpts.RunOnStart. Defaults to false.
	RunOnStart bool

	// Timeout bounds one run of the job, as river.Worker's Timeout. Defaults to 0: the client's
	// JobTimeout (River's default is one minute).
	Timeout time.Duration

	// Logger receives one line per run: the rows deleted per limit at Info level. Defaults to nil:
	// slog.Default().
	Logger *slog.Logger
}

func (c *PruneConfig) withDefaults(op string) (PruneConfig, error) {
	var out PruneConfig
	if c != nil {
		out = *c
	}
	switch {
	case out.Interval < 0:
		return out, argError(op, "PruneConfig.Interval", fmt.Sprintf("must not be negative, got %s", out.Interval), nil)
	case out.BatchSize < 0:
		return out, argError(op, "PruneConfig.BatchSize", fmt.Sprintf("must not be negative, got %d", out.BatchSize), nil)
	case out.Timeout < 0:
		return out, argError(op, "PruneConfig.Timeout", fmt.Sprintf("must not be negative, got %s", out.Timeout), nil)
	}
	if out.Interval == 0 {
		out.Interval = DefaultPruneInterval
	}
	if out.Queue == "" {
		out.Queue = river.QueueDefault
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return out, nil
}

// PruneWorker is the River worker of the prune job: each run calls Limiter.PruneAll on its database
// handle (a pool: pruning works in short rounds of its own, not inside the job's transaction),
// records a PruneOutput as the job's output and logs it. A failed run is an error, retried by
// River like any job's. Register it with river.AddWorker; PrunePeriodicJob schedules it.
type PruneWorker struct {
	river.WorkerDefaults[PruneArgs]
	limiter *ratelimit.Limiter
	db      ratelimit.Executor
	cfg     PruneConfig
}

// NewPruneWorker returns the worker that prunes every limit registered in limiter through db
// (a *pgxpool.Pool, or sqldb.Wrap of a *sql.DB). A nil limiter or db, or an invalid config, is
// an *ratelimit.ArgumentError.
func NewPruneWorker(limiter *ratelimit.Limiter, db ratelimit.Executor, config *PruneConfig) (*PruneWorker, error) {
	const op = "NewPruneWorker"
	if limiter == nil {
		return nil, argError(op, "limiter", "is nil: pass the *ratelimit.Limiter whose limits to prune", nil)
	}
	if db == nil {
		return nil, argError(op, "db", "is nil: pass a *pgxpool.Pool", nil)
	}
	cfg, err := config.withDefaults(op)
	if err != nil {
		return nil, err
	}
	return &PruneWorker{limiter: limiter, db: db, cfg: cfg}, nil
}

// Timeout returns PruneConfig.Timeout.
func (w *PruneWorker) Timeout(*river.Job[PruneArgs]) time.Duration { return w.cfg.Timeout }

// Work prunes every registered limit and reports the rows deleted.
func (w *PruneWorker) Work(ctx context.Context, job *river.Job[PruneArgs]) error {
	deleted, err := w.limiter.PruneAll(ctx, w.db, &ratelimit.PruneOpts{BatchSize: w.cfg.BatchSize})
	out := PruneOutput{Deleted: deleted}
	names := make([]string, 0, len(deleted))
	for name, n := range deleted {
		out.Total += n
		names = append(names, name)
	}
	sort.Strings(names)
	attrs := []any{slog.Int64("job_id", job.ID), slog.Int64("total", out.Total)}
	for _, name := range names {
		attrs = append(attrs, slog.Int64("deleted."+name, deleted[name]))
	}
	if err != nil {
		w.cfg.Logger.ErrorContext(ctx, "txlimit: prune failed", append(attrs, slog.Any("error", err))...)
		return fmt.Errorf("scheduler: prune: %w", err)
	}
	w.cfg.Logger.InfoContext(ctx, "txlimit: pruned", attrs...)
	if err := river.RecordOutput(ctx, out); err != nil {
		return fmt.Errorf("scheduler: prune: record output: %w", err)
	}
	return nil
}

// PrunePeriodicJob returns the periodic job for river.Config.PeriodicJobs that inserts a prune job
// every PruneConfig.Interval (DefaultPruneInterval unless set) in PruneConfig.Queue. River's leader
// alone inserts periodic jobs, and the job is unique per interval, so a cluster of clients prunes
// once per interval. Its ID is "txlimit_prune". An invalid config is an *ratelimit.ArgumentError.
//
//	pruner, err := scheduler.NewPruneWorker(limiter, pool, nil)
//	river.AddWorker(workers, pruner)
//	job, err := scheduler.PrunePeriodicJob(nil)
//	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
//		PeriodicJobs: []*river.PeriodicJob{job}, Workers: workers, ...})
func PrunePeriodicJob(config *PruneConfig) (*river.PeriodicJob, error) {
	cfg, err := config.withDefaults("PrunePeriodicJob")
	if err != nil {
		return nil, err
	}
	return river.NewPeriodicJob(
		river.PeriodicInterval(cfg.Interval),
		func() (river.JobArgs, *river.InsertOpts) {
			return PruneArgs{}, &river.InsertOpts{
				Queue:      cfg.Queue,
				UniqueOpts: river.UniqueOpts{ByPeriod: cfg.Interval},
			}
		},
		&river.PeriodicJobOpts{ID: "txlimit_prune", RunOnStart: cfg.RunOnStart},
	), nil
}
