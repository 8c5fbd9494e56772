package ratelimit

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/metric"

	"github.com/txlimit/txlimit/internal/nilarg"
)

// Executor is the database handle a call runs on: a pgx.Tx, *pgxpool.Pool or *pgx.Conn (or any
// other value with their Exec, Query and QueryRow), or a database/sql handle wrapped by package
// github.com/txlimit/txlimit/sqldb (sqldb.Wrap(tx) of a *sql.Tx, *sql.DB or *sql.Conn).
// Inside a transaction a limit's writes commit or roll back with the caller's own; on a pool or a
// connection each call is a transaction of its own. The type admits any value so that the handles
// of both database packages fit; a value of another type (a bare *sql.Tx among them) or nil is
// refused with an *ArgumentError naming the fix, before any SQL runs.
type Executor any

// LimiterConfig configures a Limiter. A nil *LimiterConfig is the zero value.
type LimiterConfig struct {
	// Limits are the named limits, validated by New. Calls may also pass a Config inline, which
	// takes precedence over a registered one. Defaults to none.
	Limits map[string]Config

	// Logger receives the Limiter's logs: a database error of a decision (warn), a serializable
	// transaction retried (debug) or given up (warn) when InSerializableTx is given this Limiter
	// in TxOpts.Limiter, and a Batcher's batch retried or given up likewise when it is in
	// BatcherConfig.Retry.Limiter. Defaults to nil: silent.
	Logger *slog.Logger

	// MeterProvider provides the meter (named "github.com/txlimit/txlimit/ratelimit", the package's
	// path) of the Limiter's instruments. Their attributes are the limit's name (txlimit.limit), the
	// call (txlimit.op: LimitN, CheckN, LimitMany, CheckMany), the outcome (txlimit.outcome) and,
	// for errors, error.type; never a key, so their cardinality is bounded by the number of limits.
	//   - txlimit.decisions counts requests decided by limit, call and outcome: "granted" or
	//     "reserved" for each request of a granted call, "denied" for each denied request of a
	//     denied call (the others of that call consumed nothing and are not counted), "error" for
	//     each request of a call that failed (with error.type "invalid", "busy", "canceled",
	//     "closed" (a Batcher after Close) or "database"; an invalid call carries no limit name,
	//     which may be the invalid input).
	//   - txlimit.decision.duration is the time a call took, in seconds, by call and outcome of
	//     the call as a whole (a wait for an admission slot of a sharded key included: the
	//     package documentation, "Shards"), in buckets from 100 µs to 10 s (a View can set others).
	//   - txlimit.tx.retries counts the transactions InSerializableTx ran again after a
	//     serialization failure or deadlock, a *BusyError's rerun after its wait included (with
	//     this Limiter in TxOpts.Limiter), and the batches a Batcher ran again (with this Limiter
	//     in BatcherConfig.Retry.Limiter).
	//   - txlimit.busy counts sharded decisions that found every candidate shard taken
	//     (*BusyError), by limit.
	//   - txlimit.batch.size is the number of calls a Batcher decided together in one statement.
	//
	// Defaults to nil: no metrics (a no-op provider, not the global one).
	MeterProvider metric.MeterProvider

	// Now, when set, supplies the time every decision is evaluated at instead of the database's
	// clock (clock_timestamp()). It exists for tests; production should leave it nil so that app
	// servers with skewed clocks agree. A reading 2^61 µs (about 73,000 years) or more from the
	// Unix epoch makes the call an *ArgumentError (Arg "LimiterConfig.Now"), nothing written.
	// Defaults to nil: the database's clock.
	Now func() time.Time
}

// Limiter decides rate limits stored in Postgres (table txlimit_state, created by the migrations
// package). It holds only configuration, so it is cheap, safe for concurrent use, and one per
// application is enough.
//
// Every call takes an Executor. A decision, State, Credit and Reset are one SQL round trip each;
// Prune works in rounds of two statements. Decisions are exact at any isolation level: a request
// is granted only if, at the moment it holds the row lock, the tokens are there.
type Limiter struct {
	limits map[string]Config
	now    func() time.Time
	// pick chooses two distinct shards of n (n >= 2). Tests replace it.
	pick func(n int) (int, int)
	obs  *observer // metrics and logs (metrics.go)
	// admission admits the lone calls on a pool of one sharded key at most Shards at a time
	// (admission.go).
	admission admission
}

// New returns a Limiter for the named limits. It returns a *ConfigError naming the first invalid
// field, or an *ArgumentError for an invalid name.
func New(config *LimiterConfig) (*Limiter, error) {
	if config == nil {
		config = &LimiterConfig{}
	}
	l := &Limiter{limits: make(map[string]Config, len(config.Limits)), now: config.Now, pick: pickTwo,
		obs: newObserver(config.MeterProvider, config.Logger)}
	names := make([]string, 0, len(config.Limits))
	for name := range config.Limits {
		names = append(names, name)
	}
	sort.Strings(names) // report the same first error every time
	for _, name := range names {
		if err := checkName("New", name); err != nil {
			return nil, err
		}
		cfg := config.Limits[name]
		if err := cfg.validate(name); err != nil {
			return nil, err
		}
		l.limits[name] = cfg
	}
	return l, nil
}

// LimitOpts are the options of every call on one limit: the decisions (Limit, LimitN, Check,
// CheckN, LimitMany and CheckMany, on the Limiter and the Batcher), State and Credit. A nil
// *LimitOpts is the zero value. LimitMany and CheckMany read only AsError: their requests carry
// their own Config and Reserve. State and Credit read only Config. Setting a field a call does not
// read is an *ArgumentError.
type LimitOpts struct {
	// Config, when set, is used instead of the limit registered under the name (and makes an
	// unregistered name valid). Defaults to nil: the registered config.
	Config *Config

	// Reserve lets the limit go below zero, down to -MaxReserved: the call is granted as a
	// reservation (Result.Reserved) and the caller should act at Result.RetryAt. Defaults to false.
	Reserve bool

	// AsError turns a denial into a *LimitedError, so that a caller inside a transaction can return
	// it and roll back; for LimitMany and CheckMany the error lists every denied limit. A granted
	// reservation is never an error. Defaults to false.
	AsError bool
}

// Result is the outcome of a decision.
type Result struct {
	// Name and Key identify the limit.
	Name, Key string

	// OK reports whether the tokens were granted, now or as a reservation.
	OK bool

	// Reserved reports a grant that took the limit below zero: the caller booked the tokens and
	// should act at RetryAt, not now. Always false without LimitOpts.Reserve.
	Reserved bool

	// RetryAt is when the call can go ahead: for a reservation, when the rows it charged are out
	// of debt and the caller should act; for a denial, the first microsecond at which the same call
	// is granted, all else equal (for a reservation refused over MaxReserved: when its debt fits).
	// See docs/spec.md §3 and §4. Zero when OK and not Reserved. At most Time plus 2^61 µs (about
	// 73,000 years; more than a time.Duration holds, so RetryAfter saturates there): a longer wait
	// (a huge debt on a tiny rate, say) is reported as that bound. For a 10/minute token bucket
	// holding 0.5 tokens, a call for 1 is denied with RetryAt three seconds after the decision.
	RetryAt time.Time

	// Value is the number of tokens left after the call (negative after a reservation). With
	// Shards > 1 it covers only the shards this call looked at; Limiter.State gives the exact total.
	Value float64

	// TS is the ts (docs/spec.md §1) the one row a grant charged was left with: Time for a token
	// bucket, the start of the current window for a fixed window (unless the row's ts was later).
	// With Value it is the row's state after the call, from which package scheduler follows a
	// reservation's debt. Zero when denied or when two shards were charged.
	TS time.Time

	// Shards lists the shard rows that were charged, in ascending order ([0] for an unsharded
	// limit); empty when denied.
	Shards []int

	// Config is the config the decision was made with, defaults applied (Capacity and Shards as
	// in force).
	Config Config

	// Time is the clock reading the decision was made with: the database's clock, read as the
	// statement starts deciding (docs/spec.md §2; a decision that creates a row reads it again once
	// it holds its rows, §1), unless LimiterConfig.Now is set. A row whose ts is
	// later (a concurrent call read the clock after this one but committed first) is evaluated at
	// its ts instead, since time never runs backwards for a row; so under contention Time can trail
	// the instant the decision took effect by the wait. RetryAt is computed from the row as
	// evaluated, so it is right either way.
	Time time.Time
	// Batched is how many calls a Batcher decided in the same statement as this one, this one
	// included; 0 for a call made on the Limiter.
	Batched int
}

// RetryAfter returns RetryAt - Time, the wait before acting or retrying (0 when there is none).
func (r Result) RetryAfter() time.Duration { return waitUntil(r.RetryAt, r.Time) }

// Err returns nil when the result is OK, else the denial as a *LimitedError.
func (r Result) Err() error {
	if r.OK {
		return nil
	}
	return &LimitedError{Name: r.Name, Key: r.Key, RetryAt: r.RetryAt, Time: r.Time, Denied: []Result{r}}
}

// Limit consumes one token of the limit name for key. It is shorthand for
// LimitN(ctx, db, name, key, 1, opts).
func (l *Limiter) Limit(ctx context.Context, db Executor, name, key string, opts *LimitOpts) (Result, error) {
	return l.single(ctx, db, "Limit", name, key, 1, opts, false)
}

// LimitN consumes count tokens of the limit name for key, if they are there (or, with
// opts.Reserve, if the debt stays within MaxReserved). A denial writes nothing. count must be
// finite, > 0 and, without Reserve, no more than the limit could ever grant at once.
func (l *Limiter) LimitN(ctx context.Context, db Executor, name, key string, count float64, opts *LimitOpts) (Result, error) {
	return l.single(ctx, db, "LimitN", name, key, count, opts, false)
}

// Check answers what Limit would, without consuming anything or taking a lock. It is shorthand for
// CheckN(ctx, db, name, key, 1, opts).
func (l *Limiter) Check(ctx context.Context, db Executor, name, key string, opts *LimitOpts) (Result, error) {
	return l.single(ctx, db, "Check", name, key, 1, opts, true)
}

// CheckN answers what LimitN would, without consuming anything or taking a lock. Result.Shards
// lists the shards LimitN would have charged.
func (l *Limiter) CheckN(ctx context.Context, db Executor, name, key string, count float64, opts *LimitOpts) (Result, error) {
	return l.single(ctx, db, "CheckN", name, key, count, opts, true)
}

func (l *Limiter) single(ctx context.Context, db Executor, op, name, key string, count float64, opts *LimitOpts, dry bool) (Result, error) {
	return firstResult(l.many(ctx, db, op, singleRequest(name, key, count, opts), true, dry, opts))
}

func (l *Limiter) many(ctx context.Context, db Executor, op string, reqs []Request, single, dry bool, opts *LimitOpts) (ManyResult, error) {
	if err := checkExecutor(op, db); err != nil {
		l.obs.decided(ctx, metricOp(op), time.Now(), reqs, ManyResult{}, err) // counted as any invalid call
		return ManyResult{}, err
	}
	return l.decide(ctx, op, reqs, single, dry, opts, func(c *call) (ManyResult, error) {
		out, err := l.decideCalls(ctx, db, []*call{c})
		if err != nil {
			return ManyResult{}, dbError(ctx, db, op, err)
		}
		return out[0].res, out[0].err
	})
}

// decide is the one path of every decision call, on the Limiter and on the Batcher: it validates
// the call (prepareCall), has run decide it, records its metrics and, when opts.AsError, turns a
// denial into a *LimitedError (returned with the result). A single call's opts are in its request.
func (l *Limiter) decide(ctx context.Context, op string, reqs []Request, single, dry bool, opts *LimitOpts, run func(*call) (ManyResult, error)) (ManyResult, error) {
	start := time.Now()
	c, err := l.prepareCall(op, reqs, single, dry)
	if err == nil && !single && opts != nil && (opts.Config != nil || opts.Reserve) {
		err = &ArgumentError{Op: op, Arg: "opts", Reason: "sets Config or Reserve, which a LimitMany or CheckMany takes in each Request"}
	}
	var m ManyResult
	if err == nil {
		m, err = run(c)
	}
	l.obs.decided(ctx, metricOp(op), start, reqs, m, err)
	if err != nil {
		return ManyResult{}, err
	}
	if opts.asError() && !m.OK {
		return m, m.Err()
	}
	return m, nil
}

// singleRequest is the request of a Limit, LimitN, Check or CheckN call.
func singleRequest(name, key string, count float64, opts *LimitOpts) []Request {
	r := Request{Name: name, Key: key, Count: count}
	if opts != nil {
		r.Config, r.Reserve = opts.Config, opts.Reserve
	}
	return []Request{r}
}

// firstResult is the Result of a single call from its ManyResult.
func firstResult(m ManyResult, err error) (Result, error) {
	if len(m.Results) == 0 {
		return Result{}, err
	}
	return m.Results[0], err
}

func (o *LimitOpts) asError() bool { return o != nil && o.AsError }

// Request is one limit of a LimitMany or CheckMany call.
type Request struct {
	// Name is the limit's name. Required.
	Name string
	// Key selects the instance of the limit, e.g. a user ID. Defaults to "", the global instance.
	Key string
	// Count is the number of tokens. Must be finite and > 0 when set. Defaults to 1.
	Count float64
	// Config overrides the registered config, as LimitOpts.Config. Defaults to nil.
	Config *Config
	// Reserve allows a reservation, as LimitOpts.Reserve. Defaults to false.
	Reserve bool
}

// ManyResult is the outcome of LimitMany or CheckMany.
type ManyResult struct {
	// OK reports whether every limit was granted, and so consumed. When false nothing was consumed.
	OK bool
	// RetryAt is when the whole call can go ahead. When OK, the latest RetryAt of its
	// reservations (zero when none had to wait); when denied, the latest RetryAt of the denied
	// limits (a limit that would have been granted as a reservation does not count).
	RetryAt time.Time
	// Results has one element per request, in order. When OK is false, each says whether that
	// limit alone would have been granted; none was consumed.
	Results []Result
	// Time is the clock reading the decision was made with (see Result.Time).
	Time time.Time
	// Batched is as Result.Batched: how many calls shared the Batcher's statement; 0 on the Limiter.
	Batched int
}

// RetryAfter returns RetryAt - Time, the wait before acting or retrying (0 when there is none).
func (m ManyResult) RetryAfter() time.Duration { return waitUntil(m.RetryAt, m.Time) }

// waitUntil is retryAt - now, or 0 when retryAt is zero or not after now: every RetryAfter.
func waitUntil(retryAt, now time.Time) time.Duration {
	if retryAt.IsZero() || !retryAt.After(now) {
		return 0
	}
	return retryAt.Sub(now)
}

// Denied returns the results that were not granted.
func (m ManyResult) Denied() []Result {
	var d []Result
	for _, r := range m.Results {
		if !r.OK {
			d = append(d, r)
		}
	}
	return d
}

// Err returns nil when the result is OK, else a *LimitedError naming every denial.
func (m ManyResult) Err() error {
	if m.OK {
		return nil
	}
	d := m.Denied()
	e := &LimitedError{RetryAt: m.RetryAt, Time: m.Time, Denied: d}
	if len(d) > 0 {
		e.Name, e.Key = d[0].Name, d[0].Key
	}
	return e
}

// LimitMany consumes every request or none, in one round trip: if any is denied, nothing is
// written. Rows are locked in one global order (name, key, shard), so two calls naming the same
// limits in different orders never deadlock. A (name, key) may appear only once.
func (l *Limiter) LimitMany(ctx context.Context, db Executor, reqs []Request, opts *LimitOpts) (ManyResult, error) {
	return l.many(ctx, db, "LimitMany", reqs, false, false, opts)
}

// CheckMany answers what LimitMany would, without consuming anything or taking a lock. One
// difference: when the call is denied, a request that alone would be granted keeps in
// Result.Shards and Result.TS what it would take alone, where LimitMany reports none.
func (l *Limiter) CheckMany(ctx context.Context, db Executor, reqs []Request, opts *LimitOpts) (ManyResult, error) {
	return l.many(ctx, db, "CheckMany", reqs, false, true, opts)
}

// clock is the instant a statement decides at, as sent to the database: LimiterConfig.Now in
// microseconds since the Unix epoch, or NULL for the database's own clock (docs/spec.md §2). A
// reading maxClockMicros or more from the epoch is an *ArgumentError.
func (l *Limiter) clock(op string) (pgtype.Int8, error) {
	if l.now == nil {
		return pgtype.Int8{}, nil
	}
	now := l.now()
	if !now.After(time.UnixMicro(-maxClockMicros)) || !now.Before(time.UnixMicro(maxClockMicros)) {
		return pgtype.Int8{}, &ArgumentError{Op: op, Arg: "LimiterConfig.Now", Reason: fmt.Sprintf(
			"returned %s: it must lie less than 2^61 µs (about 73,000 years) from the Unix epoch", now)}
	}
	return pgtype.Int8{Int64: now.UnixMicro(), Valid: true}, nil
}

// maxClockMicros bounds the readings of LimiterConfig.Now, in microseconds either side of the
// Unix epoch, so that a row written at one reading is decided at any other in bigint arithmetic:
// a row's ts lies at most a Period (< 2^52 µs) before the reading that wrote it (a fixed window's
// start), and a RetryAt search subtracts it from instants up to the reading plus the longest wait
// (2^61 µs, txlimit_retry_at's bound): 2^61 + 2^52 + 2^61 + 2^61 < 2^63.
const maxClockMicros = 1 << 61

// resolve validates name and key and finds the config.
func (l *Limiter) resolve(op, name, key string, inline *Config) (spec, error) {
	if err := checkName(op, name); err != nil {
		return spec{}, err
	}
	if err := checkKey(op, key); err != nil {
		return spec{}, err
	}
	var cfg Config
	if inline != nil {
		if err := inline.validate(name); err != nil {
			return spec{}, err
		}
		cfg = *inline
	} else {
		c, ok := l.limits[name]
		if !ok {
			return spec{}, &UnknownLimitError{Name: name}
		}
		cfg = c
	}
	return newSpec(name, key, cfg), nil
}

// checkExecutor rejects a nil Executor, including a typed nil pointer in the interface, and a
// value that no driver runs on.
func checkExecutor(op string, db Executor) error {
	const fix = "pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn, or wrap a database/sql handle with sqldb.Wrap (package github.com/txlimit/txlimit/sqldb)"
	if r := nilarg.Reason(db); r != "" {
		return &ArgumentError{Op: op, Arg: "db", Reason: r + ": " + fix}
	}
	if _, ok := stmtsFor(db); !ok {
		return &ArgumentError{Op: op, Arg: "db", Reason: fmt.Sprintf("is a %T: %s", db, fix)}
	}
	return nil
}

// usTime converts microseconds since the Unix epoch, the database's precision, to a UTC time.
func usTime(us int64) time.Time { return time.UnixMicro(us).UTC() }
