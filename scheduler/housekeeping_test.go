package scheduler_test

import (
	"context"
	"encoding/json"
	"maps"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestHousekeepingPeriodicJobs runs both periodic jobs of Housekeeping in a real client: inserted
// on start, worked, outputs recorded. The prune job deletes the rows that are full by then; the
// stranded check, on the database's clock, finds a reservation due in 2024 long stranded, in a
// queue no client works.
func TestHousekeepingPeriodicJobs(t *testing.T) {
	t.Parallel()
	limits := maps.Clone(pruneLimits)
	limits["calls"] = perMinute10
	b := setup(t, &setupOpts{limits: limits, now: frozen(t0)})
	ctx := context.Background()
	_, err := b.limiter.LimitN(ctx, b.pool, "tb", "a", 3, nil)
	require.NoError(t, err)
	sched, err := scheduler.New(insertOnly(t, b.pool), b.limiter, nil)
	require.NoError(t, err)
	var id int64
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := sched.ReserveTx(ctx, tx, "calls", "k", 15, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: "orphan"}})
		if err == nil {
			id = res.Job.ID
		}
		return err
	}))
	// A second limiter whose clock is an hour later does the pruning: both rows are full by then.
	later, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits, Now: frozen(t0.Add(time.Hour))})
	require.NoError(t, err)
	workers := river.NewWorkers()
	jobs, err := scheduler.Housekeeping(workers, later, b.pool, &scheduler.HousekeepingConfig{Logger: quietLogger(), RunOnStart: true})
	require.NoError(t, err)
	client, err := river.NewClient(riverpgxv5.New(b.pool), &river.Config{
		Logger:       quietLogger(),
		PeriodicJobs: jobs,
		Queues:       map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}},
		TestOnly:     true,
		Workers:      workers,
	})
	require.NoError(t, err)
	events, cancel := client.Subscribe(river.EventKindJobCompleted, river.EventKindJobFailed)
	defer cancel()
	startClient(t, client)

	ended := map[string]*river.Event{}
	timeout := time.After(60 * time.Second) // a generous bound for a loaded machine: leader election
	for len(ended) < 2 {
		select {
		case ev := <-events:
			require.Equal(t, river.EventKindJobCompleted, ev.Kind, "job %s", ev.Job.Kind)
			if ended[ev.Job.Kind] == nil { // the first run of each: a later one finds nothing left
				ended[ev.Job.Kind] = ev
			}
		case <-timeout:
			t.Fatalf("the periodic jobs did not both complete: %v ended", ended)
		}
	}
	var pruned scheduler.PruneOutput
	require.NoError(t, json.Unmarshal(ended["txlimit_prune"].Job.Output(), &pruned))
	require.Equal(t, int64(1), pruned.Deleted["tb"])
	require.Equal(t, int64(1), pruned.Deleted["calls"])
	require.Equal(t, 0, testdb.CountRows(t, b.pool))
	var stranded scheduler.StrandedOutput
	require.NoError(t, json.Unmarshal(ended["txlimit_stranded"].Job.Output(), &stranded))
	require.Equal(t, scheduler.StrandedOutput{Total: 1, Queues: []scheduler.StrandedQueue{
		{Queue: "orphan", Jobs: 1, FirstJobID: id, FirstScheduledAt: t0.Add(30 * time.Second)},
	}}, stranded)
}
