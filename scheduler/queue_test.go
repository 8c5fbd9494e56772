package scheduler_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// llmArgs is a job whose own InsertOpts put it in queue "llm".
type llmArgs struct {
	N int `json:"n"`
}

func (llmArgs) Kind() string { return "txlimit_llm" }

func (llmArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{Queue: "llm"} }

// workQueues starts and stops a River client that works queues, so that River's queue table lists
// them, as it does once a worker process has run.
func workQueues(t *testing.T, pool *pgxpool.Pool, c conn, queues ...string) {
	t.Helper()
	ctx := context.Background()
	qs := map[string]river.QueueConfig{}
	for _, q := range queues {
		qs[q] = scheduler.PreciseQueue(1)
	}
	client := newClient(t, pool, &clientOpts{queues: qs, pollOnly: c.bouncer})
	require.NoError(t, client.Start(ctx))
	require.NoError(t, client.Stop(ctx))
}

// TestReserveTxUnworkedQueue (issue 31, item 2): with River's clients working only "llm", a
// reservation whose job would go to the default queue (no InsertOpts.Queue) is refused with
// ErrQueueNotWorked, and nothing is reserved: the limit has no row, no job exists, and the caller's
// transaction commits what it did itself.
func TestReserveTxUnworkedQueue(t *testing.T) { direct(t, unworkedQueue) }

func unworkedQueue(t *testing.T, c conn) {
	ctx := context.Background()
	b := setupCalls(t, perMinute10, c)
	client := insertOnly(t, b.pool)
	sched, err := scheduler.New(client, b.limiter, nil)
	require.NoError(t, err)
	reserveIn := func(tx pgx.Tx, args river.JobArgs, queue string) (*scheduler.Reservation, error) {
		var opts *scheduler.ReserveOpts
		if queue != "" {
			opts = &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: queue}}
		}
		return sched.ReserveTx(ctx, tx, "calls", "u1", 15, args, opts) // 5 owed: a reservation
	}

	// step 1: River's queue table lists no queue (no client has worked one yet): nothing to go by,
	// nothing refused (rolled back).
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		_, err := reserveIn(tx, callArgs{}, "")
		return err
	}))

	// step 2: a worker process works only "llm". A job for the default queue is refused before
	// anything is reserved, by ReserveTx and ReserveManyTx, and by Check for args of that queue.
	workQueues(t, b.pool, c, "llm")
	const want = `scheduler: ReserveTx: insert the job into a queue River's clients work ("llm") with ReserveOpts.InsertOpts.Queue, ` +
		`or add "default" to river.Config.Queues of a client (no River client works the job's queue "default")`
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := reserveIn(tx, callArgs{}, "")
		require.Nil(t, res)
		require.EqualError(t, err, want)
		var se *scheduler.SetupError
		require.ErrorAs(t, err, &se)
		require.Equal(t, "default", se.Queue)
		require.ErrorIs(t, err, scheduler.ErrQueueNotWorked)
		require.ErrorIs(t, err, scheduler.ErrSetup)
		require.NotErrorIs(t, err, ratelimit.ErrInvalid)
		_, err = sched.ReserveManyTx(ctx, tx, []ratelimit.Request{{Name: "calls", Key: "u1", Count: 15}}, callArgs{}, nil)
		require.ErrorIs(t, err, scheduler.ErrQueueNotWorked)
		_, err = reserveIn(tx, callArgs{}, "other")
		require.ErrorIs(t, err, scheduler.ErrQueueNotWorked)
		// The transaction is as it was, and usable: its own write commits.
		_, err = b.limiter.LimitN(ctx, tx, "calls", "mine", 1, nil)
		return err
	}))
	require.Equal(t, 1, testdb.CountRows(t, b.pool), "only the caller's own row: the refused calls wrote none")
	require.Equal(t, 10.0, value(t, b, "calls", "u1"), "nothing reserved")
	require.Empty(t, jobs(t, client), "no job")
	require.ErrorIs(t, sched.Check(ctx, b.pool, callArgs{}), scheduler.ErrQueueNotWorked)

	// step 3: into "llm", named per call or by the args' own InsertOpts, it is reserved.
	require.NoError(t, sched.Check(ctx, b.pool, llmArgs{}))
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := reserveIn(tx, callArgs{}, "llm")
		require.NoError(t, err)
		require.Equal(t, "llm", res.Job.Queue)
		require.Equal(t, t0.Add(30*time.Second), res.ScheduledAt.UTC()) // 5 owed at one per 6 s
		res, err = reserveIn(tx, llmArgs{}, "")
		require.NoError(t, err)
		require.Equal(t, "llm", res.Job.Queue)
		return nil
	}))
	require.Equal(t, -20.0, value(t, b, "calls", "u1"))
	require.Len(t, jobs(t, client), 2)

	// step 4: Config.Queues names the worked queues: another is refused without asking the
	// database; Check also finds a listed queue River's clients do not work.
	listed, err := scheduler.New(client, b.limiter, &scheduler.Config{Queues: []string{"llm", "batch"}})
	require.NoError(t, err)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := listed.ReserveTx(ctx, tx, "calls", "u2", 15, callArgs{}, nil)
		require.EqualError(t, err, `scheduler: ReserveTx: insert the job into one of scheduler.Config.Queues ("llm", "batch") with ReserveOpts.InsertOpts.Queue, `+
			`or have a River client work "default" and add it to scheduler.Config.Queues (no River client works the job's queue "default")`)
		_, err = listed.ReserveTx(ctx, tx, "calls", "u2", 15, llmArgs{}, nil)
		return err
	}))
	require.Equal(t, -5.0, value(t, b, "calls", "u2"))
	err = listed.Check(ctx, b.pool, llmArgs{})
	require.EqualError(t, err, `scheduler: Check: have a River client work "batch" (river.Config.Queues; River's clients work "llm"), `+
		`or remove it from scheduler.Config.Queues (no River client works the job's queue "batch")`)
	_, err = scheduler.New(client, b.limiter, &scheduler.Config{Queues: []string{"llm", ""}})
	require.EqualError(t, err, `scheduler: New: Config.Queues[1] is empty: name a queue your River clients work, e.g. river.QueueDefault`)
}
