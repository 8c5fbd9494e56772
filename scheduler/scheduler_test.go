package scheduler_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertest"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// A 10-per-minute bucket: one token every 6 s.
var perMinute10 = ratelimit.Config{Rate: 10, Period: time.Minute, MaxReserved: 20}

func TestReserveTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)

	// step 1: 10 tokens are there: the job runs now, nothing is scheduled.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 10, callArgs{N: 1}, nil)
		require.NoError(t, err)
		require.True(t, res.RetryAt.IsZero(), "RetryAt %s", res.RetryAt)
		require.True(t, res.ScheduledAt.IsZero())
		require.False(t, res.Results[0].Reserved)
		require.Equal(t, rivertype.JobStateAvailable, res.Job.State)
		return nil
	}))

	// step 2: empty: 5 tokens are due in 30 s; the job is inserted for then, in the transaction,
	// available (PreciseHook), and paid for its first attempt.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 5, callArgs{N: 2}, nil)
		require.NoError(t, err)
		want := t0.Add(30 * time.Second)
		require.Equal(t, want, res.RetryAt.UTC())
		require.Equal(t, want, res.ScheduledAt.UTC())
		require.True(t, res.Results[0].Reserved)
		rows := rivertest.RequireManyInsertedTx[*riverpgxv5.Driver](ctx, t, tx, []rivertest.ExpectedJob{
			{Args: &callArgs{}},
			{Args: &callArgs{}, Opts: &rivertest.RequireInsertedOpts{ScheduledAt: want, State: rivertype.JobStateAvailable}},
		})
		require.Equal(t, res.Job.ID, rows[1].ID)
		require.JSONEq(t, `{"n":2,"budget":{"name":"","reserved":0}}`, string(rows[1].EncodedArgs))
		require.JSONEq(t, `{"attempt":1}`, string(metadataValue(t, rows[1].Metadata, scheduler.MetadataKey)))
		return nil
	}))
	require.Equal(t, -5.0, value(t, b, "calls", "u1"))

	// step 3: with deterministic jitter, the job goes JitterFor(key, Jitter) after RetryAt.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 1, callArgs{N: 3}, &scheduler.ReserveOpts{Jitter: 10 * time.Second, JitterKey: "u1"})
		require.NoError(t, err)
		j := scheduler.JitterFor("u1", 10*time.Second)
		require.Equal(t, j, res.Jitter)
		require.Equal(t, t0.Add(36*time.Second), res.RetryAt.UTC())
		require.Equal(t, t0.Add(36*time.Second+j), res.ScheduledAt.UTC())
		require.Equal(t, t0.Add(36*time.Second+j), res.Job.ScheduledAt.UTC())
		return nil
	}))
	require.Len(t, jobs(t, b.client), 3)
}

func TestReserveTxRollback(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)

	for _, count := range []float64{3, 15} { // one that runs now, one that waits
		err := inTx(t, b.pool, true, func(tx pgx.Tx) error {
			_, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", count, callArgs{}, nil)
			require.NoError(t, err)
			rivertest.RequireInsertedTx[*riverpgxv5.Driver](ctx, t, tx, &callArgs{}, nil)
			return nil
		})
		require.NoError(t, err)
		rivertest.RequireNotInserted(ctx, t, riverpgxv5.New(b.pool), &callArgs{}, nil)
		require.Equal(t, 10.0, value(t, b, "calls", "u1"), "count %g: the reservation was rolled back", count)
	}
}

func TestReserveTxOverMaxReserved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)

	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 25, callArgs{N: 1}, nil) // 15 owed of 20
		return err
	}))
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 6, callArgs{N: 2}, nil) // 21 owed: denied
		require.Nil(t, res)
		var le *ratelimit.LimitedError
		require.ErrorAs(t, err, &le)
		require.True(t, ratelimit.IsLimited(err))
		require.Equal(t, "calls", le.Name)
		require.Equal(t, "u1", le.Key)
		// The reservation fits once 1 token has accrued, 6 s after t0: that is its RetryAt
		// (docs/spec.md §3), not 126 s after t0, when all 21 owed would have accrued.
		require.Equal(t, t0.Add(6*time.Second), le.RetryAt)
		// The transaction is untouched and still usable: the job of step 1 is the only one.
		rivertest.RequireNotInsertedTx[*riverpgxv5.Driver](ctx, t, tx, &callArgs{N: 2}, &rivertest.RequireInsertedOpts{ScheduledAt: le.RetryAt})
		return nil
	}))
	require.Len(t, jobs(t, b.client), 1)
	require.Equal(t, -15.0, value(t, b, "calls", "u1"))
}

func TestReserveManyTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{
		limits: map[string]ratelimit.Config{
			"calls":  perMinute10,                                                          // one token per 6 s
			"tokens": {Rate: 1000, Period: time.Minute, Capacity: 2000, MaxReserved: 1000}, // 1000 per minute
		},
		now: frozen(t0),
	})
	req := func(calls, tokens float64) []ratelimit.Request {
		return []ratelimit.Request{{Name: "calls", Key: "org", Count: calls}, {Name: "tokens", Key: "org", Count: tokens}}
	}

	// step 1: calls has its token, tokens owes 500, due 30 s after t0: the job goes then.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.ReserveManyTx(ctx, tx, req(1, 2500), callArgs{N: 1}, nil)
		require.NoError(t, err)
		require.False(t, res.Results[0].Reserved)
		require.True(t, res.Results[1].Reserved)
		require.Equal(t, t0.Add(30*time.Second), res.RetryAt.UTC())
		rivertest.RequireInsertedTx[*riverpgxv5.Driver](ctx, t, tx, &callArgs{}, &rivertest.RequireInsertedOpts{
			ScheduledAt: t0.Add(30 * time.Second), State: rivertype.JobStateAvailable,
		})
		return nil
	}))
	require.Equal(t, 9.0, value(t, b, "calls", "org"))
	require.Equal(t, -500.0, value(t, b, "tokens", "org"))

	// step 2: both wait; the job goes at the later RetryAt: calls owes 1 (6 s), tokens 600 (36 s).
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.ReserveManyTx(ctx, tx, req(10, 100), callArgs{N: 2}, nil)
		require.NoError(t, err)
		require.Equal(t, t0.Add(6*time.Second), res.Results[0].RetryAt.UTC())
		require.Equal(t, t0.Add(36*time.Second), res.Results[1].RetryAt.UTC())
		require.Equal(t, t0.Add(36*time.Second), res.ScheduledAt.UTC())
		return nil
	}))

	// step 3: tokens would owe 1100 > 1000: nothing is reserved on either limit, no job.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.ReserveManyTx(ctx, tx, req(1, 500), callArgs{N: 3}, nil)
		var le *ratelimit.LimitedError
		require.ErrorAs(t, err, &le)
		require.Len(t, le.Denied, 1)
		require.Equal(t, "tokens", le.Name)
		return nil
	}))
	require.Equal(t, -1.0, value(t, b, "calls", "org"))
	require.Equal(t, -600.0, value(t, b, "tokens", "org"))
	require.Len(t, jobs(t, b.client), 2)

	// step 4: rolled back, neither limit keeps the reservation.
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		_, err := b.sched.ReserveManyTx(ctx, tx, req(1, 1), callArgs{N: 4}, nil)
		return err
	}))
	require.Equal(t, -1.0, value(t, b, "calls", "org"))
	require.Equal(t, -600.0, value(t, b, "tokens", "org"))
	require.Len(t, jobs(t, b.client), 2)
}

func TestReserveTxNeedsPreciseHook(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	client := newClient(t, b.pool, &clientOpts{noHook: true})

	strict, err := scheduler.New(client, b.limiter, nil)
	require.NoError(t, err)
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		_, err := strict.ReserveTx(ctx, tx, "calls", "u1", 15, callArgs{}, nil)
		require.ErrorContains(t, err, "PreciseHook")
		return nil
	}))

	lax, err := scheduler.New(client, b.limiter, &scheduler.Config{AllowImprecise: true})
	require.NoError(t, err)
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		res, err := lax.ReserveTx(ctx, tx, "calls", "u1", 15, callArgs{}, nil)
		require.NoError(t, err)
		require.Equal(t, rivertype.JobStateScheduled, res.Job.State)
		return nil
	}))
}

type uniqueArgs struct {
	Doc string `json:"doc"`
}

func (uniqueArgs) Kind() string { return "txlimit_unique" }

func (uniqueArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
}

func TestReserveTxDuplicateIsCreditedBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	client, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil) // no Workers: it inserts uniqueArgs, a kind no worker works

	for i, want := range []bool{false, true} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := sched.ReserveTx(ctx, tx, "calls", "u1", 12, uniqueArgs{Doc: "d1"}, nil)
			require.NoError(t, err)
			require.Equal(t, want, res.Duplicate, "insert %d", i)
			return nil
		}))
		require.Equal(t, -2.0, value(t, b, "calls", "u1"), "insert %d", i)
	}
	require.Len(t, jobs(t, client), 1)
}

// TestReserveTxDuplicateReportsExistingJob: when River skips the insert as a duplicate, the
// reservation is credited back and the Reservation describes the existing job: its ScheduledAt,
// no RetryAt. Here the existing job runs now and the second call's reservation would have been
// due in 60 s; before, the Reservation said 60 s.
func TestReserveTxDuplicateReportsExistingJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
	for i, dup := range []bool{false, true} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := sched.ReserveTx(ctx, tx, "calls", "u1", 10, uniqueArgs{Doc: "d1"}, nil)
			require.NoError(t, err)
			require.Equal(t, dup, res.Duplicate, "insert %d", i)
			if dup {
				require.True(t, res.ScheduledAt.Equal(res.Job.ScheduledAt),
					"Reservation.ScheduledAt %s, but the job (the existing one) is due at %s", res.ScheduledAt, res.Job.ScheduledAt)
				require.True(t, res.RetryAt.IsZero(), "Reservation.RetryAt %s for tokens that were credited back", res.RetryAt)
				require.Zero(t, res.Jitter)
				require.Len(t, res.Results, 1)
			}
			return nil
		}))
	}
	require.Equal(t, 0.0, value(t, b, "calls", "u1"))
}

// laterArgs are args whose own InsertOpts schedule them at t0+50s.
type laterArgs struct{}

func (laterArgs) Kind() string { return "txlimit_later" }
func (laterArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{ScheduledAt: t0.Add(50 * time.Second)}
}

// TestReserveTxArgsScheduledAt: the args' own InsertOpts().ScheduledAt counts as River counts it
// (when ReserveOpts.InsertOpts sets none): a job whose tokens are there is due then, and so is a
// reserved one whose tokens accrue earlier, which no credit moves before it. A ScheduledAt of
// ReserveOpts.InsertOpts takes its place. Before, the reservation's time replaced it, and a job
// that ran at once reported no ScheduledAt though River scheduled it.
func TestReserveTxArgsScheduledAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil) // no Workers: it inserts laterArgs
	later := t0.Add(50 * time.Second)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		for i, c := range []struct {
			count   float64
			opts    *scheduler.ReserveOpts
			retryAt time.Time
			want    time.Time
		}{
			{count: 10, want: later},                                  // the tokens are there
			{count: 1, retryAt: t0.Add(6 * time.Second), want: later}, // due earlier than the args ask
			{count: 1, retryAt: t0.Add(12 * time.Second), want: t0.Add(20 * time.Second),
				opts: &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: t0.Add(20 * time.Second)}}},
		} {
			res, err := sched.ReserveTx(ctx, tx, "calls", "u1", c.count, laterArgs{}, c.opts)
			require.NoError(t, err, "step %d", i)
			require.Equal(t, c.retryAt, res.RetryAt.UTC(), "step %d", i)
			require.Equal(t, c.want, res.ScheduledAt.UTC(), "step %d", i)
			require.Equal(t, c.want, res.Job.ScheduledAt.UTC(), "step %d", i)
			var rec struct {
				NotBefore time.Time `json:"not_before"`
			}
			require.NoError(t, json.Unmarshal(metadataValue(t, res.Job.Metadata, scheduler.ReservedKey), &rec))
			require.Equal(t, c.want, rec.NotBefore.UTC(), "step %d: the job never moves before it", i)
		}
		return nil
	}))
}

// TestReserveTxConcurrent: 64 goroutines reserve and schedule against one budget, rolling back at
// random; exactly the committed reservations have jobs.
func TestReserveTxConcurrent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const (
		workers  = 64
		attempts = 4
		capacity = 50.0
	)
	cfg := ratelimit.Config{Rate: capacity, Period: time.Hour, MaxReserved: 100}
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": cfg}, now: frozen(t0), maxConns: 16})

	var (
		wg                                    sync.WaitGroup
		mu                                    sync.Mutex
		committed, rolledBack, denied, tokens int
	)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range attempts {
				count := 1 + rng.IntN(3)
				rollback := rng.IntN(3) == 0
				var limited bool
				err := func() error {
					tx, err := b.pool.Begin(ctx)
					if err != nil {
						return err
					}
					defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
					_, err = b.sched.ReserveTx(ctx, tx, "calls", "", float64(count), callArgs{N: count}, nil)
					limited = ratelimit.IsLimited(err)
					switch {
					case err != nil && !limited:
						return err
					case rollback:
						return errRollback
					}
					return tx.Commit(ctx)
				}()
				mu.Lock()
				switch {
				case errors.Is(err, errRollback):
					rolledBack++
				case err != nil:
					t.Errorf("worker %d: %v", w, err)
				case limited:
					denied++
				default:
					committed++
					tokens += count
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()

	t.Logf("committed %d (%d tokens), rolled back %d, denied %d", committed, tokens, rolledBack, denied)
	require.Greater(t, denied, 0, "the budget should run out")
	requireJobTokens(t, b, committed, tokens)
	require.Equal(t, capacity-float64(tokens), value(t, b, "calls", ""))
}

var errRollback = errors.New("rolled back on purpose")

// requireJobTokens requires the schema to hold n jobs whose args (callArgs.N) add up to tokens.
func requireJobTokens(t *testing.T, b *testBundle, n, tokens int) {
	t.Helper()
	all := jobs(t, b.client)
	jobTokens := 0
	for _, j := range all {
		var args callArgs
		require.NoError(t, jsonUnmarshal(j.EncodedArgs, &args))
		jobTokens += args.N
	}
	require.Len(t, all, n)
	require.Equal(t, tokens, jobTokens)
}

func TestReserveTxInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)

	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		bad := []struct {
			name  string
			tx    pgx.Tx
			args  river.JobArgs
			count float64
			opts  *scheduler.ReserveOpts
		}{
			{name: "nil tx", args: callArgs{}, count: 1},
			{name: "nil args", tx: tx, count: 1},
			{name: "zero count", tx: tx, args: callArgs{}},
			{name: "unknown limit", tx: tx, args: callArgs{}, count: 1, opts: &scheduler.ReserveOpts{}},
			{name: "metadata", tx: tx, args: callArgs{}, count: 1, opts: &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Metadata: []byte(`[1]`)}}},
			{name: "jitter", tx: tx, args: callArgs{}, count: 1, opts: &scheduler.ReserveOpts{Jitter: -time.Second}},
		}
		for _, c := range bad {
			name := "calls"
			if c.name == "unknown limit" {
				name = "nope"
			}
			_, err := b.sched.ReserveTx(ctx, c.tx, name, "u1", c.count, c.args, c.opts)
			require.ErrorIs(t, err, ratelimit.ErrInvalid, c.name)
		}
		// Nothing was written, and the transaction is still usable: the caller's metadata is kept
		// next to the payment.
		res, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 1, callArgs{}, &scheduler.ReserveOpts{
			InsertOpts: &river.InsertOpts{Metadata: []byte(`{"trace":"abc","n":12345678901234567890}`)},
		})
		require.NoError(t, err)
		require.JSONEq(t, `{"trace":"abc","n":12345678901234567890,"txlimit_paid":{"attempt":1},
			"txlimit_reserved":{"limits":[{"name":"calls","key":"u1","count":1}]}}`, string(res.Job.Metadata))
		return nil
	}))
	require.Equal(t, 9.0, value(t, b, "calls", "u1"))
	require.Len(t, jobs(t, b.client), 1)
}

type floatArgs struct {
	F float64 `json:"f"`
}

func (floatArgs) Kind() string { return "txlimit_float" }

// A job River refuses to insert (here: arguments JSON cannot encode, an invalid priority, a job
// missing its PreciseHook) leaves tx exactly as it was: the reservation made before the insert is
// rolled back with the savepoint, and committing tx writes nothing.
func TestReserveTxRefusedJobWritesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	noHook := b.noHookScheduler(t, nil)
	for _, c := range []struct {
		what  string
		call  func(tx pgx.Tx) error
		typed bool // an *ratelimit.ArgumentError
	}{
		{"args JSON cannot encode", func(tx pgx.Tx) error {
			_, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 15, floatArgs{F: math.NaN()}, nil)
			return err
		}, true},
		{"priority 9", func(tx pgx.Tx) error {
			_, err := b.sched.ReserveTx(ctx, tx, "calls", "u1", 15, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Priority: 9}})
			return err
		}, true},
		{"ReserveManyTx, queue name River refuses", func(tx pgx.Tx) error {
			_, err := b.sched.ReserveManyTx(ctx, tx, []ratelimit.Request{{Name: "calls", Key: "u1", Count: 15}}, callArgs{},
				&scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: "bad queue!"}})
			return err
		}, true},
		{"no PreciseHook", func(tx pgx.Tx) error {
			_, err := noHook.ReserveTx(ctx, tx, "calls", "u1", 15, callArgs{}, nil)
			return err
		}, false},
	} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { // committed
			err := c.call(tx)
			require.Error(t, err, c.what)
			var argErr *ratelimit.ArgumentError
			require.Equal(t, c.typed, errors.As(err, &argErr), "%s: %v", c.what, err)
			if c.typed {
				require.ErrorIs(t, err, ratelimit.ErrInvalid)
			}
			return nil
		}), c.what)
		require.Empty(t, jobs(t, b.client), c.what)
		require.Equal(t, 10.0, value(t, b, "calls", "u1"), "%s: nothing reserved", c.what)
	}
}

// llmArgs is a job whose own InsertOpts put it in queue "llm".
type llmArgs struct {
	N int `json:"n"`
}

func (llmArgs) Kind() string { return "txlimit_llm" }

func (llmArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{Queue: "llm"} }

// TestReserveTxUnworkedQueue (issue 31, item 2): with River's clients working only "llm", a
// reservation whose job would go to the default queue (no InsertOpts.Queue) is refused with
// ErrQueueNotWorked, and nothing is reserved: the limit has no row, no job exists, and the caller's
// transaction commits what it did itself.
func TestReserveTxUnworkedQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	client, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
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
	b.workQueues(t, "llm")
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

// TestReserveTxBeyondYear9999: an unbounded reservation can be due tens of thousands of years
// ahead (ratelimit bounds a wait at 2^61 µs), which a job's JSON metadata cannot hold: ReserveTx
// refuses it as bad input, and the transaction is as it was (nothing reserved, no job).
func TestReserveTxBeyondYear9999(t *testing.T) {
	t.Parallel()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Hour, MaxReserved: ratelimit.Unbounded})
	ctx := context.Background()
	err := inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.ReserveTx(ctx, tx, "calls", "k", 1e15, callArgs{}, nil)
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		require.ErrorContains(t, err, "after the year 9999")
		st, err := b.limiter.State(ctx, tx, "calls", "k", nil)
		require.NoError(t, err)
		require.Equal(t, 1.0, st.Value, "the savepoint rolled back: nothing reserved")
		return nil
	})
	require.NoError(t, err)
	var jobs int
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT count(*) FROM river_job").Scan(&jobs))
	require.Zero(t, jobs)
}

// TestReserveTxDropsCopiedBookkeeping: metadata copied from a job that was settled (to run it
// again with its own metadata, say) carries that job's "txlimit_settled", "txlimit_paid" and
// "txlimit_reserved". ReserveTx writes the package's keys anew and drops the others, so the new
// job's reservation is its own: not taken for settled, cancellable with its refund. Before, the
// copied settlement made CancelTx refuse it ("was settled already"), SettleTx fail on the other
// job's settlement, and the stranded check skip it: its tokens could never be given back.
func TestReserveTxDropsCopiedBookkeeping(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, tenPerSecond)
	first := reserve(t, b, "calls", "u1", 3)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.SettleTx(ctx, tx, first.Job.ID, 3)
		return err
	}))
	md := metadataMap(t, jobRow(t, b, first.Job.ID).Metadata) // {"txlimit_paid", "txlimit_reserved", "txlimit_settled"}
	require.Contains(t, md, scheduler.SettledKey)
	md[scheduler.StrandedKey] = map[string]any{"at": "2024-01-01T12:00:00Z"}
	md["trace"] = "abc"
	copied, err := json.Marshal(md)
	require.NoError(t, err)

	var again *scheduler.Reservation
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		again, err = b.sched.ReserveTx(ctx, tx, "calls", "u1", 4, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Metadata: copied}})
		return err
	}))
	require.JSONEq(t, `{"trace":"abc","txlimit_paid":{"attempt":1},
		"txlimit_reserved":{"limits":[{"name":"calls","key":"u1","count":4}]}}`, string(jobRow(t, b, again.Job.ID).Metadata))
	require.Equal(t, 3.0, value(t, b, "calls", "u1"))
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		out, err := b.sched.CancelTx(ctx, tx, again.Job.ID)
		require.NoError(t, err, "the new job's 4 tokens cannot be refunded")
		require.Equal(t, 4.0, out.Limits[0].Credited)
		return nil
	}))
	require.Equal(t, 7.0, value(t, b, "calls", "u1"))
}

// TestReserveTxInvalidQueueIsBadInput: a queue name River refuses is bad input (ratelimit.ErrInvalid,
// nothing written), checked before whether a client works the queue. Before, once River's queue
// table listed a queue, it was a *SetupError (ErrQueueNotWorked) whose fix said to add "bad queue!"
// to river.Config.Queues, a name River refuses there too. New, Check and Housekeeping check the
// queues they are given the same way.
func TestReserveTxInvalidQueueIsBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
	b.workQueues(t, "llm")
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := sched.ReserveTx(ctx, tx, "calls", "u1", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: "bad queue!"}})
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		require.NotErrorIs(t, err, scheduler.ErrQueueNotWorked)
		require.EqualError(t, err, `scheduler: ReserveTx: ReserveOpts.InsertOpts.Queue is "bad queue!", a queue name River refuses: `+
			`use lower-case letters and digits, runs of them joined by one '_', '-' or '|', at most 64 characters`)
		_, err = sched.ReserveManyTx(ctx, tx, []ratelimit.Request{{Name: "calls", Key: "u1"}}, badQueueArgs{}, nil)
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		require.ErrorContains(t, err, "args' InsertOpts().Queue")
		require.ErrorIs(t, sched.Check(ctx, tx, badQueueArgs{}), ratelimit.ErrInvalid)
		return nil
	}))
	require.Equal(t, 10.0, value(t, b, "calls", "u1"))
	require.Empty(t, jobs(t, b.client))

	_, err := scheduler.New(b.client, b.limiter, &scheduler.Config{Queues: []string{"llm", "LLM"}})
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	require.ErrorContains(t, err, "Config.Queues[1]")
	_, err = scheduler.Housekeeping(river.NewWorkers(), b.limiter, b.pool, &scheduler.HousekeepingConfig{Queue: "-llm"})
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
}

// badQueueArgs are args whose own InsertOpts name a queue River refuses.
type badQueueArgs struct{}

func (badQueueArgs) Kind() string                 { return "txlimit_bad_queue" }
func (badQueueArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{Queue: "Bad"} }

// TestQueueNameRuleIsRivers: the package's check of a queue name accepts exactly the names River
// accepts (River's own check, which it does not export, runs on river.Config.Queues in NewClient).
func TestQueueNameRuleIsRivers(t *testing.T) {
	t.Parallel()
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { return nil }))
	pool, err := pgxpool.New(context.Background(), "postgres://localhost/unused") // River wants one; it never connects
	require.NoError(t, err)
	defer pool.Close()
	for _, name := range []string{"default", "llm", "a", "0", "a1", "a_b", "a-b", "a|b", "a_b-c|d", "a__b", "a-_b",
		"_a", "a_", "-a", "a-", "A", "llM", "a b", "a.b", "a/b", "bad queue!", "ü", "a\n",
		strings.Repeat("a", 64), strings.Repeat("a", 65), strings.Repeat("ab-", 21) + "a", strings.Repeat("ab-", 21) + "ab"} {
		_, riverErr := river.NewClient(riverpgxv5.New(pool), &river.Config{
			Queues:  map[string]river.QueueConfig{name: {MaxWorkers: 1}},
			Workers: workers,
			Logger:  quietLogger(),
		})
		ours := scheduler.CheckQueueName(name)
		require.Equal(t, riverErr == nil, ours == nil, "queue %q: River says %v, the package %v", name, riverErr, ours)
		if ours != nil {
			require.ErrorIs(t, ours, ratelimit.ErrInvalid)
		}
	}
}

// TestReserveTxScheduledAtBeyondYear9999: a caller's ScheduledAt after the year 9999 (which the
// job's metadata cannot hold) is an *ArgumentError naming it, not the count of one token there now.
func TestReserveTxScheduledAtBeyondYear9999(t *testing.T) {
	t.Parallel()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Hour, MaxReserved: 10})
	ctx := context.Background()
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		far := time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)
		_, err := b.sched.ReserveTx(ctx, tx, "calls", "", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: far}})
		var ae *ratelimit.ArgumentError
		require.ErrorAs(t, err, &ae)
		require.Equal(t, "ReserveOpts.InsertOpts.ScheduledAt", ae.Arg, "error: %v", err)
		return nil
	}))
}

// TestReserveTxSerializableSharded reserves on a sharded limit from 12 goroutines, each
// reservation in InSerializableTx (serialization failures and busy shards retried), a third of them
// failing after the reservation so that the transaction rolls back: the committed jobs hold
// exactly the tokens the limit lost, a rolled-back one neither job nor tokens.
func TestReserveTxSerializableSharded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := ratelimit.Config{Rate: 40, Period: time.Hour, Shards: 4, MaxReserved: 1000}
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": cfg}, now: frozen(t0), maxConns: 16})

	var (
		wg            sync.WaitGroup
		mu            sync.Mutex
		tokens, calls int
		start         = make(chan struct{})
	)
	for w := range 12 {
		wg.Go(func() {
			<-start
			rng := rand.New(rand.NewPCG(uint64(w), 3))
			for range 6 {
				count := 1 + rng.IntN(3)
				rollback := rng.IntN(3) == 0
				err := ratelimit.InSerializableTx(ctx, b.pool, &ratelimit.TxOpts{MaxAttempts: 50}, func(ctx context.Context, tx pgx.Tx) error {
					if _, err := b.sched.ReserveTx(ctx, tx, "calls", "hot", float64(count), callArgs{N: count}, nil); err != nil {
						return err
					}
					if rollback {
						return errRollback
					}
					return nil
				})
				switch {
				case errors.Is(err, errRollback):
				case err != nil:
					t.Errorf("worker %d: %v", w, err)
				default:
					mu.Lock()
					tokens += count
					calls++
					mu.Unlock()
				}
			}
		})
	}
	close(start)
	wg.Wait()
	require.False(t, t.Failed())

	requireJobTokens(t, b, calls, tokens)
	require.Equal(t, 40-float64(tokens), value(t, b, "calls", "hot"))
	t.Logf("%d jobs, %d tokens", calls, tokens)
}
