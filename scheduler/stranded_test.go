package scheduler_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// reservedCalls is setup with one limit, "calls", of 10 a minute that lets 100 be reserved, on
// the database's clock.
func reservedCalls(t *testing.T) *testBundle {
	t.Helper()
	return setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Minute, MaxReserved: 100}}})
}

// strandedWorker returns a stranded check on the clock now whose log lines are kept in the
// returned sink.
func strandedWorker(t *testing.T, b *testBundle, now func() time.Time) (*scheduler.StrandedWorker, *metrictest.Logs) {
	t.Helper()
	logs := &metrictest.Logs{}
	w, err := scheduler.NewStrandedWorker(b.pool, &scheduler.HousekeepingConfig{Logger: slog.New(slog.NewTextHandler(logs, nil))}, now)
	require.NoError(t, err)
	return w, logs
}

// discardAsRiversScheduler finalizes job id as River's scheduler does a unique conflict it
// promotes (Config.AllowImprecise): discarded, never started.
func discardAsRiversScheduler(t *testing.T, b *testBundle, id int64) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `UPDATE river_job SET state = 'discarded', finalized_at = now(),
		metadata = metadata || '{"unique_key_conflict": "scheduler_discarded"}' WHERE id = $1`, id)
	require.NoError(t, err)
}

// cancelTx runs CancelTx of job id in a transaction of its own, committed unless rollback.
func (b *testBundle) cancelTx(t *testing.T, id int64, rollback bool) error {
	t.Helper()
	return inTx(t, b.pool, rollback, func(tx pgx.Tx) error { _, err := b.sched.CancelTx(context.Background(), tx, id); return err })
}

// settleTx runs SettleTx of job id with used tokens in a committed transaction of its own.
func (b *testBundle) settleTx(t *testing.T, id int64, used float64) error {
	t.Helper()
	return inTx(t, b.pool, false, func(tx pgx.Tx) error { _, err := b.sched.SettleTx(context.Background(), tx, id, used); return err })
}

// workOnce starts a client working the default queue with work, waits (10 s at the most) for
// work's first call, and stops the client, with StopAndCancel when cancel (a call cut short) and
// with Stop otherwise. It returns the ID of the job of that first call.
func workOnce(t *testing.T, b *testBundle, cancel bool, work func(context.Context, *river.Job[callArgs]) error) int64 {
	t.Helper()
	ran := make(chan int64, 1)
	client := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(1)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			select {
			case ran <- job.ID:
			default:
			}
			return work(ctx, job)
		},
	})
	require.NoError(t, client.Start(context.Background()))
	var id int64
	select {
	case id = <-ran:
	case <-time.After(10 * time.Second):
		t.Fatal("no job ran")
	}
	stopCtx, stopped := context.WithTimeout(context.Background(), 10*time.Second)
	defer stopped()
	stop := client.Stop
	if cancel {
		stop = client.StopAndCancel
	}
	require.NoError(t, stop(stopCtx))
	return id
}

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
	b := reservedCalls(t)
	id := reserveOne(t, b, b.sched, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Pending: true}})
	require.Equal(t, rivertype.JobStatePending, jobRow(t, b, id).State)

	w, logs := strandedWorker(t, b, func() time.Time { return time.Now().Add(time.Hour) })
	out := requireStranded(t, b, w, false, 1, "a pending job long past its time")
	require.Len(t, out.Queues, 1)
	require.Equal(t, id, out.Queues[0].FirstJobID)
	require.Equal(t, string(rivertype.JobStatePending), out.Queues[0].State)
	require.Contains(t, logs.String(), "pending", "the fix names what keeps the job from running")

	requireStranded(t, b, w, false, 0, "counted once")
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
	b := reservedCalls(t)
	q := &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: "q1"}}
	cancelled := reserveOne(t, b, b.sched, q)
	discarded := reserveOne(t, b, b.sched, q)
	refunded := reserveOne(t, b, b.sched, q)
	started := reserveOne(t, b, b.sched, q)

	_, err := b.client.JobCancel(ctx, cancelled) // River's own cancel: no refund
	require.NoError(t, err)
	discardAsRiversScheduler(t, b, discarded)
	require.NoError(t, b.cancelTx(t, refunded, false))
	_, err = b.pool.Exec(ctx, `UPDATE river_job SET state = 'discarded', finalized_at = now(), attempt = 1, attempted_at = now() WHERE id = $1`, started)
	require.NoError(t, err)
	before := value(t, b, "calls", "k")

	w, logs := strandedWorker(t, b, func() time.Time { return time.Now().Add(time.Hour) })
	out := requireStranded(t, b, w, false, 2, "the cancelled and the discarded job")
	byState := map[string]int64{}
	for _, sq := range out.Queues {
		require.Equal(t, "q1", sq.Queue)
		byState[sq.State] = sq.FirstJobID
	}
	require.Equal(t, map[string]int64{"cancelled": cancelled, "discarded": discarded}, byState)
	require.Contains(t, logs.String(), "SettleTx", "the fix names the refund")

	// The refund the fix names works, once, and the check then has nothing more to say.
	for _, id := range []int64{cancelled, discarded} {
		require.NoError(t, b.settleTx(t, id, 0))
	}
	require.InDelta(t, before+10, value(t, b, "calls", "k"), 0.5)
	requireStranded(t, b, w, false, 0, "refunded, nothing more to say")
}

// TestStrandedWorkerReportsAJobStrandedAgain: a job found stranded, then run again (a client came
// back), that failed and was put back to wait in a queue no client works any more, is stranded a
// second time. The check marked it for good the first time and never reported it again.
func TestStrandedWorkerReportsAJobStrandedAgain(t *testing.T) {
	t.Parallel()
	b := reservedCalls(t)
	id := reserveOne(t, b, b.sched, nil)

	at := time.Now().Add(time.Hour)
	w, _ := strandedWorker(t, b, func() time.Time { return at })
	requireStranded(t, b, w, false, 1, "stranded")
	requireStranded(t, b, w, false, 0, "counted once while it stays stranded")

	// A client comes back and works the job, which fails: River puts it back to retry (available
	// when the retry is due within its scheduler's 5 s, else retryable).
	ran := workOnce(t, b, false, func(context.Context, *river.Job[callArgs]) error { return errors.New("the model is down") })
	require.Equal(t, id, ran)
	job := jobRow(t, b, id)
	require.Contains(t, []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStateRetryable}, job.State, "put back to retry")
	require.Equal(t, 1, job.Attempt)

	// Nothing works its queue any more: an hour past its retry it is stranded again.
	at = job.ScheduledAt.Add(time.Hour)
	out := requireStranded(t, b, w, false, 1, "stranded a second time")
	require.True(t, out.Queues[0].FirstScheduledAt.Equal(job.ScheduledAt), "%+v", out)
	requireStranded(t, b, w, false, 0, "and counted once again")
}

// TestCancelTxOfAJobRiverCancelledNamesTheRefund: CancelTx of a reserved job that River's own
// JobCancel cancelled before it started (no refund) said "job N was already cancelled", as if the
// refund had been given, to the operator the docs send to CancelTx. It is still refused (nothing
// written), and the error now says the reservation was not refunded and how to refund it.
func TestCancelTxOfAJobRiverCancelledNamesTheRefund(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := reservedCalls(t)
	id := reserveOne(t, b, b.sched, nil)
	_, err := b.client.JobCancel(ctx, id)
	require.NoError(t, err)
	err = b.cancelTx(t, id, false)
	var nc *scheduler.NotCancellableError
	require.ErrorAs(t, err, &nc)
	require.True(t, nc.Cancelled())
	require.False(t, nc.Settled)
	require.Contains(t, err.Error(), "SettleTx", "the error names the refund: %v", err)

	// A unique conflict River's scheduler discarded never ran: it said "already ran".
	discarded := reserveOne(t, b, b.sched, nil)
	discardAsRiversScheduler(t, b, discarded)
	err = b.cancelTx(t, discarded, false)
	require.ErrorAs(t, err, &nc)
	require.False(t, nc.Started, "it never started")
	require.Contains(t, err.Error(), "discarded by River before it started", "%v", err)

	// Once refunded (or cancelled by CancelTx), "already cancelled" is the whole story.
	require.NoError(t, b.settleTx(t, id, 0))
	err = b.cancelTx(t, id, false)
	require.ErrorAs(t, err, &nc)
	require.NotContains(t, err.Error(), "SettleTx", "%v", err)
}

// TestStrandedWorkerConcurrentChecksCountEachJobOnce runs four stranded checks at once, each in a
// transaction of its own, over 200 stranded jobs: together they count each job exactly once, and
// a fifth finds nothing left.
func TestStrandedWorkerConcurrentChecksCountEachJobOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Minute, MaxReserved: 10_000}}, maxConns: 16})
	const jobs = 200
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		for range jobs {
			if _, err := b.sched.ReserveTx(ctx, tx, "calls", "k", 1, callArgs{}, nil); err != nil {
				return err
			}
		}
		return nil
	}))
	w, _ := strandedWorker(t, b, func() time.Time { return time.Now().Add(24 * time.Hour) })
	tw := testdb.RiverWorker(t, b.pool, &river.Config{Logger: quietLogger()}, river.Worker[scheduler.StrandedArgs](w))

	var (
		wg    sync.WaitGroup
		total atomic.Int64
		start = make(chan struct{})
	)
	for range 4 {
		wg.Go(func() {
			<-start
			err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
				res, err := tw.Work(ctx, t, tx, scheduler.StrandedArgs{}, nil)
				if err != nil {
					return err
				}
				var out scheduler.StrandedOutput
				if err := json.Unmarshal(res.Job.Output(), &out); err != nil {
					return err
				}
				total.Add(out.Total)
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		})
	}
	close(start)
	wg.Wait()
	require.False(t, t.Failed())
	require.Equal(t, int64(jobs), total.Load())
	requireStranded(t, b, w, false, 0, "each counted once")
}
