package ratelimit_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

func TestMetrics(t *testing.T) {
	t.Parallel()
	b, reader := meteredBundle(t, nil, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{
			"a": {Rate: 2, Period: time.Minute},
			"b": {Rate: 1, Period: time.Minute, MaxReserved: 5},
		},
		Now: func() time.Time { return t0 },
	})
	ctx, pool, limiter := b.ctx, b.pool, b.lim

	for range 3 { // 2 granted, 1 denied
		_, err := limiter.Limit(ctx, pool, "a", "user-1", nil)
		require.NoError(t, err)
	}
	_, err := limiter.LimitN(ctx, pool, "b", "user-1", 2, &ratelimit.LimitOpts{Reserve: true}) // reserved
	require.NoError(t, err)
	res, err := limiter.LimitMany(ctx, pool, []ratelimit.Request{{Name: "a", Key: "user-2"}, {Name: "b", Key: "user-1"}}, nil)
	require.NoError(t, err)
	require.False(t, res.OK) // b is owed: denied, a not consumed
	_, err = limiter.Limit(ctx, pool, "nope", "k", nil)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	op := func(s string) attribute.KeyValue { return attribute.String("txlimit.op", s) }
	lim := func(s string) attribute.KeyValue { return attribute.String("txlimit.limit", s) }
	out := func(s string) attribute.KeyValue { return attribute.String("txlimit.outcome", s) }
	for i, c := range []struct {
		attrs []attribute.KeyValue
		want  int64
	}{
		{[]attribute.KeyValue{op("LimitN"), lim("a"), out("granted")}, 2},
		{[]attribute.KeyValue{op("LimitN"), lim("a"), out("denied")}, 1},
		{[]attribute.KeyValue{op("LimitN"), lim("b"), out("reserved")}, 1},
		{[]attribute.KeyValue{op("LimitMany"), lim("b"), out("denied")}, 1},
		{[]attribute.KeyValue{op("LimitMany"), lim("a"), out("denied")}, 0},
		{[]attribute.KeyValue{op("LimitN"), out("error"), attribute.String("error.type", "invalid")}, 1},
	} {
		require.Equal(t, c.want, metrictest.Sum(t, rm, "txlimit.decisions", c.attrs...), "case %d: %v", i, c.attrs)
	}
	// The duration histogram saw every call: 3 + 1 LimitN granted/denied..., 6 calls in all.
	var calls uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "txlimit.decision.duration" {
				for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
					calls += dp.Count
				}
			}
		}
	}
	require.Equal(t, uint64(6), calls)
}

func TestManyResultTimeAndRetryAfter(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"m": {Rate: 10, Period: time.Minute, Capacity: 1}})
	ctx, pool, limiter := b.ctx, b.pool, b.lim
	reqs := []ratelimit.Request{{Name: "m", Key: "k"}}
	res, err := limiter.LimitMany(ctx, pool, reqs, nil)
	require.NoError(t, err)
	require.True(t, res.OK)
	require.Equal(t, t0, res.Time)
	require.Equal(t, time.Duration(0), res.RetryAfter())
	res, err = limiter.LimitMany(ctx, pool, reqs, nil)
	require.NoError(t, err)
	require.False(t, res.OK)
	require.Equal(t, t0, res.Time)
	require.Equal(t, 6*time.Second, res.RetryAfter())
	var le *ratelimit.LimitedError
	require.ErrorAs(t, res.Err(), &le)
	require.Equal(t, t0, le.Time)
	require.Equal(t, 6*time.Second, le.RetryAfter())
	r, err := limiter.Limit(ctx, pool, "m", "k", nil)
	require.NoError(t, err)
	require.ErrorAs(t, r.Err(), &le)
	require.Equal(t, t0, le.Time)
	require.Equal(t, 6*time.Second, le.RetryAfter())
}

func TestMetricsTxRetries(t *testing.T) {
	t.Parallel()
	var logs strings.Builder
	b, reader := meteredBundle(t, nil, &ratelimit.LimiterConfig{
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	ctx, pool, limiter := b.ctx, b.pool, b.lim
	conflict := &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
	runs := 0
	err := ratelimit.InSerializableTx(ctx, pool, &ratelimit.TxOpts{Limiter: limiter, MinBackoff: time.Microsecond},
		func(ctx context.Context, tx pgx.Tx) error {
			if runs++; runs <= 2 {
				return conflict
			}
			return nil
		})
	require.NoError(t, err)
	// Then one that never succeeds: 3 attempts, 2 retries, a warning.
	err = ratelimit.InSerializableTx(ctx, pool, &ratelimit.TxOpts{Limiter: limiter, MaxAttempts: 3, MinBackoff: time.Microsecond},
		func(ctx context.Context, tx pgx.Tx) error { return conflict })
	var exhausted *ratelimit.RetriesExhaustedError
	require.ErrorAs(t, err, &exhausted)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	require.Equal(t, int64(4), metrictest.Sum(t, rm, "txlimit.tx.retries"))
	require.Equal(t, 1, strings.Count(logs.String(), "retries exhausted"), logs.String())
}

// Both shards held by open transactions: a SERIALIZABLE call fails with a *BusyError, counted as
// busy and as an error of type "busy".
func TestMetricsBusy(t *testing.T) {
	t.Parallel()
	b, reader := meteredBundle(t, &testdb.Options{MaxConns: 4}, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"s": {Rate: 4, Period: time.Minute, Shards: 2}},
	})
	ctx, pool, limiter := b.ctx, b.pool, b.lim
	ratelimit.SetShardPicker(limiter, func(int) (int, int) { return 0, 1 })
	holdShards(t, b, "s", "k", 2)
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = limiter.Limit(ctx, tx, "s", "k", nil)
	var busy *ratelimit.BusyError
	require.ErrorAs(t, err, &busy)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.busy", attribute.String("txlimit.limit", "s")))
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.decisions", attribute.String("txlimit.op", "LimitN"),
		attribute.String("txlimit.limit", "s"), attribute.String("txlimit.outcome", "error"), attribute.String("error.type", "busy")))
	require.Equal(t, int64(2), metrictest.Sum(t, rm, "txlimit.decisions", attribute.String("txlimit.op", "LimitN"),
		attribute.String("txlimit.limit", "s"), attribute.String("txlimit.outcome", "granted")))
}

// TestMetricsBusyRerunIsARetry: InSerializableTx's rerun after a *BusyError (it waited for the
// shard, and the rerun costs no attempt) is a transaction run again after a serialization
// failure: txlimit.tx.retries counts it and the Logger gets its debug line.
func TestMetricsBusyRerunIsARetry(t *testing.T) {
	t.Parallel()
	var logs strings.Builder
	b, reader := meteredBundle(t, &testdb.Options{MaxConns: 4}, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"s": {Rate: 4, Period: time.Minute, Shards: 2}},
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	ctx, pool, limiter := b.ctx, b.pool, b.lim
	ratelimit.SetShardPicker(limiter, func(int) (int, int) { return 0, 1 })
	holders := holdShards(t, b, "s", "k", 2)
	released := make(chan struct{})
	go func() {
		time.Sleep(200 * time.Millisecond)
		_ = holders[0].Rollback(context.Background())
		close(released)
	}()
	runs := 0
	err := ratelimit.InSerializableTx(ctx, pool, &ratelimit.TxOpts{Limiter: limiter}, func(ctx context.Context, tx pgx.Tx) error {
		runs++
		_, err := limiter.Limit(ctx, tx, "s", "k", nil)
		return err
	})
	require.NoError(t, err)
	<-released // before the cleanup's rollbacks
	require.Equal(t, 2, runs)
	rm := metrictest.Collect(t, reader)
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.busy", attribute.String("txlimit.limit", "s")))
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.tx.retries"))
	require.Contains(t, logs.String(), "serializable transaction retried")
}

// TestMetricsClosedBatcher: a call on a closed Batcher sent nothing to the database: its error is
// typed "closed", not "database", and it logs no failed decision.
func TestMetricsClosedBatcher(t *testing.T) {
	t.Parallel()
	var logs strings.Builder
	b, reader := meteredBundle(t, nil, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"a": {Rate: 2, Period: time.Minute}},
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	bt, err := ratelimit.NewBatcher(b.pool, b.lim, nil)
	require.NoError(t, err)
	bt.Close()
	_, err = bt.Limit(b.ctx, "a", "k", nil)
	require.ErrorIs(t, err, ratelimit.ErrBatcherClosed)
	rm := metrictest.Collect(t, reader)
	attrs := []attribute.KeyValue{attribute.String("txlimit.op", "LimitN"), attribute.String("txlimit.limit", "a"),
		attribute.String("txlimit.outcome", "error")}
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.decisions", append(attrs, attribute.String("error.type", "closed"))...))
	require.Zero(t, metrictest.Sum(t, rm, "txlimit.decisions", append(attrs, attribute.String("error.type", "database"))...))
	require.NotContains(t, logs.String(), "decision failed")
}

// meteredBundle is newBundle with cfg.MeterProvider set to a provider of its own, whose
// measurements reader collects.
func meteredBundle(t *testing.T, opts *testdb.Options, cfg *ratelimit.LimiterConfig) (*testBundle, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	return newBundle(t, opts, cfg), reader
}

// holdShards opens n transactions on b's pool that each decide once with b's limiter on (name, key)
// and stay open, so that each holds one shard (steering sends each to a free one); they are rolled
// back when the test ends.
func holdShards(t *testing.T, b *testBundle, name, key string, n int) []pgx.Tx {
	t.Helper()
	ctx := b.ctx
	txs := make([]pgx.Tx, n)
	for i := range txs {
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		r, err := b.lim.Limit(ctx, tx, name, key, nil)
		require.NoError(t, err)
		require.True(t, r.OK)
		txs[i] = tx
	}
	return txs
}

// TestMetricsBatcherRetries: a batch run again after a deadlock is counted in txlimit.tx.retries
// and logged when BatcherConfig.Retry.Limiter is set, as TxOpts.Limiter says of InSerializableTx,
// whose retries BatcherConfig.Retry bounds. (Before, the Batcher ignored Retry.Limiter.)
func TestMetricsBatcherRetries(t *testing.T) {
	t.Parallel()
	var logs metrictest.Logs
	env, reader := meteredBundle(t, &testdb.Options{MaxConns: 4}, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"a": {Rate: 5, Period: time.Minute}},
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	ctx, pool := env.ctx, env.pool
	b, err := ratelimit.NewBatcher(pool, env.lim, &ratelimit.BatcherConfig{Retry: ratelimit.TxOpts{Limiter: env.lim}})
	require.NoError(t, err)
	defer b.Close()
	reqs := []ratelimit.Request{{Name: "a", Key: "d1"}, {Name: "a", Key: "d2"}}
	_, err = b.LimitMany(ctx, reqs, nil) // both rows exist
	require.NoError(t, err)

	// A transaction locks d2; the batch locks d1 and waits for d2; the transaction then asks for
	// d1. Only the batch checks for the deadlock soon (the transaction's deadlock_timeout is
	// long), so the batch is the victim and runs again.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SET LOCAL deadlock_timeout = '60s'")
	require.NoError(t, err)
	testdb.LockRow(t, tx, "a", "d2", 0)
	pid := tx.Conn().PgConn().PID()
	many := make(chan error, 1)
	go func() { _, err := b.LimitMany(ctx, reqs, nil); many <- err }()
	require.Eventually(t, func() bool {
		return testdb.BlockedBy(t, pool, pid) == 1
	}, time.Minute, time.Millisecond, "the batch waits for d2")
	var one int
	require.NoError(t, tx.QueryRow(ctx, "SELECT 1 FROM txlimit_state WHERE name = 'a' AND key = 'd1' AND shard = 0 FOR UPDATE").Scan(&one))
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, <-many)

	rm := metrictest.Collect(t, reader)
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.tx.retries"), "the batch ran again once")
	require.Contains(t, logs.String(), "batch retried")
}

// TestMetricsDecisionDurationBuckets: txlimit.decision.duration is in seconds, so its buckets must
// resolve fractions of a second. With the SDK's default boundaries (0, 5, 10, 25, ... meant for
// milliseconds) every decision fell in the bucket (0 s, 5 s], and the histogram said nothing about
// latency: a decision on this machine's database lands in a bucket at or under 1 s.
func TestMetricsDecisionDurationBuckets(t *testing.T) {
	t.Parallel()
	env, reader := meteredBundle(t, nil, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"a": {Rate: 100, Period: time.Minute}},
	})
	for range 5 {
		_, err := env.lim.Limit(env.ctx, env.pool, "a", "k", nil)
		require.NoError(t, err)
	}
	rm := metrictest.Collect(t, reader)
	seen := 0
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "txlimit.decision.duration" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				require.NotEmpty(t, dp.Bounds)
				require.Less(t, dp.Bounds[0], 0.001, "the first bound resolves a sub-millisecond decision: %v", dp.Bounds)
				for i, n := range dp.BucketCounts {
					if n == 0 {
						continue
					}
					seen += int(n)
					require.Less(t, i, len(dp.Bounds), "decisions above the last bound %v", dp.Bounds)
					require.LessOrEqual(t, dp.Bounds[i], 1.0, "%d decisions in the bucket up to %v s (bounds %v)", n, dp.Bounds[i], dp.Bounds)
				}
			}
		}
	}
	require.Equal(t, 5, seen)
}

// TestMetricsRefusedExecutor: a call refused for its Executor (nil, or a bare *sql.Tx) is a call
// that failed as invalid input, counted and timed as every other (LimiterConfig.MeterProvider).
func TestMetricsRefusedExecutor(t *testing.T) {
	t.Parallel()
	b, reader := meteredBundle(t, nil, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"a": {Rate: 2, Period: time.Minute}},
	})
	_, err := b.lim.Limit(b.ctx, nil, "a", "k", nil)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	_, err = b.lim.CheckMany(b.ctx, nil, []ratelimit.Request{{Name: "a", Key: "k"}, {Name: "a", Key: "j"}}, nil)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	rm := metrictest.Collect(t, reader)
	invalid := func(op string) []attribute.KeyValue {
		return []attribute.KeyValue{attribute.String("txlimit.op", op), attribute.String("txlimit.outcome", "error"),
			attribute.String("error.type", "invalid")}
	}
	require.Equal(t, int64(1), metrictest.Sum(t, rm, "txlimit.decisions", invalid("LimitN")...))
	require.Equal(t, int64(2), metrictest.Sum(t, rm, "txlimit.decisions", invalid("CheckMany")...))
}
