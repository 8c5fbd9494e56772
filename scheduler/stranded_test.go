package scheduler_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// reserveOne reserves 5 tokens of "calls" for key k with a job of opts, commits, and returns the
// job's ID.
func reserveOne(t *testing.T, b *testBundle, sched *scheduler.Scheduler, opts *scheduler.ReserveOpts) int64 {
	t.Helper()
	var id int64
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		r, err := sched.ReserveTx(context.Background(), tx, "calls", "k", 5, callArgs{}, opts)
		if err == nil {
			id = r.Job.ID
		}
		return err
	}))
	return id
}

// TestStrandedWorkerFindsAPendingJob: a reserved job inserted pending (InsertOpts.Pending) waits
// for something else to make it available; long past its time it has not started and holds its
// tokens, like any job waiting to run. docs/spec.md §9: "a reserved job that has still not started
// well past its time ... is found by the stranded check". It was not (the check looked at
// available, scheduled and retryable jobs only).
func TestStrandedWorkerFindsAPendingJob(t *testing.T) {
	t.Parallel()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Minute, MaxReserved: 100}}})
	id := reserveOne(t, b, b.sched, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Pending: true}})
	require.Equal(t, rivertype.JobStatePending, jobRow(t, b, id).State)

	var logs metrictest.Logs
	later := func() time.Time { return time.Now().Add(time.Hour) }
	w, err := scheduler.NewStrandedWorker(b.pool, &scheduler.HousekeepingConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, later)
	require.NoError(t, err)
	out := runStranded(t, b, w, false)
	require.Equal(t, int64(1), out.Total, "%+v", out)
	require.Len(t, out.Queues, 1)
	require.Equal(t, id, out.Queues[0].FirstJobID)
	require.Equal(t, string(rivertype.JobStatePending), out.Queues[0].State)
	require.Contains(t, logs.String(), "pending", "the fix names what keeps the job from running")

	out = runStranded(t, b, w, false)
	require.Equal(t, int64(0), out.Total, "counted once: %+v", out)
}

// TestStrandedWorkerFindsJobsRiverEndedUnrefunded: a reserved job that River finalized before it
// started, without the package's refund, holds its tokens with no work to show for them and
// nothing to tell: River's own JobCancel (River UI's Cancel), or River's scheduler discarding a
// unique conflict (docs/scheduler.md said "neither CancelTx nor the stranded check sees it"). The
// check now reports each once, naming the refund (SettleTx with 0 used), and leaves it alone once
// refunded. A job that started (its work may be done) and a job CancelTx refunded are not reported.
func TestStrandedWorkerFindsJobsRiverEndedUnrefunded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Minute, MaxReserved: 100}}})
	q := &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: "q1"}}
	cancelled := reserveOne(t, b, b.sched, q)
	discarded := reserveOne(t, b, b.sched, q)
	refunded := reserveOne(t, b, b.sched, q)
	started := reserveOne(t, b, b.sched, q)

	_, err := b.client.JobCancel(ctx, cancelled) // River's own cancel: no refund
	require.NoError(t, err)
	// What River's scheduler does to a unique conflict it promotes (Config.AllowImprecise).
	_, err = b.pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', finalized_at = now(),
		metadata = metadata || '{"unique_key_conflict": "scheduler_discarded"}' WHERE id = $1`, discarded)
	require.NoError(t, err)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.CancelTx(ctx, tx, refunded); return err }))
	_, err = b.pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', finalized_at = now(), attempt = 1, attempted_at = now() WHERE id = $1`, started)
	require.NoError(t, err)
	before := value(t, b, "calls", "k")

	var logs metrictest.Logs
	later := func() time.Time { return time.Now().Add(time.Hour) }
	w, err := scheduler.NewStrandedWorker(b.pool, &scheduler.HousekeepingConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, later)
	require.NoError(t, err)
	out := runStranded(t, b, w, false)
	require.Equal(t, int64(2), out.Total, "%+v", out)
	byState := map[string]int64{}
	for _, sq := range out.Queues {
		require.Equal(t, "q1", sq.Queue)
		byState[sq.State] = sq.FirstJobID
	}
	require.Equal(t, map[string]int64{"cancelled": cancelled, "discarded": discarded}, byState)
	require.Contains(t, logs.String(), "SettleTx", "the fix names the refund")

	// The refund the fix names works, once, and the check then has nothing more to say.
	for _, id := range []int64{cancelled, discarded} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.SettleTx(ctx, tx, id, 0); return err }))
	}
	require.InDelta(t, before+10, value(t, b, "calls", "k"), 0.5)
	out = runStranded(t, b, w, false)
	require.Equal(t, int64(0), out.Total, "%+v", out)
}

// TestStrandedWorkerReportsAJobStrandedAgain: a job found stranded, then run again (a client came
// back), that failed and was put back to wait in a queue no client works any more, is stranded a
// second time. The check marked it for good the first time and never reported it again.
func TestStrandedWorkerReportsAJobStrandedAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Minute, MaxReserved: 100}}})
	id := reserveOne(t, b, b.sched, nil)

	at := time.Now().Add(time.Hour)
	w, err := scheduler.NewStrandedWorker(b.pool, &scheduler.HousekeepingConfig{Logger: quietLogger()}, func() time.Time { return at })
	require.NoError(t, err)
	out := runStranded(t, b, w, false)
	require.Equal(t, int64(1), out.Total, "%+v", out)
	out = runStranded(t, b, w, false)
	require.Equal(t, int64(0), out.Total, "counted once while it stays stranded: %+v", out)

	// A client comes back and works the job, which fails: River puts it back to retry (available
	// when the retry is due within its scheduler's 5 s, else retryable).
	failed := make(chan struct{}, 1)
	worker := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(1)},
		work: func(context.Context, *river.Job[callArgs]) error {
			failed <- struct{}{}
			return errors.New("the model is down")
		},
	})
	require.NoError(t, worker.Start(ctx))
	select {
	case <-failed:
	case <-time.After(10 * time.Second):
		t.Fatal("the job did not run")
	}
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, worker.Stop(stopCtx))
	job := jobRow(t, b, id)
	require.Contains(t, []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStateRetryable}, job.State, "put back to retry")
	require.Equal(t, 1, job.Attempt)

	// Nothing works its queue any more: an hour past its retry it is stranded again.
	at = job.ScheduledAt.Add(time.Hour)
	out = runStranded(t, b, w, false)
	require.Equal(t, int64(1), out.Total, "stranded a second time: %+v", out)
	require.True(t, out.Queues[0].FirstScheduledAt.Equal(job.ScheduledAt), "%+v", out)
	out = runStranded(t, b, w, false)
	require.Equal(t, int64(0), out.Total, "and counted once again: %+v", out)
}

// TestCancelTxOfAJobRiverCancelledNamesTheRefund: CancelTx of a reserved job that River's own
// JobCancel cancelled before it started (no refund) said "job N was already cancelled", as if the
// refund had been given, to the operator the docs send to CancelTx. It is still refused (nothing
// written), and the error now says the reservation was not refunded and how to refund it.
func TestCancelTxOfAJobRiverCancelledNamesTheRefund(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Minute, MaxReserved: 100}}})
	id := reserveOne(t, b, b.sched, nil)
	_, err := b.client.JobCancel(ctx, id)
	require.NoError(t, err)
	err = inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.CancelTx(ctx, tx, id); return err })
	var nc *scheduler.NotCancellableError
	require.ErrorAs(t, err, &nc)
	require.True(t, nc.Cancelled())
	require.False(t, nc.Settled)
	require.Contains(t, err.Error(), "SettleTx", "the error names the refund: %v", err)

	// A unique conflict River's scheduler discarded never ran: it said "already ran".
	discarded := reserveOne(t, b, b.sched, nil)
	_, err = b.pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', finalized_at = now(),
		metadata = metadata || '{"unique_key_conflict": "scheduler_discarded"}' WHERE id = $1`, discarded)
	require.NoError(t, err)
	err = inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.CancelTx(ctx, tx, discarded); return err })
	require.ErrorAs(t, err, &nc)
	require.False(t, nc.Started, "it never started")
	require.Contains(t, err.Error(), "discarded by River before it started", "%v", err)

	// Once refunded (or cancelled by CancelTx), "already cancelled" is the whole story.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.SettleTx(ctx, tx, id, 0); return err }))
	err = inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.CancelTx(ctx, tx, id); return err })
	require.ErrorAs(t, err, &nc)
	require.NotContains(t, err.Error(), "SettleTx", "%v", err)
}
