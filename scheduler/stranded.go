package scheduler

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/riverqueue/river"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/txlimit/txlimit/internal/observe"
	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// MeterName is the name of the OpenTelemetry meter of this package (StrandedConfig.MeterProvider).
const MeterName = "github.com/txlimit/txlimit/scheduler"

// MetricStranded counts the reserved jobs the stranded check found not started more than
// StrandedConfig.After past their time, each once, by queue (attribute txlimit.queue). An increase
// means tokens reserved for work that is not running: alert on it.
const MetricStranded = "txlimit.scheduler.stranded"

// StrandedKey is the key of job metadata under which the stranded check records when it found the
// job stranded ({"at": time}), so that each job is counted once. River UI shows it with the job's
// other metadata.
const StrandedKey = "txlimit_stranded"

// DefaultStrandedAfter is how long past its scheduled time a reserved job that has not started
// counts as stranded unless StrandedConfig.After says otherwise: 5 minutes. A PreciseQueue starts a
// reserved job within about 60 ms of its time, so this leaves room for workers that are busy.
const DefaultStrandedAfter = 5 * time.Minute

// DefaultStrandedInterval is how often the stranded check runs unless StrandedConfig.Interval says
// otherwise: once a minute.
const DefaultStrandedInterval = time.Minute

// StrandedArgs are the arguments of the stranded check's job: none. Its kind is "txlimit_stranded".
type StrandedArgs struct{}

// Kind returns "txlimit_stranded".
func (StrandedArgs) Kind() string { return "txlimit_stranded" }

// StrandedConfig configures NewStrandedWorker and StrandedPeriodicJob. A nil *StrandedConfig is the
// zero value.
type StrandedConfig struct {
	// After is how long past its scheduled time a reserved job that has not started counts as
	// stranded. Must not be negative. Defaults to DefaultStrandedAfter (5 minutes).
	After time.Duration

	// Interval is the time between two checks. Must not be negative. Defaults to
	// DefaultStrandedInterval (one minute).
	Interval time.Duration

	// Logger receives one warning per queue with jobs found stranded. Defaults to nil:
	// slog.Default().
	Logger *slog.Logger

	// MeterProvider provides the meter (MeterName) that counts the jobs found (MetricStranded).
	// Defaults to nil: the global one, otel.GetMeterProvider() (a no-op until the application sets
	// one with otel.SetMeterProvider).
	MeterProvider metric.MeterProvider

	// Queue is the River queue the check's job is inserted in; a client must work it, or the check
	// never runs. Defaults to river.QueueDefault.
	Queue string

	// RunOnStart inserts a check as soon as the client is elected leader, besides every Interval,
	// as river.PeriodicJobOpts.RunOnStart. Defaults to false.
	RunOnStart bool
}

func (c *StrandedConfig) withDefaults(op string) (StrandedConfig, error) {
	var out StrandedConfig
	if c != nil {
		out = *c
	}
	switch {
	case out.After < 0:
		return out, argError(op, "StrandedConfig.After", fmt.Sprintf("must not be negative, got %s", out.After), nil)
	case out.Interval < 0:
		return out, argError(op, "StrandedConfig.Interval", fmt.Sprintf("must not be negative, got %s", out.Interval), nil)
	}
	if out.After == 0 {
		out.After = DefaultStrandedAfter
	}
	if out.Interval == 0 {
		out.Interval = DefaultStrandedInterval
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.Queue == "" {
		out.Queue = river.QueueDefault
	}
	return out, nil
}

// StrandedQueue is what one stranded check found in one queue.
type StrandedQueue struct {
	// Queue is the River queue.
	Queue string `json:"queue"`
	// Jobs is the number of reserved jobs found stranded there by this check (each job is found
	// once).
	Jobs int64 `json:"jobs"`
	// FirstJobID and FirstScheduledAt are the ID and scheduled time of the first of them.
	FirstJobID       int64     `json:"first_job_id"`
	FirstScheduledAt time.Time `json:"first_scheduled_at"`
	// Worked reports whether River's queue table lists the queue, i.e. some River client works it
	// (then its workers are stopped, paused or behind); false means none does.
	Worked bool `json:"worked"`
}

// StrandedOutput is what a stranded check reports: recorded as the job's output
// (river.RecordOutput, read back with rivertype.JobRow.Output), counted and logged.
type StrandedOutput struct {
	// Queues are the queues with jobs found stranded, by name.
	Queues []StrandedQueue `json:"queues"`
	// Total is the sum of their Jobs.
	Total int64 `json:"total"`
}

// StrandedWorker is the River worker of the stranded check. A reserved job (ReserveTx,
// ReserveManyTx) holds its tokens until it runs, settles or is cancelled; one that nothing starts
// (its queue is one no River client works, or the workers are stopped) holds them for good. Each
// run finds the reserved jobs that have not started more than StrandedConfig.After past their
// scheduled time, marks them (StrandedKey) so that each is counted once, counts them
// (MetricStranded, by queue), logs a warning per queue with the fix, and records a
// StrandedOutput. At most 1000 jobs are marked per run; the rest are found by the next runs. A
// failed run is an error, retried by River like any job's. Register it with river.AddWorker;
// StrandedPeriodicJob schedules it.
type StrandedWorker struct {
	river.WorkerDefaults[StrandedArgs]
	db       ratelimit.Executor
	cfg      StrandedConfig
	meter    *observe.Meter
	stranded metric.Int64Counter
	now      func() time.Time // tests replace it; nil: the database's clock
}

// NewStrandedWorker returns the worker of the stranded check, which reads and marks River's jobs
// through db (a *pgxpool.Pool: the check is one statement of its own, outside the job's
// transaction). A nil db or an invalid config is an *ratelimit.ArgumentError.
func NewStrandedWorker(db ratelimit.Executor, config *StrandedConfig) (*StrandedWorker, error) {
	const op = "NewStrandedWorker"
	if db == nil {
		return nil, argError(op, "db", "is nil: pass the *pgxpool.Pool of the River client", nil)
	}
	cfg, err := config.withDefaults(op)
	if err != nil {
		return nil, err
	}
	w := &StrandedWorker{db: db, cfg: cfg}
	w.meter = observe.New(cfg.MeterProvider, observe.Global, MeterName)
	w.stranded, err = w.meter.Int64Counter(MetricStranded, metric.WithUnit("{job}"),
		metric.WithDescription("Reserved jobs found not started long past their scheduled time, each once, by queue."))
	observe.Created(cfg.Logger, "scheduler", err)
	return w, nil
}

// Work runs one check.
func (w *StrandedWorker) Work(ctx context.Context, job *river.Job[StrandedArgs]) error {
	out, err := w.check(ctx)
	if err != nil {
		w.cfg.Logger.ErrorContext(ctx, "txlimit: stranded check failed", slog.Int64("job_id", job.ID), slog.Any("error", err))
		return fmt.Errorf("scheduler: stranded check: %w", err)
	}
	if err := river.RecordOutput(ctx, out); err != nil {
		return fmt.Errorf("scheduler: stranded check: record output: %w", err)
	}
	return nil
}

// check marks, counts and logs the jobs stranded now.
func (w *StrandedWorker) check(ctx context.Context) (StrandedOutput, error) {
	params := schedsql.MarkStrandedParams{AfterUs: w.cfg.After.Microseconds()}
	if w.now != nil {
		params.Now = pgtype.Timestamptz{Time: w.now(), Valid: true}
	}
	rows, err := schedsql.New().MarkStranded(ctx, w.db, params)
	if err != nil {
		return StrandedOutput{}, err
	}
	byQueue := map[string]*StrandedQueue{}
	out := StrandedOutput{Queues: []StrandedQueue{}}
	for _, r := range rows { // in ID order: the first of a queue is its oldest reservation
		q := byQueue[r.Queue]
		if q == nil {
			q = &StrandedQueue{Queue: r.Queue, FirstJobID: r.ID, FirstScheduledAt: r.ScheduledAt.Time.UTC(), Worked: r.Worked}
			byQueue[r.Queue] = q
		}
		q.Jobs++
		out.Total++
	}
	for _, q := range byQueue {
		out.Queues = append(out.Queues, *q)
	}
	slices.SortFunc(out.Queues, func(a, b StrandedQueue) int { return strings.Compare(a.Queue, b.Queue) })
	for _, q := range out.Queues {
		w.stranded.Add(ctx, q.Jobs, w.meter.Attrs(q.Queue, func() []attribute.KeyValue {
			return []attribute.KeyValue{attribute.String("txlimit.queue", q.Queue)}
		}).Add...)
		fix := fmt.Sprintf("no River client works queue %q: add it to river.Config.Queues of a client, or cancel the jobs with Scheduler.CancelTx to refund their tokens", q.Queue)
		if q.Worked {
			fix = fmt.Sprintf("River's clients work queue %q but did not start these jobs: see whether its clients are stopped, the queue paused (QueuePause) or its workers behind", q.Queue)
		}
		w.cfg.Logger.WarnContext(ctx, "txlimit: reserved jobs stranded",
			slog.String("queue", q.Queue), slog.Int64("jobs", q.Jobs), slog.Int64("first_job_id", q.FirstJobID),
			slog.Time("first_scheduled_at", q.FirstScheduledAt), slog.Bool("worked", q.Worked), slog.String("fix", fix))
	}
	return out, nil
}

// StrandedPeriodicJob returns the periodic job for river.Config.PeriodicJobs that inserts a
// stranded check every StrandedConfig.Interval (DefaultStrandedInterval unless set) in
// StrandedConfig.Queue. River's leader alone inserts periodic jobs, and the job is unique per
// interval, so a cluster of clients checks once per interval. Its ID is "txlimit_stranded". An
// invalid config is an *ratelimit.ArgumentError.
//
//	checker, err := scheduler.NewStrandedWorker(pool, &scheduler.StrandedConfig{Queue: "llm"})
//	river.AddWorker(workers, checker)
//	job, err := scheduler.StrandedPeriodicJob(&scheduler.StrandedConfig{Queue: "llm"})
//	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
//		PeriodicJobs: []*river.PeriodicJob{job}, Workers: workers, ...})
func StrandedPeriodicJob(config *StrandedConfig) (*river.PeriodicJob, error) {
	cfg, err := config.withDefaults("StrandedPeriodicJob")
	if err != nil {
		return nil, err
	}
	return river.NewPeriodicJob(
		river.PeriodicInterval(cfg.Interval),
		func() (river.JobArgs, *river.InsertOpts) {
			return StrandedArgs{}, &river.InsertOpts{
				Queue:      cfg.Queue,
				UniqueOpts: river.UniqueOpts{ByPeriod: cfg.Interval},
			}
		},
		&river.PeriodicJobOpts{ID: "txlimit_stranded", RunOnStart: cfg.RunOnStart},
	), nil
}
