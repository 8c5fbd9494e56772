package scheduler

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
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
// job stranded, and the job's scheduled time and state then ({"at": time, "scheduled_at": time,
// "state": "waiting", "pending", "cancelled" or "discarded"}), so that each stranding is counted
// once.
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
	// State is empty for jobs waiting to run (available, scheduled or retryable); else "pending"
	// for jobs that River starts only once something makes them available, or "cancelled" or
	// "discarded" for jobs River finalized before they started without their refund (River's own
	// JobCancel, a unique conflict discarded by River's scheduler): refund those with
	// Scheduler.SettleTx and 0 used.
	State string `json:"state,omitempty"`
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
	type group struct{ queue, state string }
	byGroup := map[group]*strandedQueue{}
	out := strandedOutput{Queues: []strandedQueue{}}
	for _, r := range rows { // in ID order: the first of a group is its oldest reservation
		state := r.State
		if state == strandedWaiting {
			state = ""
		}
		q := byGroup[group{r.Queue, state}]
		if q == nil {
			q = &strandedQueue{Queue: r.Queue, FirstJobID: r.ID, FirstScheduledAt: r.ScheduledAt.Time.UTC(), Worked: r.Worked, State: state}
			byGroup[group{r.Queue, state}] = q
		}
		q.Jobs++
		out.Total++
	}
	for _, q := range byGroup {
		out.Queues = append(out.Queues, *q)
	}
	slices.SortFunc(out.Queues, func(a, b strandedQueue) int {
		return cmp.Or(strings.Compare(a.Queue, b.Queue), strings.Compare(a.State, b.State))
	})
	for _, q := range out.Queues {
		w.stranded.Add(ctx, q.Jobs, w.meter.Attrs(q.Queue, func() []attribute.KeyValue {
			return []attribute.KeyValue{attribute.String("txlimit.queue", q.Queue)}
		}).Add...)
		attrs := []any{slog.String("queue", q.Queue), slog.Int64("jobs", q.Jobs), slog.Int64("first_job_id", q.FirstJobID),
			slog.Time("first_scheduled_at", q.FirstScheduledAt), slog.Bool("worked", q.Worked)}
		if q.State != "" {
			attrs = append(attrs, slog.String("state", q.State))
		}
		w.cfg.Logger.WarnContext(ctx, "txlimit: reserved jobs stranded", append(attrs, slog.String("fix", strandedFix(q)))...)
	}
	return out, nil
}

// strandedWaiting is the state MarkStranded gives jobs waiting to run (available, scheduled,
// retryable); strandedQueue.State leaves it empty.
const strandedWaiting = "waiting"

// strandedFix is what the stranded check's warning about q tells the operator to do.
func strandedFix(q strandedQueue) string {
	const refund = "refund each with Scheduler.SettleTx(ctx, tx, jobID, 0) (CancelTx refuses a finalized job) before River's job cleaner deletes it"
	switch {
	case q.State == string(rivertype.JobStateCancelled):
		return "River cancelled these jobs before they started (River's own JobCancel, e.g. River UI's Cancel, not Scheduler.CancelTx), " +
			"so their reservations were not refunded: " + refund
	case q.State == string(rivertype.JobStateDiscarded):
		return "River discarded these jobs before they started (a unique conflict when River's scheduler promoted them), " +
			"so their reservations were not refunded: " + refund
	case q.State == string(rivertype.JobStatePending):
		return "these jobs are pending: River starts a pending job only once something makes it available; " +
			"make them available, or cancel them with Scheduler.CancelTx to refund their tokens"
	case q.Worked:
		return fmt.Sprintf("River's clients work queue %q but did not start these jobs: see whether its clients are stopped, the queue paused (QueuePause) or its workers behind", q.Queue)
	}
	return fmt.Sprintf("no River client works queue %q: add it to river.Config.Queues of a client, or cancel the jobs with Scheduler.CancelTx to refund their tokens "+
		"(a job that had started when its client stopped may have done its work: settle it with Scheduler.SettleTx instead)", q.Queue)
}
