package pgbouncertest_test

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/cli"
	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestSearchPathIsRefusedAsAStartupParameter pins why users set search_path with ALTER ROLE: the
// way testdb and most applications name it, a startup parameter, is refused by PgBouncer 1.18.
func TestSearchPathIsRefusedAsAStartupParameter(t *testing.T) {
	b := pgbouncertest.New(t)
	cfg, err := pgx.ParseConfig(b.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["search_path"] = b.Schema
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err == nil {
		_ = conn.Close(context.Background())
		t.Skip("this PgBouncer accepts search_path as a startup parameter (track_extra_parameters, 1.20+)")
	}
	if !strings.Contains(err.Error(), "search_path") {
		t.Fatalf("connecting with search_path: %v; want PgBouncer's refusal naming search_path", err)
	}
	t.Logf("refused as expected: %v", err)
}

var t0 = time.Date(2030, 1, 1, 9, 0, 0, 0, time.UTC)

// migrated returns a PgBouncer on a fresh schema and a pool of maxConns connections through it, in
// exec mode, with txlimit's migrations applied.
func migrated(t *testing.T, maxConns int32) (*pgbouncertest.Bouncer, *pgxpool.Pool) {
	t.Helper()
	b := pgbouncertest.New(t)
	pool := b.Pool(t, pgx.QueryExecModeExec, maxConns)
	if err := migrations.Up(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return b, pool
}

// generous returns a limiter of one limit, name, of a million a second, for background load.
func generous(t *testing.T, name string) *ratelimit.Limiter {
	t.Helper()
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		name: {Rate: 1e6, Period: time.Second},
	}})
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// decide runs the same decisions in every mode, with exact answers (frozen clock): a plain limit
// to its capacity and one denial, a credit and the token it gives back, LimitMany all or nothing,
// two calls of a sharded limit, and 8 goroutines racing for 40 tokens (exactly 40 granted).
func decide(ctx context.Context, pool *pgxpool.Pool, key string) error {
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{
			"a":       {Rate: 3, Period: time.Minute},
			"b":       {Rate: 1, Period: time.Hour},
			"sharded": {Rate: 8, Period: time.Hour, Shards: 4},
			"race":    {Rate: 40, Period: time.Hour},
		},
		Now: func() time.Time { return t0 },
	})
	if err != nil {
		return err
	}
	for i, want := range []bool{true, true, true, false} {
		res, err := lim.Limit(ctx, pool, "a", key, nil)
		if err != nil {
			return err
		}
		if res.OK != want {
			return errors.New("a: step " + string(rune('0'+i)) + ": wrong decision")
		}
	}
	cr, err := lim.Credit(ctx, pool, "a", key, 1, nil)
	if err != nil {
		return err
	}
	if cr.Credited != 1 || cr.Value != 1 {
		return errors.New("credit: not exactly one token back")
	}
	if res, err := lim.Limit(ctx, pool, "a", key, nil); err != nil || !res.OK {
		return errors.Join(errors.New("the credited token was not granted"), err)
	}
	many := []ratelimit.Request{{Name: "a", Key: key + "-m"}, {Name: "b", Key: key + "-m"}}
	for i, want := range []bool{true, false} {
		res, err := lim.LimitMany(ctx, pool, many, nil)
		if err != nil {
			return err
		}
		if res.OK != want {
			return errors.New("LimitMany: step " + string(rune('0'+i)) + ": wrong decision")
		}
	}
	st, err := lim.State(ctx, pool, "a", key+"-m", nil)
	if err != nil {
		return err
	}
	if st.Value != 2 {
		return errors.New("LimitMany: the denied call consumed from a")
	}
	for i := range 2 { // two of 8 tokens over 4 shards: any two candidate shards still hold one
		res, err := lim.Limit(ctx, pool, "sharded", key, nil)
		if err != nil {
			return err
		}
		if !res.OK {
			return errors.New("sharded: step " + string(rune('0'+i)) + ": denied before capacity")
		}
	}
	var granted, denied atomic.Int64
	errs := make(chan error, 80)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 10 {
				res, err := lim.Limit(ctx, pool, "race", key, nil)
				switch {
				case err != nil:
					errs <- err
				case res.OK:
					granted.Add(1)
				default:
					denied.Add(1)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	if granted.Load() != 40 || denied.Load() != 40 {
		return errors.New("race: not exactly 40 granted and 40 denied")
	}
	return nil
}

// TestExecModes: decisions through PgBouncer under every pgx QueryExecMode. The three a
// transaction pooler allows are exact; the other two fail on PgBouncer 1.18 when PgBouncer moves a
// client between server connections mid-statement, as docs/deploy.md says (the test logs it):
// describe-exec sends its Describe and its Execute in two protocol round trips (two syncs), which
// the pooler may send to two server connections, the second of which has no such unnamed statement;
// cache-statement prepares named statements on one server connection and runs them on whichever
// the pooler picks next (PgBouncer tracks prepared statements only from 1.21, max_prepared_statements).
func TestExecModes(t *testing.T) {
	ctx := context.Background()
	b, _ := migrated(t, 2)
	lim := generous(t, "load")
	type mode struct {
		name string
		mode pgx.QueryExecMode
		safe bool
	}
	var modes []mode
	for _, m := range pgbouncertest.SafeModes {
		modes = append(modes, mode{m.Name, m.Mode, true})
	}
	modes = append(modes, mode{"describe_exec", pgx.QueryExecModeDescribeExec, false}, mode{"cache_statement", pgx.QueryExecModeCacheStatement, false})
	for _, c := range modes {
		t.Run(c.name, func(t *testing.T) {
			if c.safe {
				if err := decide(ctx, b.Pool(t, c.mode, 8), c.name); err != nil {
					t.Fatalf("%s through PgBouncer: %v", c.name, err)
				}
				return
			}
			// Whether an unsafe mode fails depends on which server connection PgBouncer picks for
			// each step, so it is shown, not asserted (a test must not flake): 30 clients take 30
			// decisions each, and the test logs how many failed and the first error.
			pool := b.Pool(t, c.mode, 30)
			var ok, failed atomic.Int64
			var first atomic.Value
			var wg sync.WaitGroup
			for i := range 30 {
				wg.Go(func() {
					for range 30 {
						if _, err := lim.Limit(ctx, pool, "load", c.name+string(rune('a'+i)), nil); err != nil {
							failed.Add(1)
							first.CompareAndSwap(nil, err.Error())
						} else {
							ok.Add(1)
						}
					}
				})
			}
			wg.Wait()
			t.Logf("%s through PgBouncer, 30 clients: %d decisions, %d errors (docs/deploy.md says why); first error: %v",
				c.name, ok.Load(), failed.Load(), first.Load())
		})
	}
}

// TestMigrationsUpAndDownTwice: Up, down to nothing, Up, down to nothing and Up again, through
// PgBouncer, each time at the right version.
func TestMigrationsUpAndDownTwice(t *testing.T) {
	ctx := context.Background()
	b := pgbouncertest.New(t)
	pool := b.Pool(t, pgx.QueryExecModeExec, 4)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	for round := range 2 {
		if err := migrations.Up(ctx, pool); err != nil {
			t.Fatalf("round %d: Up: %v", round, err)
		}
		if err := ratelimit.CheckSchema(ctx, pool); err != nil {
			t.Fatalf("round %d: CheckSchema after Up: %v", round, err)
		}
		p, err := migrations.NewProvider(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.DownTo(ctx, 0); err != nil {
			t.Fatalf("round %d: down to 0: %v", round, err)
		}
		if v, err := p.GetDBVersion(ctx); err != nil || v != 0 {
			t.Fatalf("round %d: after DownTo(0): version %d, %v; want 0", round, v, err)
		}
		if err := ratelimit.CheckSchema(ctx, pool); !errors.Is(err, ratelimit.ErrSetup) {
			t.Fatalf("round %d: CheckSchema after DownTo(0): %v; want a *SetupError", round, err)
		}
	}
	if err := migrations.Up(ctx, pool); err != nil {
		t.Fatalf("Up at last: %v", err)
	}
	if err := ratelimit.CheckSchema(ctx, pool); err != nil {
		t.Fatalf("CheckSchema at last: %v", err)
	}
}

// TestCommandThroughPgBouncer: the operator's command works on the URL an application behind
// PgBouncer uses, the role's search_path leading to its schema: every command, each run twice, so
// that the second run lands on server connections the first one used (pgx's default exec mode
// prepared named statements there, "prepared statement ... already exists", SQLSTATE 42P05). And
// --schema, a search_path PgBouncer refuses at connect, says so and what to do instead.
func TestCommandThroughPgBouncer(t *testing.T) {
	b := pgbouncertest.New(t)
	u, err := url.Parse(b.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(b.Role)
	run := func(args ...string) (int, string, string) {
		var stdout, stderr bytes.Buffer
		code := cli.Run(context.Background(), append([]string{"--dsn", u.String()}, args...), &stdout, &stderr,
			&cli.Options{Getenv: func(string) string { return "" }})
		return code, stdout.String(), stderr.String()
	}
	adhoc := []string{"--rate", "1", "--period", "1h"}
	for i, st := range []struct {
		args   []string
		stdout string
	}{
		{[]string{"migrate", "up"}, "up    00001_txlimit_table.sql\nup    00002_txlimit_rules.sql\nup    00003_txlimit_decide.sql\nup    00004_txlimit_operations.sql\n"},
		{[]string{"migrate", "up"}, "up to date\n"},
		{[]string{"migrate", "status"}, ""},
		{[]string{"migrate", "status"}, ""},
		{append([]string{"reset", "a", "k"}, adhoc...), "reset a \"k\": full again\n"},
		{append([]string{"reset", "a", "k"}, adhoc...), "reset a \"k\": full again\n"},
		{append([]string{"inspect", "a", "k"}, adhoc...), ""},
		{append([]string{"inspect", "a", "k"}, adhoc...), ""},
		{[]string{"names"}, "NAME        ROWS  CONFIG\ntotal          0\n"},
		{[]string{"names"}, "NAME        ROWS  CONFIG\ntotal          0\n"},
		{append([]string{"prune", "a"}, adhoc...), "a                    0 rows deleted\ntotal                0 rows deleted\n"},
		{append([]string{"prune", "a"}, adhoc...), "a                    0 rows deleted\ntotal                0 rows deleted\n"},
		{[]string{"migrate", "down", "--yes"}, "down  00004_txlimit_operations.sql\n"},
		{[]string{"migrate", "down", "--yes"}, "down  00003_txlimit_decide.sql\n"},
		{[]string{"migrate", "up"}, "up    00003_txlimit_decide.sql\nup    00004_txlimit_operations.sql\n"},
	} {
		code, stdout, stderr := run(st.args...)
		if code != cli.ExitOK || (st.stdout != "" && stdout != st.stdout) {
			t.Errorf("step %d: %v: got exit %d, stdout %q, stderr %q; want exit 0, stdout %q", i, st.args, code, stdout, stderr, st.stdout)
		}
	}
	code, stdout, stderr := run("--schema", b.Schema, "names")
	want := "txlimit: --schema sets search_path when connecting, which this server refuses (PgBouncer does): leave out --schema and " +
		"set the role's search_path instead (ALTER ROLE ... SET search_path = " + b.Schema + "; docs/deploy.md), or connect to Postgres " +
		"directly (FATAL: unsupported startup parameter: search_path (SQLSTATE 08P01))\n"
	if code != cli.ExitDatabase || stdout != "" || stderr != want {
		t.Errorf("--schema through PgBouncer: got exit %d, stdout %q, stderr\n%s\nwant exit 1 and\n%s", code, stdout, stderr, want)
	}
}

// TestMigrationsUnderLoad runs Up on a fresh schema through PgBouncer while 30 other clients take
// decisions through it, and four migrators race: all succeed, each migration ran once. It logs how
// long Up took (no bound: speed lives in benchmarks).
func TestMigrationsUnderLoad(t *testing.T) {
	ctx := context.Background()
	_, busyPool := migrated(t, 30)
	lim := generous(t, "busy")
	stop := make(chan struct{})
	var load sync.WaitGroup
	var decisions atomic.Int64
	for i := range 30 {
		load.Go(func() {
			key := string(rune('a' + i))
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := lim.Limit(ctx, busyPool, "busy", key, nil); err == nil {
					decisions.Add(1)
				}
			}
		})
	}
	defer func() { close(stop); load.Wait() }()
	time.Sleep(500 * time.Millisecond) // let the load fill PgBouncer's server pool

	b := pgbouncertest.New(t)
	pools := make([]*pgxpool.Pool, 4)
	for i := range pools {
		pools[i] = b.Pool(t, pgx.QueryExecModeExec, 2)
	}
	errs := make([]error, len(pools))
	took := make([]time.Duration, len(pools))
	var wg sync.WaitGroup
	for i := range pools {
		wg.Go(func() {
			start := time.Now()
			errs[i] = migrations.Up(ctx, pools[i])
			took[i] = time.Since(start)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	var applied int
	if err := pools[0].QueryRow(ctx, "SELECT count(*) FROM "+migrations.VersionTable+" WHERE version_id > 0").Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if int64(applied) != migrations.Latest() {
		t.Fatalf("versions applied after 4 concurrent Ups: %d; want %d (each migration once)", applied, migrations.Latest())
	}
	start := time.Now()
	if err := migrations.Up(ctx, pools[0]); err != nil {
		t.Fatal(err)
	}
	noop := time.Since(start)
	alone := pgbouncertest.New(t).Pool(t, pgx.QueryExecModeExec, 2)
	start = time.Now()
	if err := migrations.Up(ctx, alone); err != nil {
		t.Fatal(err)
	}
	t.Logf("through PgBouncer with 30 busy clients (%d decisions so far): one Up on a fresh schema took %v; 4 concurrent Ups on another %v; a no-op Up %v",
		decisions.Load(), time.Since(start).Round(time.Millisecond), took, noop.Round(time.Millisecond))
}

// JobArgs is a reserved job of TestSchedulerPollOnly.
type JobArgs struct {
	N int `json:"n"`
}

func (JobArgs) Kind() string { return "pgbouncer_test" }

// TestSchedulerPollOnly: River through PgBouncer in poll-only mode (no LISTEN), with
// scheduler.Migrate and ReserveTx: a job whose tokens are there runs now, a reserved one runs after
// its RetryAt, and both complete.
func TestSchedulerPollOnly(t *testing.T) {
	ctx := context.Background()
	_, pool := migrated(t, 8)
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		t.Fatal(err)
	}
	ran := make(chan time.Time, 2)
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[JobArgs]) error {
		ran <- time.Now()
		return nil
	}))
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Hooks:    []rivertype.Hook{&scheduler.PreciseHook{}},
		PollOnly: true,
		Queues:   map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(2)},
		Workers:  workers,
	})
	if err != nil {
		t.Fatal(err)
	}
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"jobs": {Rate: 1, Period: time.Second, MaxReserved: 5},
	}})
	if err != nil {
		t.Fatal(err)
	}
	sched, err := scheduler.New(client, lim, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = client.Stop(ctx) }()
	var retryAt time.Time
	for i := range 2 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			r, err := sched.ReserveTx(ctx, tx, "jobs", "k", 1, JobArgs{N: i}, nil)
			if err == nil && i == 1 {
				retryAt = r.RetryAt
			}
			return err
		})
		if err != nil {
			t.Fatalf("ReserveTx %d: %v", i, err)
		}
	}
	if retryAt.IsZero() {
		t.Fatal("the second reservation runs now; want it scheduled for when its token accrues")
	}
	var times []time.Time
	timeout := time.After(60 * time.Second)
	for len(times) < 2 {
		select {
		case at := <-ran:
			times = append(times, at)
		case <-timeout:
			t.Fatalf("%d of 2 jobs ran within 60 s through PgBouncer in poll-only mode", len(times))
		}
	}
	if times[1].Before(retryAt) {
		t.Fatalf("the reserved job ran at %v, before its RetryAt %v", times[1], retryAt)
	}
	t.Logf("reserved job ran %v after its RetryAt", times[1].Sub(retryAt).Round(time.Millisecond))
}
