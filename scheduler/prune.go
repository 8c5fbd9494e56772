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

// pruneArgs are the arguments of the prune job (Housekeeping): none, the worker holds the limiter
// and the database handle.
type pruneArgs struct{}

// Kind returns "txlimit_prune".
func (pruneArgs) Kind() string { return "txlimit_prune" }

// pruneOutput is what a prune job reports: recorded as the job's output (river.RecordOutput, read
// back with rivertype.JobRow.Output) and logged.
type pruneOutput struct {
	// Deleted is the number of rows deleted per registered limit, as Limiter.PruneAll returns it.
	Deleted map[string]int64 `json:"deleted"`
	// Total is the sum of Deleted.
	Total int64 `json:"total"`
}

// pruneWorker is the River worker of the prune job: each run calls Limiter.PruneAll on its
// database handle, records a pruneOutput as the job's output and logs it.
type pruneWorker struct {
	river.WorkerDefaults[pruneArgs]
	limiter *ratelimit.Limiter
	db      ratelimit.Executor
	cfg     HousekeepingConfig
}

// Timeout returns HousekeepingConfig.PruneTimeout.
func (w *pruneWorker) Timeout(*river.Job[pruneArgs]) time.Duration { return w.cfg.PruneTimeout }

// Work prunes every registered limit and reports the rows deleted.
func (w *pruneWorker) Work(ctx context.Context, job *river.Job[pruneArgs]) error {
	deleted, err := w.limiter.PruneAll(ctx, w.db, &ratelimit.PruneOpts{BatchSize: w.cfg.PruneBatchSize})
	out := pruneOutput{Deleted: deleted}
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
