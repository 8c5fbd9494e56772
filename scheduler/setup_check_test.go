package scheduler_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestCheck: the start-up check passes on a set-up scheduler and names the fix for each mistake,
// writing nothing.
func TestCheck(t *testing.T) { direct(t, check) }

func check(t *testing.T, c conn) {
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": perMinute10}, conn: c})

	// Set up: the probe is stopped by the hook, nothing is inserted. This client has Workers, so
	// the probe needs the args of one of its kinds; the built-in kind is refused, with a hint.
	require.NoError(t, b.sched.Check(ctx, b.pool, callArgs{}))
	require.Empty(t, jobs(t, b.client))
	err := b.sched.Check(ctx, b.pool, nil)
	require.ErrorContains(t, err, "pass args of a kind the client works")
	require.NotErrorIs(t, err, scheduler.ErrSetup)
	_, s2 := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
	require.NoError(t, s2.Check(ctx, b.pool, nil), "an insert-only client takes the built-in probe")

	// No hook: a *SetupError naming it; AllowImprecise accepts it.
	noHook := b.noHookScheduler(t, nil)
	err = noHook.Check(ctx, b.pool, callArgs{})
	require.ErrorIs(t, err, scheduler.ErrSetup)
	require.ErrorIs(t, err, scheduler.ErrNoPreciseHook)
	require.NotErrorIs(t, err, ratelimit.ErrInvalid)
	require.ErrorContains(t, err, "&scheduler.PreciseHook{}")
	require.Empty(t, jobs(t, b.client), "the probe was rolled back")
	lax := b.noHookScheduler(t, &scheduler.Config{AllowImprecise: true})
	require.NoError(t, lax.Check(ctx, b.pool, callArgs{}))

	// In a transaction, the check is a savepoint: the transaction goes on.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		require.ErrorIs(t, noHook.Check(ctx, tx, callArgs{}), scheduler.ErrNoPreciseHook)
		_, err := b.limiter.State(ctx, tx, "calls", "u1", nil)
		return err
	}))
}

// TestReserveTxNeedsHookEvenWhenItRunsNow: without PreciseHook, a reservation fails even when its
// tokens are there, so light traffic finds the mistake too.
func TestReserveTxNeedsHookEvenWhenItRunsNow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10, conn{})
	strict := b.noHookScheduler(t, nil)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := strict.ReserveTx(ctx, tx, "calls", "u1", 1, callArgs{}, nil)
		require.ErrorIs(t, err, scheduler.ErrNoPreciseHook)
		return nil
	}))
	require.Equal(t, 10.0, value(t, b, "calls", "u1"), "nothing reserved")
	require.Empty(t, jobs(t, b.client))
}

// TestMissingRiverTables: River's tables missing (scheduler.Migrate not run, or another
// search_path) is a *SetupError naming scheduler.Migrate and the search_path, from Check and from
// every call that touches them.
func TestMissingRiverTables(t *testing.T) { direct(t, missingRiverTables) }

func missingRiverTables(t *testing.T, c conn) {
	ctx := context.Background()
	pool := c.pool(t, 8, true) // txlimit's tables only
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"calls": perMinute10}})
	require.NoError(t, err)
	sched, err := scheduler.New(newClient(t, pool, nil), limiter, nil)
	require.NoError(t, err)
	path := testdb.SearchPath(t, pool)

	requireSetup := func(err error) {
		t.Helper()
		var se *scheduler.SetupError
		require.ErrorAs(t, err, &se)
		require.ErrorIs(t, err, scheduler.ErrNoRiverTables)
		require.Equal(t, path, se.SearchPath)
		require.ErrorContains(t, err, "scheduler.Migrate")
		require.ErrorContains(t, err, path)
	}
	requireSetup(sched.Check(ctx, pool, callArgs{}))
	require.NoError(t, inTx(t, pool, false, func(tx pgx.Tx) error {
		_, err := sched.ReserveTx(ctx, tx, "calls", "u1", 1, callArgs{}, nil)
		requireSetup(err)
		_, err = sched.CancelTx(ctx, tx, 1)
		requireSetup(err)
		_, err = sched.SettleTx(ctx, tx, 1, 1)
		requireSetup(err)
		return nil // the savepoints kept the transaction usable
	}))
	st, err := limiter.State(ctx, pool, "calls", "u1", nil)
	require.NoError(t, err)
	require.Equal(t, 10.0, st.Value, "nothing reserved")
}

func TestPreciseHook(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := &scheduler.PreciseHook{}
	tests := []struct {
		precise bool
		state   rivertype.JobState
		want    rivertype.JobState
	}{
		{precise: true, state: rivertype.JobStateScheduled, want: rivertype.JobStateAvailable},
		{precise: false, state: rivertype.JobStateScheduled, want: rivertype.JobStateScheduled},
		{precise: true, state: rivertype.JobStateAvailable, want: rivertype.JobStateAvailable},
		{precise: true, state: rivertype.JobStatePending, want: rivertype.JobStatePending},
	}
	for i, tt := range tests {
		c := ctx
		if tt.precise {
			c = scheduler.WithPrecise(ctx)
		}
		at := time.Now().Add(time.Hour)
		p := &rivertype.JobInsertParams{State: tt.state, ScheduledAt: &at}
		require.NoError(t, h.InsertBegin(c, p))
		require.Equal(t, tt.want, p.State, "case %d", i)
		require.Equal(t, at, *p.ScheduledAt, "case %d: scheduled_at is kept", i)
	}
}

func TestPreciseQueueIsValid(t *testing.T) {
	t.Parallel()
	q := scheduler.PreciseQueue(5)
	require.LessOrEqual(t, q.FetchCooldown, q.FetchPollInterval, "River rejects a poll interval below the cooldown")
	require.Equal(t, 5, q.MaxWorkers)
}

// TestReservedJobsStartOnTime guards PreciseHook and PreciseQueue: reserved jobs start well within
// River's 5 s scheduler interval of their time. BenchmarkLateness measures it.
func TestReservedJobsStartOnTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 8
	bound := time.Second // generous for a loaded CI machine; the benchmark shows the real figures
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 4, Period: time.Second, Capacity: 1, MaxReserved: ratelimit.Unbounded}}})
	st := newStarts()
	client := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(10)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			st.record(job.ID, time.Now())
			return nil
		},
	})
	sched, err := scheduler.New(client, b.limiter, nil)
	require.NoError(t, err)
	startClient(t, client)

	due := map[int64]time.Time{}
	for i := range n + 1 {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			r, err := sched.ReserveTx(ctx, tx, "calls", "", 1, callArgs{N: i}, nil)
			if err == nil && i > 0 {
				due[r.Job.ID] = r.ScheduledAt
			}
			return err
		}))
	}
	st.wait(t, n+1, 30*time.Second)
	// Reserved 250 ms apart, the 8 jobs fall due over 2 s. Left to River's scheduler (a pass every
	// 5 s) at least half would start a second or more late; a loaded machine may stall one or two.
	var lateOnes []string
	for id, at := range due {
		late := st.at[id].Sub(at)
		t.Logf("job %d: %s late", id, late)
		require.GreaterOrEqual(t, late, -2*time.Millisecond, "job %d started before its time", id)
		if late >= bound {
			lateOnes = append(lateOnes, fmt.Sprintf("job %d %s", id, late))
		}
	}
	require.LessOrEqual(t, len(lateOnes), 2, "started %s or more after their time: %v", bound, lateOnes)
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, &testdb.Options{NoMigrate: true})
	require.NoError(t, scheduler.Migrate(ctx, pool, nil))
	require.NoError(t, scheduler.Migrate(ctx, pool, nil), "a second run is a no-op")
	// The tables work: an insert-only client can list jobs in this schema.
	client := newClient(t, pool, nil)
	res, err := client.JobList(ctx, river.NewJobListParams())
	require.NoError(t, err)
	require.Empty(t, res.Jobs)
	require.Error(t, scheduler.Migrate(ctx, nil, nil))
}
