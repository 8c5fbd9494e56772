package scheduler_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// t0 is the frozen time of tests that inject the limiter's clock. It is in the past, so jobs
// scheduled from it are due at once.
var t0 = time.Date(2024, 1, 1, 12, 0, 0, 0, time.UTC)

// callArgs is the job of most tests: a call that reserved Budget.
type callArgs struct {
	N      int                  `json:"n"`
	Budget scheduler.Settlement `json:"budget"`
}

func (callArgs) Kind() string { return "txlimit_call" }

type testBundle struct {
	pool    *pgxpool.Pool
	limiter *ratelimit.Limiter
	client  *river.Client[pgx.Tx] // insert-only, with PreciseHook
	sched   *scheduler.Scheduler
}

type setupOpts struct {
	limits   map[string]ratelimit.Config
	now      func() time.Time // the limiter's clock; nil: the database's
	maxConns int32
	conn     conn // how to reach Postgres; the zero conn: directly, pgx's default exec mode
}

// setup returns a migrated schema (txlimit and River), a limiter and an insert-only client.
func setup(t *testing.T, opts *setupOpts) *testBundle {
	t.Helper()
	if opts == nil {
		opts = &setupOpts{}
	}
	pool := opts.conn.pool(t, max(opts.maxConns, 8), false)
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: opts.limits, Now: opts.now})
	require.NoError(t, err)
	client := newClient(t, pool, nil)
	sched, err := scheduler.New(client, limiter, nil)
	require.NoError(t, err)
	return &testBundle{pool: pool, limiter: limiter, client: client, sched: sched}
}

// setupCalls is setup with one limit, "calls", of cfg, on the clock frozen at t0, reached by c.
func setupCalls(t *testing.T, cfg ratelimit.Config, c conn) *testBundle {
	t.Helper()
	return setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": cfg}, now: frozen(t0), conn: c})
}

// noHookScheduler returns a Scheduler of config cfg on b's limiter whose client lacks PreciseHook.
func (b *testBundle) noHookScheduler(t *testing.T, cfg *scheduler.Config) *scheduler.Scheduler {
	t.Helper()
	sched, err := scheduler.New(newClient(t, b.pool, &clientOpts{noHook: true}), b.limiter, cfg)
	require.NoError(t, err)
	return sched
}

// clientOpts configure newClient. Without queues, the client only inserts.
type clientOpts struct {
	queues      map[string]river.QueueConfig
	middleware  []rivertype.Middleware
	work        func(ctx context.Context, job *river.Job[callArgs]) error
	noHook      bool
	pollOnly    bool // no LISTEN: through PgBouncer
	retryPolicy river.ClientRetryPolicy
}

func newClient(t testing.TB, pool *pgxpool.Pool, opts *clientOpts) *river.Client[pgx.Tx] {
	t.Helper()
	if opts == nil {
		opts = &clientOpts{}
	}
	work := opts.work
	if work == nil {
		work = func(context.Context, *river.Job[callArgs]) error { return nil }
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(work))
	cfg := &river.Config{
		Logger:      quietLogger(),
		Middleware:  opts.middleware,
		PollOnly:    opts.pollOnly,
		Queues:      opts.queues,
		RetryPolicy: opts.retryPolicy,
		TestOnly:    true,
		Workers:     workers,
	}
	if !opts.noHook {
		cfg.Hooks = []rivertype.Hook{&scheduler.PreciseHook{}}
	}
	return testdb.RiverClient(t, pool, cfg)
}

// workQueues starts and stops a River client on b's pool (reached by c) that works queues, so that
// River's queue table lists them, as it does once a worker process has run.
func (b *testBundle) workQueues(t *testing.T, c conn, queues ...string) {
	t.Helper()
	ctx := context.Background()
	qs := map[string]river.QueueConfig{}
	for _, q := range queues {
		qs[q] = scheduler.PreciseQueue(1)
	}
	client := newClient(t, b.pool, &clientOpts{queues: qs, pollOnly: c.bouncer})
	require.NoError(t, client.Start(ctx))
	require.NoError(t, client.Stop(ctx))
}

// startClient starts client and stops it when the test ends.
func startClient(t testing.TB, client *river.Client[pgx.Tx]) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, client.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = client.Stop(ctx)
	})
}

// inTx runs fn in a transaction and commits it, or rolls it back when fn fails or rollback is set.
// The deferred rollback also ends the transaction when fn stops the test, so that the schema can
// be dropped.
func inTx(t *testing.T, pool *pgxpool.Pool, rollback bool, fn func(tx pgx.Tx) error) error {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if err := fn(tx); err != nil || rollback {
		return err
	}
	return tx.Commit(ctx)
}

// jobs lists every job of the schema.
func jobs(t *testing.T, client *river.Client[pgx.Tx]) []*rivertype.JobRow {
	t.Helper()
	res, err := client.JobList(context.Background(), river.NewJobListParams().First(10_000))
	require.NoError(t, err)
	return res.Jobs
}

// jobRow reads one job back.
func jobRow(t *testing.T, b *testBundle, id int64) *rivertype.JobRow {
	t.Helper()
	row, err := b.client.JobGet(context.Background(), id)
	require.NoError(t, err)
	return row
}

func value(t *testing.T, b *testBundle, name, key string) float64 {
	t.Helper()
	st, err := b.limiter.State(context.Background(), b.pool, name, key, nil)
	require.NoError(t, err)
	return st.Value
}

// frozen returns a clock that stays at t.
func frozen(t time.Time) func() time.Time { return func() time.Time { return t } }

// starts records when each job started working, by job ID.
type starts struct {
	mu sync.Mutex
	at map[int64]time.Time
	ch chan struct{}
}

func newStarts() *starts { return &starts{at: map[int64]time.Time{}, ch: make(chan struct{}, 10_000)} }

func (s *starts) record(id int64, at time.Time) {
	s.mu.Lock()
	s.at[id] = at
	s.mu.Unlock()
	s.ch <- struct{}{}
}

// wait waits for n starts, failing after timeout.
func (s *starts) wait(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for i := 0; i < n; i++ {
		select {
		case <-s.ch:
		case <-deadline:
			t.Fatalf("only %d of %d jobs started within %s", i, n, timeout)
		}
	}
}

// quietLogger discards what River logs.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// jsonUnmarshal is json.Unmarshal, for the tests that read a job's JSON only once.
func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// metadataValue returns the raw JSON under key in a job's metadata.
func metadataValue(t *testing.T, metadata []byte, key string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(metadata, &m))
	return m[key]
}

// second returns the error of a call that returns a value and an error.
func second[T any](_ T, err error) error { return err }
