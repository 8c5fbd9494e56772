package scheduler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertest"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/txlimit/txlimit/internal/metrictest"
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
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
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
	client := testdb.RiverClient(t, b.pool, &river.Config{
		Logger:       quietLogger(),
		PeriodicJobs: jobs,
		PollOnly:     runConn.bouncer, // as newClient's
		Queues:       map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}},
		TestOnly:     true,
		Workers:      workers,
	})
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

// pruneLimits are the limits of the prune tests; "llm" reserves, so its MaxReserved is explicit.
var pruneLimits = map[string]ratelimit.Config{
	"tb":  {Rate: 10, Period: time.Second},
	"fw":  {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute},
	"fws": {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0},
	"llm": {Rate: 100, Period: time.Minute, MaxReserved: 300},
}

// runStranded runs one stranded check with w (as workJob, rolled back when rollback is set) and
// returns what it found.
func runStranded(t *testing.T, b *testBundle, w river.Worker[scheduler.StrandedArgs], rollback bool) scheduler.StrandedOutput {
	t.Helper()
	return workJob[scheduler.StrandedArgs, scheduler.StrandedOutput](t, b, w, scheduler.StrandedArgs{}, rollback)
}

// requireStranded runs one stranded check as runStranded does, requires it to count want jobs
// (why says why that many), and returns what it found.
func requireStranded(t *testing.T, b *testBundle, w river.Worker[scheduler.StrandedArgs], rollback bool, want int64, why string) scheduler.StrandedOutput {
	t.Helper()
	out := runStranded(t, b, w, rollback)
	require.Equal(t, want, out.Total, "%s: %+v", why, out)
	return out
}

// workJob runs one job of w with rivertest's worker, in a transaction that commits (or rolls back
// when rollback is set), and returns the output it recorded.
func workJob[A river.JobArgs, O any](t *testing.T, b *testBundle, w river.Worker[A], args A, rollback bool) O {
	t.Helper()
	tw := testdb.RiverWorker(t, b.pool, &river.Config{Logger: quietLogger()}, w)
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
	clock := newTestClock(t0)
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
	var logs metrictest.Logs
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
	pool := runConn.pool(t, 8, txlimitTables)
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
		// Under a second, River refuses the job's unique period (below) at every insert, and logs it:
		// the job never ran, and Housekeeping said nothing.
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{PruneInterval: 500 * time.Millisecond},
			want: "scheduler: Housekeeping: HousekeepingConfig.PruneInterval must be 0 (the default) or at least 1s, the shortest unique period River takes, got 500ms"},
		{workers: river.NewWorkers(), lim: lim, db: pool, config: &scheduler.HousekeepingConfig{StrandedInterval: time.Second - time.Nanosecond},
			want: "scheduler: Housekeeping: HousekeepingConfig.StrandedInterval must be 0 (the default) or at least 1s, the shortest unique period River takes, got 999.999999ms"},
	} {
		jobs, err := scheduler.Housekeeping(c.workers, c.lim, c.db, c.config)
		require.EqualError(t, err, c.want, "case %d", i)
		require.ErrorIs(t, err, ratelimit.ErrInvalid, "case %d", i)
		require.Nil(t, jobs, "case %d", i)
	}
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Second})
	_, err = b.client.Insert(context.Background(), callArgs{}, &river.InsertOpts{UniqueOpts: river.UniqueOpts{ByPeriod: 500 * time.Millisecond}})
	require.ErrorContains(t, err, "ByPeriod should not be less than 1 second")
	_, err = scheduler.Housekeeping(river.NewWorkers(), lim, pool, &scheduler.HousekeepingConfig{PruneInterval: time.Second, StrandedInterval: time.Second})
	require.NoError(t, err)
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
		clock := newTestClock(t0)
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

// strandedCount returns the counter txlimit.scheduler.stranded of queue (0 if none).
func strandedCount(t *testing.T, reader *sdkmetric.ManualReader, queue string) int64 {
	t.Helper()
	rm := metrictest.Collect(t, reader)
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, "github.com/txlimit/txlimit/scheduler", sm.Scope.Name)
	}
	return metrictest.Sum(t, rm, "txlimit.scheduler.stranded", attribute.String("txlimit.queue", queue))
}

// TestStrandedWorker (issue 31, item 2): reserved jobs not started a minute (After) past their
// time are counted once each, by queue, logged with the fix, recorded as the job's output, and
// marked; a job due exactly After ago, a cancelled job and a job counted before are not.
func TestStrandedWorker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	// A client has worked the default queue (River's queue table lists it), none "orphan"; the
	// Scheduler is told, wrongly, that both are worked.
	b.workQueues(t, river.QueueDefault)
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, &scheduler.Config{Queues: []string{"orphan", river.QueueDefault}})

	// The bucket is empty at t0; each reservation of 5 waits 30 s more (one token per 6 s).
	_, err := b.limiter.LimitN(ctx, b.pool, "calls", "k", 10, nil)
	require.NoError(t, err)
	var ids []int64
	for i, queue := range []string{"orphan", "orphan", river.QueueDefault, "orphan"} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := sched.ReserveTx(ctx, tx, "calls", "k", 5, callArgs{N: i}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: queue}})
			if err == nil {
				require.Equal(t, t0.Add(time.Duration(i+1)*30*time.Second), res.ScheduledAt.UTC(), "job %d", i)
				ids = append(ids, res.Job.ID)
			}
			return err
		}))
	}
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { // the last one is cancelled
		_, err := sched.CancelTx(ctx, tx, ids[3])
		return err
	}))
	var logs metrictest.Logs
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	reader := sdkmetric.NewManualReader()
	var now time.Time
	w, err := scheduler.NewStrandedWorker(b.pool, &scheduler.HousekeepingConfig{
		StrandedAfter: time.Minute, Logger: logger, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
	}, func() time.Time { return now })
	require.NoError(t, err)
	check := func(at time.Time) scheduler.StrandedOutput {
		t.Helper()
		now = at
		return runStranded(t, b, w, true)
	}
	orphanFix := `"no River client works queue \"orphan\": add it to river.Config.Queues of a client, or cancel the jobs with Scheduler.CancelTx to refund their tokens ` +
		`(a job that had started when its client stopped may have done its work: settle it with Scheduler.SettleTx instead)"`
	defaultFix := `"River's clients work queue \"default\" but did not start these jobs: see whether its clients are stopped, the queue paused (QueuePause) or its workers behind"`
	line := func(queue string, jobs, id int64, at time.Time, worked bool, fix string) string {
		return fmt.Sprintf(`level=WARN msg="txlimit: reserved jobs stranded" queue=%s jobs=%d first_job_id=%d first_scheduled_at=%s worked=%t fix=%s`,
			queue, jobs, id, at.Format("2006-01-02T15:04:05.000Z07:00"), worked, fix)
	}

	steps := []struct {
		now      time.Time
		want     scheduler.StrandedOutput
		logs     []string
		counters map[string]int64 // txlimit.scheduler.stranded by queue, cumulative
	}{
		// step 0: the first job was due at t0+30s, exactly After ago: not yet stranded.
		{now: t0.Add(90 * time.Second), want: scheduler.StrandedOutput{Queues: []scheduler.StrandedQueue{}},
			counters: map[string]int64{"orphan": 0, "default": 0}},
		// step 1: a microsecond later it is.
		{now: t0.Add(90*time.Second + time.Microsecond), want: scheduler.StrandedOutput{Total: 1, Queues: []scheduler.StrandedQueue{
			{Queue: "orphan", Jobs: 1, FirstJobID: ids[0], FirstScheduledAt: t0.Add(30 * time.Second)},
		}}, logs: []string{line("orphan", 1, ids[0], t0.Add(30*time.Second), false, orphanFix)},
			counters: map[string]int64{"orphan": 1, "default": 0}},
		// step 2: the second and third; not the first again, nor the cancelled fourth (due t0+2m).
		{now: t0.Add(4 * time.Minute), want: scheduler.StrandedOutput{Total: 2, Queues: []scheduler.StrandedQueue{
			{Queue: "default", Jobs: 1, FirstJobID: ids[2], FirstScheduledAt: t0.Add(90 * time.Second), Worked: true},
			{Queue: "orphan", Jobs: 1, FirstJobID: ids[1], FirstScheduledAt: t0.Add(60 * time.Second)},
		}}, logs: []string{
			line("default", 1, ids[2], t0.Add(90*time.Second), true, defaultFix),
			line("orphan", 1, ids[1], t0.Add(60*time.Second), false, orphanFix),
		}, counters: map[string]int64{"orphan": 2, "default": 1}},
		// step 3: an hour later, nothing new.
		{now: t0.Add(time.Hour), want: scheduler.StrandedOutput{Queues: []scheduler.StrandedQueue{}},
			counters: map[string]int64{"orphan": 2, "default": 1}},
	}
	for i, s := range steps {
		before := len(logs.String())
		got := check(s.now)
		require.Equal(t, s.want, got, "step %d", i)
		var lines []string
		if out := strings.TrimSpace(logs.String()[before:]); out != "" {
			lines = strings.Split(out, "\n")
		}
		require.Equal(t, s.logs, lines, "step %d", i)
		for queue, n := range s.counters {
			require.Equal(t, n, strandedCount(t, reader, queue), "step %d: %s of %s", i, "txlimit.scheduler.stranded", queue)
		}
	}

	// The first job carries when it was found; the cancelled one carries nothing.
	var mark struct {
		At time.Time `json:"at"`
	}
	require.NoError(t, json.Unmarshal(metadataValue(t, jobRow(t, b, ids[0]).Metadata, scheduler.StrandedKey), &mark))
	require.True(t, mark.At.Equal(t0.Add(90*time.Second+time.Microsecond)), "marked at %s", mark.At)
	require.Nil(t, metadataValue(t, jobRow(t, b, ids[3]).Metadata, scheduler.StrandedKey))
}

// TestStrandedWorkerFindsAnInterruptedJob: a reserved job that had started when its client
// stopped (a deploy) is put back by River as available, attempted; when no client works its queue
// any more its tokens stay reserved, so the stranded check reports it like one never started.
// CancelTx refuses it (its work may have been done); SettleTx settles it, and the check then
// leaves it alone.
func TestStrandedWorkerFindsAnInterruptedJob(t *testing.T) {
	t.Parallel()
	b := reservedCalls(t)
	id := reserveOne(t, b, b.sched, nil)
	ran := workOnce(t, b, true, func(ctx context.Context, _ *river.Job[callArgs]) error {
		<-ctx.Done() // a long call, cut short by the client stopping
		return ctx.Err()
	})
	require.Equal(t, id, ran)
	job := jobRow(t, b, id)
	require.NotNil(t, job.AttemptedAt, "the job started")
	require.InDelta(t, 5.0, 10-value(t, b, "calls", "k"), 0.5, "its 5 tokens stay reserved")
	err := b.cancelTx(t, id, true)
	var notCancellable *scheduler.NotCancellableError
	require.ErrorAs(t, err, &notCancellable, "a job that started may have done its work")

	w, _ := strandedWorker(t, b, func() time.Time { return time.Now().Add(25 * time.Hour) })
	requireStranded(t, b, w, true, 1, "an interrupted job no client works is stranded")

	require.NoError(t, b.settleTx(t, id, 5))
	requireStranded(t, b, w, true, 0, "a settled job is not stranded")
}
