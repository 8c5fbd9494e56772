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
)

// meterName is the name of the OpenTelemetry meter of this package
// (HousekeepingConfig.MeterProvider).
const meterName = "github.com/txlimit/txlimit/scheduler"

// metricStranded is the name of the stranded check's counter; HousekeepingConfig.MeterProvider
// says what it counts.
const metricStranded = "txlimit.scheduler.stranded"

// strandedKey is the key of job metadata under which the stranded check records when it found the
// job stranded ({"at": time}), so that each job is counted once.
const strandedKey = "txlimit_stranded"

// strandedArgs are the arguments of the stranded check's job (Housekeeping): none.
type strandedArgs struct{}

// Kind returns "txlimit_stranded".
func (strandedArgs) Kind() string { return "txlimit_stranded" }

// strandedQueue is what one stranded check found in one queue.
type strandedQueue struct {
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

// strandedOutput is what a stranded check reports: recorded as the job's output
// (river.RecordOutput, read back with rivertype.JobRow.Output), counted and logged.
type strandedOutput struct {
	// Queues are the queues with jobs found stranded, by name.
	Queues []strandedQueue `json:"queues"`
	// Total is the sum of their Jobs.
	Total int64 `json:"total"`
}

// strandedWorker is the River worker of the stranded check (see Housekeeping).
type strandedWorker struct {
	river.WorkerDefaults[strandedArgs]
	db       schedsql.DBTX
	cfg      HousekeepingConfig
	meter    *observe.Meter
	stranded metric.Int64Counter
	now      func() time.Time // tests replace it; nil: the database's clock
}

// newStrandedWorker returns the worker of the stranded check, which reads and marks River's jobs
// through db, with cfg's defaults applied.
func newStrandedWorker(db schedsql.DBTX, cfg HousekeepingConfig) *strandedWorker {
	w := &strandedWorker{db: db, cfg: cfg, meter: observe.New(cfg.MeterProvider, observe.Global, meterName)}
	var err error
	w.stranded, err = w.meter.Int64Counter(metricStranded, metric.WithUnit("{job}"),
		metric.WithDescription("Reserved jobs found not started long past their scheduled time, each once, by queue."))
	observe.Created(cfg.Logger, "scheduler", err)
	return w
}

// Work runs one check.
func (w *strandedWorker) Work(ctx context.Context, job *river.Job[strandedArgs]) error {
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
func (w *strandedWorker) check(ctx context.Context) (strandedOutput, error) {
	params := schedsql.MarkStrandedParams{AfterUs: w.cfg.StrandedAfter.Microseconds()}
	if w.now != nil {
		params.Now = pgtype.Timestamptz{Time: w.now(), Valid: true}
	}
	rows, err := schedsql.New().MarkStranded(ctx, w.db, params)
	if err != nil {
		return strandedOutput{}, err
	}
	byQueue := map[string]*strandedQueue{}
	out := strandedOutput{Queues: []strandedQueue{}}
	for _, r := range rows { // in ID order: the first of a queue is its oldest reservation
		q := byQueue[r.Queue]
		if q == nil {
			q = &strandedQueue{Queue: r.Queue, FirstJobID: r.ID, FirstScheduledAt: r.ScheduledAt.Time.UTC(), Worked: r.Worked}
			byQueue[r.Queue] = q
		}
		q.Jobs++
		out.Total++
	}
	for _, q := range byQueue {
		out.Queues = append(out.Queues, *q)
	}
	slices.SortFunc(out.Queues, func(a, b strandedQueue) int { return strings.Compare(a.Queue, b.Queue) })
	for _, q := range out.Queues {
		w.stranded.Add(ctx, q.Jobs, w.meter.Attrs(q.Queue, func() []attribute.KeyValue {
			return []attribute.KeyValue{attribute.String("txlimit.queue", q.Queue)}
		}).Add...)
		fix := fmt.Sprintf("no River client works queue %q: add it to river.Config.Queues of a client, or cancel the jobs with Scheduler.CancelTx to refund their tokens "+
			"(a job that had started when its client stopped may have done its work: settle it with Scheduler.SettleTx instead)", q.Queue)
		if q.Worked {
			fix = fmt.Sprintf("River's clients work queue %q but did not start these jobs: see whether its clients are stopped, the queue paused (QueuePause) or its workers behind", q.Queue)
		}
		w.cfg.Logger.WarnContext(ctx, "txlimit: reserved jobs stranded",
			slog.String("queue", q.Queue), slog.Int64("jobs", q.Jobs), slog.Int64("first_job_id", q.FirstJobID),
			slog.Time("first_scheduled_at", q.FirstScheduledAt), slog.Bool("worked", q.Worked), slog.String("fix", fix))
	}
	return out, nil
}
