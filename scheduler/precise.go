package scheduler

import (
	"context"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
)

// Fetch settings of PreciseQueue. River's producer polls every fetchPollInterval plus a jitter of
// max(fetchPollInterval/10, 10 ms), so a job that became due between two polls waits at most
// about 60 ms for the next one.
const (
	// fetchCooldown is the least time between two fetches of a PreciseQueue. It must not exceed
	// fetchPollInterval (River rejects the config otherwise).
	fetchCooldown = 25 * time.Millisecond

	// fetchPollInterval is how often a PreciseQueue looks for jobs that have become due.
	fetchPollInterval = 50 * time.Millisecond
)

// PreciseQueue returns the config of a River queue whose jobs start close to their scheduled time:
// it polls every 50 ms (River's FetchPollInterval, whose default is 1 s) with 25 ms between
// fetches (FetchCooldown), so a job that became due between two polls waits at most about 60 ms.
// Each poll is one indexed query per queue per client that finds nothing most of the time; see
// docs/scheduler.md for its cost. maxWorkers is the queue's River MaxWorkers.
func PreciseQueue(maxWorkers int) river.QueueConfig {
	return river.QueueConfig{
		FetchCooldown:     fetchCooldown,
		FetchPollInterval: fetchPollInterval,
		MaxWorkers:        maxWorkers,
	}
}

type preciseKey struct{}

// WithPrecise returns a context that makes PreciseHook insert jobs scheduled for the future as
// available rather than scheduled, so that a PreciseQueue starts them on time. ReserveTx uses it
// for its jobs; use it for inserts of your own that need the same precision.
func WithPrecise(ctx context.Context) context.Context {
	return context.WithValue(ctx, preciseKey{}, true)
}

// isPrecise reports whether ctx went through WithPrecise.
func isPrecise(ctx context.Context) bool {
	v, _ := ctx.Value(preciseKey{}).(bool)
	return v
}

// PreciseHook is a River insert hook that inserts a job headed for the scheduled state as
// available instead, keeping its future scheduled_at, when the insert's context went through
// WithPrecise. River's fetch query only takes available jobs whose scheduled_at has passed, so such
// a job is started by the first fetch after its time (within about 60 ms on a PreciseQueue)
// instead of waiting for River's scheduler, which promotes scheduled jobs every 5 s. River gives
// short snoozes the same available-in-the-future state. Other inserts, and pending jobs, are left
// alone.
//
// Install it in river.Config.Hooks of every client that inserts reserved jobs:
//
//	Hooks: []rivertype.Hook{&scheduler.PreciseHook{}},
//
// The zero value is ready to use.
type PreciseHook struct {
	river.HookDefaults
}

var _ rivertype.HookInsertBegin = (*PreciseHook)(nil)

// InsertBegin implements rivertype.HookInsertBegin.
func (h *PreciseHook) InsertBegin(ctx context.Context, params *rivertype.JobInsertParams) error {
	if err := markHookSeen(ctx); err != nil {
		return err
	}
	if params.State == rivertype.JobStateScheduled && isPrecise(ctx) {
		params.State = rivertype.JobStateAvailable
	}
	return nil
}
