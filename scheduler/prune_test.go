package scheduler_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertest"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// pruneLimits are the limits of the prune tests; "llm" reserves, so its MaxReserved is explicit.
var pruneLimits = map[string]ratelimit.Config{
	"tb":  {Rate: 10, Period: time.Second},
	"fw":  {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute},
	"fws": {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0},
	"llm": {Rate: 100, Period: time.Minute, MaxReserved: 300},
}

// syncBuffer is a log sink safe for the worker's goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// mutableClock is a limiter clock the test moves.
type mutableClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *mutableClock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *mutableClock) Set(t time.Time) { c.mu.Lock(); defer c.mu.Unlock(); c.t = t }

// workJob runs one job of w with rivertest's worker, in a transaction that commits (or rolls back
// when rollback is set), and returns the output it recorded.
func workJob[A river.JobArgs, O any](t *testing.T, b *testBundle, w river.Worker[A], args A, rollback bool) O {
	t.Helper()
	tw := rivertest.NewWorker(t, riverpgxv5.New(b.pool), &river.Config{Logger: quietLogger()}, w)
	var res *rivertest.WorkResult
	require.NoError(t, inTx(t, b.pool, rollback, func(tx pgx.Tx) error {
		var err error
		res, err = tw.Work(context.Background(), t, tx, args, nil)
		return err
	}))
	require.Equal(t, river.EventKindJobCompleted, res.EventKind)
	var out O
	require.NoError(t, json.Unmarshal(res.Job.Output(), &out))
	return out
}

// workPrune runs one prune job and returns its recorded output.
func workPrune(t *testing.T, b *testBundle, w *scheduler.PruneWorker) scheduler.PruneOutput {
	t.Helper()
	return workJob[scheduler.PruneArgs, scheduler.PruneOutput](t, b, w, scheduler.PruneArgs{}, false)
}

func TestPruneJob(t *testing.T) {
	t.Parallel()
	clock := &mutableClock{t: t0}
	b := setup(t, &setupOpts{limits: pruneLimits, now: clock.Now})
	ctx := context.Background()
	take := func(name, key string, n float64) {
		t.Helper()
		r, err := b.limiter.LimitN(ctx, b.pool, name, key, n, &ratelimit.LimitOpts{Reserve: name == "llm"})
		require.NoError(t, err)
		require.True(t, r.OK)
	}
	take("tb", "a", 3)
	take("tb", "b", 10)
	take("fws", "a", 5)
	take("llm", "org", 350) // 250 owed: refilled after 3m30s
	var logs syncBuffer
	w, err := scheduler.NewPruneWorker(b.limiter, b.pool, &scheduler.HousekeepingConfig{
		PruneBatchSize: 1, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)

	clock.Set(t0.Add(90 * time.Second)) // tb and fws full again, llm still owes
	out := workPrune(t, b, w)
	require.Equal(t, scheduler.PruneOutput{Deleted: map[string]int64{"tb": 2, "fw": 0, "fws": 1, "llm": 0}, Total: 3}, out)
	require.Contains(t, logs.String(), "msg=\"txlimit: pruned\"")
	require.Contains(t, logs.String(), "total=3 deleted.fw=0 deleted.fws=1 deleted.llm=0 deleted.tb=2")
	require.Equal(t, 1, testdb.CountRows(t, b.pool))

	clock.Set(t0.Add(4 * time.Minute))
	out = workPrune(t, b, w)
	require.Equal(t, int64(1), out.Total)
	require.Equal(t, 0, testdb.CountRows(t, b.pool))
}

func TestHousekeepingErrors(t *testing.T) {
	t.Parallel()
	lim, err := ratelimit.New(nil)
	require.NoError(t, err)
	pool := testdb.Pool(t, nil)
	for i, c := range []struct {
		workers *river.Workers
		lim     *ratelimit.Limiter
		db      ratelimit.Executor
		config  *scheduler.HousekeepingConfig
		want    string
	}{
		{lim: lim, db: pool, want: "scheduler: Housekeeping: workers is nil: pass the *river.Workers of the client that works HousekeepingConfig.Queue"},
		{workers: river.NewWorkers(), db: pool, want: "scheduler: Housekeeping: limiter is nil: pass the *ratelimit.Limiter whose limits to prune"},
		{workers: river.NewWorkers(), lim: lim, want: "scheduler: Housekeeping: db is nil: pass the *pgxpool.Pool of the River client"},
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{PruneInterval: -time.Second},
			want: "scheduler: Housekeeping: HousekeepingConfig.PruneInterval must not be negative, got -1s"},
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{PruneTimeout: -time.Second},
			want: "scheduler: Housekeeping: HousekeepingConfig.PruneTimeout must not be negative, got -1s"},
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{PruneBatchSize: -1},
			want: "scheduler: Housekeeping: HousekeepingConfig.PruneBatchSize must not be negative, got -1"},
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{StrandedAfter: -time.Second},
			want: "scheduler: Housekeeping: HousekeepingConfig.StrandedAfter must not be negative, got -1s"},
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{StrandedInterval: -time.Second},
			want: "scheduler: Housekeeping: HousekeepingConfig.StrandedInterval must not be negative, got -1s"},
	} {
		jobs, err := scheduler.Housekeeping(c.workers, c.lim, c.db, c.config)
		require.EqualError(t, err, c.want, "case %d", i)
		require.ErrorIs(t, err, ratelimit.ErrInvalid, "case %d", i)
		require.Nil(t, jobs, "case %d", i)
	}
	workers := river.NewWorkers()
	jobs, err := scheduler.Housekeeping(workers, lim, pool, nil)
	require.NoError(t, err)
	require.Len(t, jobs, 2)
	// The workers are registered: a second registration on the same Workers is River's error.
	_, err = scheduler.Housekeeping(workers, lim, pool, nil)
	require.ErrorContains(t, err, "txlimit_prune")
	require.NotErrorIs(t, err, ratelimit.ErrInvalid)
}

// TestPruneJobNeverChangesADecision runs the same calls at the same injected times on two schemas;
// on one, the prune job runs before every step. Every Result is identical, and the job did delete
// rows, so the comparison means something. (Sharded limits are compared in ratelimit's own prune
// tests, where the shard picks can be fixed.)
func TestPruneJobNeverChangesADecision(t *testing.T) {
	t.Parallel()
	type call struct {
		at        time.Duration
		name, key string
		count     float64
		many      bool // LimitMany of this and "tb"/key
		credit    bool
	}
	calls := []call{
		{at: 0, name: "tb", key: "a", count: 7},
		{at: 0, name: "fw", key: "a", count: 5},
		{at: 0, name: "fws", key: "a", count: 3},
		{at: 0, name: "llm", key: "o", count: 250},
		{at: 500 * time.Millisecond, name: "tb", key: "a", count: 9},
		{at: 2 * time.Second, name: "tb", key: "a", count: 10},
		{at: 2 * time.Second, name: "fws", key: "b", count: 1, many: true},
		{at: time.Minute, name: "fws", key: "a", count: 5},
		{at: 61 * time.Second, name: "fw", key: "a", count: 5},
		{at: 61 * time.Second, name: "llm", key: "o", count: 100},
		{at: 62 * time.Second, name: "llm", key: "o", count: 30, credit: true},
		{at: 2 * time.Minute, name: "fw", key: "a", count: 4},
		{at: 2*time.Minute + 300*time.Millisecond, name: "tb", key: "a", count: 3},
		{at: 5 * time.Minute, name: "llm", key: "o", count: 400},
		{at: time.Hour, name: "fws", key: "a", count: 5, many: true},
		{at: time.Hour, name: "tb", key: "a", count: 10},
		{at: time.Hour + time.Second, name: "fw", key: "a", count: 1},
	}
	run := func(prune bool) ([]any, int64) {
		clock := &mutableClock{t: t0}
		b := setup(t, &setupOpts{limits: pruneLimits, now: clock.Now})
		ctx := context.Background()
		w, err := scheduler.NewPruneWorker(b.limiter, b.pool, &scheduler.HousekeepingConfig{Logger: quietLogger()})
		require.NoError(t, err)
		var out []any
		var pruned int64
		for i, c := range calls {
			clock.Set(t0.Add(c.at))
			if prune {
				pruned += workPrune(t, b, w).Total
			}
			var res any
			switch {
			case c.credit:
				res, err = b.limiter.Credit(ctx, b.pool, c.name, c.key, c.count, nil)
			case c.many:
				res, err = b.limiter.LimitMany(ctx, b.pool, []ratelimit.Request{
					{Name: c.name, Key: c.key, Count: c.count}, {Name: "tb", Key: c.key, Count: 2},
				}, nil)
			default:
				res, err = b.limiter.LimitN(ctx, b.pool, c.name, c.key, c.count, &ratelimit.LimitOpts{Reserve: c.name == "llm"})
			}
			require.NoError(t, err, "step %d", i)
			out = append(out, res)
		}
		for _, k := range [][2]string{{"tb", "a"}, {"fw", "a"}, {"fws", "a"}, {"fws", "b"}, {"llm", "o"}, {"tb", "b"}} {
			out = append(out, value(t, b, k[0], k[1]))
		}
		return out, pruned
	}
	want, _ := run(false)
	got, pruned := run(true)
	t.Logf("the job pruned %d rows over %d steps", pruned, len(calls))
	require.Greater(t, pruned, int64(3), "the job pruned too little for the comparison to mean anything")
	for i := range want {
		require.Equal(t, want[i], got[i], "step %d", i)
	}
}
