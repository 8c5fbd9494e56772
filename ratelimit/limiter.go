package ratelimit

import (
	"context"
	"fmt"
	"math"
	"reflect"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txlimit/txlimit/internal/dbsqlc"
)

// Executor runs SQL: a pgx.Tx, *pgxpool.Pool or *pgx.Conn. Inside a transaction a limit's writes
// commit or roll back with the caller's own.
type Executor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// LimiterConfig configures a Limiter. A nil *LimiterConfig is the zero value.
type LimiterConfig struct {
	// Limits are the named limits, validated by New. Calls may also pass a Config inline, which
	// takes precedence over a registered one. Defaults to none.
	Limits map[string]Config

	// Now, when set, supplies the time every decision is evaluated at instead of the database's
	// clock (clock_timestamp()). It exists for tests; production should leave it nil so that app
	// servers with skewed clocks agree. Defaults to nil: the database's clock.
	Now func() time.Time
}

// Limiter decides rate limits stored in Postgres (table txlimit_state, created by the migrations
// package). It holds only configuration, so it is cheap, safe for concurrent use, and one per
// application is enough.
//
// Every call takes an Executor and makes one SQL round trip. Decisions are exact at any isolation
// level: a request is granted only if, at the moment it holds the row lock, the tokens are there.
type Limiter struct {
	limits map[string]Config
	now    func() time.Time
	// pick chooses two distinct shards of n (n >= 2). Tests replace it.
	pick func(n int) (int, int)
}

// New returns a Limiter for the named limits. It returns a *ConfigError naming the first invalid
// field, or an *ArgumentError for an invalid name.
func New(config *LimiterConfig) (*Limiter, error) {
	if config == nil {
		config = &LimiterConfig{}
	}
	l := &Limiter{limits: make(map[string]Config, len(config.Limits)), now: config.Now, pick: pickTwo}
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

// LimitOpts are the options of Limit, LimitN, Check and CheckN. A nil *LimitOpts is the zero value.
type LimitOpts struct {
	// Config, when set, is used instead of the limit registered under the name (and makes an
	// unregistered name valid). Defaults to nil: the registered config.
	Config *Config

	// Reserve lets the limit go below zero, down to -MaxReserved: the call is granted as a
	// reservation (Result.Reserved) and the caller should act at Result.RetryAt. Defaults to false.
	Reserve bool

	// Throw turns a denial into a *LimitedError, so that a caller inside a transaction can return it
	// and roll back. A granted reservation is never an error. Defaults to false.
	Throw bool
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

	// RetryAt is when the call can go ahead: for a reservation, when its tokens have accrued and the
	// caller should act; for a denial, when the tokens the call asked for will have accrued (SPEC
	// §3: ts' + (−v)/r), so the same call without Reserve is granted then, all else equal. Zero when
	// OK and not Reserved. Microsecond precision, rounded up. For a 10/minute token bucket holding
	// 0.5 tokens, a call for 1 is denied with RetryAt three seconds after the decision.
	RetryAt time.Time

	// Value is the number of tokens left after the call (negative after a reservation). With
	// Shards > 1 it covers only the shards this call looked at; Limiter.Value gives the exact total.
	Value float64

	// Shards lists the shard rows that were charged ([0] for an unsharded limit); empty when denied.
	Shards []int

	// Time is the clock reading the decision was made with: the database's clock, read once per
	// statement before any wait for a row lock, unless LimiterConfig.Now is set. A row whose ts is
	// later (a concurrent call read the clock after this one but committed first) is evaluated at
	// its ts instead, since time never runs backwards for a row; so under contention Time can trail
	// the instant the decision took effect by the wait. RetryAt is computed from the row as
	// evaluated, so it is right either way.
	Time time.Time
}

// RetryAfter returns RetryAt - Time, the wait before acting or retrying (0 when there is none).
func (r Result) RetryAfter() time.Duration {
	if r.RetryAt.IsZero() || !r.RetryAt.After(r.Time) {
		return 0
	}
	return r.RetryAt.Sub(r.Time)
}

// Err returns nil when the result is OK, else the denial as a *LimitedError.
func (r Result) Err() error {
	if r.OK {
		return nil
	}
	return &LimitedError{Name: r.Name, Key: r.Key, RetryAt: r.RetryAt, Denied: []Result{r}}
}

// Limit consumes one token of the limit name for key. It is shorthand for
// LimitN(ctx, db, name, key, 1, opts).
func (l *Limiter) Limit(ctx context.Context, db Executor, name, key string, opts *LimitOpts) (Result, error) {
	return l.LimitN(ctx, db, name, key, 1, opts)
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
	return l.CheckN(ctx, db, name, key, 1, opts)
}

// CheckN answers what LimitN would, without consuming anything or taking a lock. Result.Shards
// lists the shards LimitN would have charged.
func (l *Limiter) CheckN(ctx context.Context, db Executor, name, key string, count float64, opts *LimitOpts) (Result, error) {
	return l.single(ctx, db, "CheckN", name, key, count, opts, true)
}

func (l *Limiter) single(ctx context.Context, db Executor, op, name, key string, count float64, opts *LimitOpts, dry bool) (Result, error) {
	if opts == nil {
		opts = &LimitOpts{}
	}
	if err := checkCount(op, count); err != nil {
		return Result{}, err
	}
	r, err := l.one(ctx, db, op, name, key, count, opts, dry)
	if err != nil {
		return Result{}, err
	}
	if opts.Throw && !r.OK {
		return r, r.Err()
	}
	return r, nil
}

// one decides a single request with a lean single-request statement: DecideOne for an unsharded
// limit, DecideSharded for a sharded one.
func (l *Limiter) one(ctx context.Context, db Executor, op, name, key string, count float64, opts *LimitOpts, dry bool) (Result, error) {
	if err := checkExecutor(op, db); err != nil {
		return Result{}, err
	}
	s, err := l.resolve(op, name, key, opts.Config)
	if err != nil {
		return Result{}, err
	}
	if err := s.checkRequest(op, count, opts.Reserve); err != nil {
		return Result{}, err
	}
	a, b := 0, -1
	var cands []int32
	if s.shards >= 2 {
		a, b = l.pick(s.shards)
		cands = shardCandidates(s.shards, a, b)
	}
	q := dbsqlc.New()
	decide := func(now pgtype.Timestamptz) (dbsqlc.DecideRow, error) {
		if b < 0 {
			row, err := q.DecideOne(ctx, db, dbsqlc.DecideOneParams{
				Now: now, Name: name, Key: key, Dry: dry, Count: count, Reserve: opts.Reserve, MaxReserved: s.maxRes,
				Cap: s.capacity, Kind: s.kind, Rate: s.rate, PeriodUs: s.periodUs, AnchorUs: s.anchorUs,
			})
			return dbsqlc.DecideRow{
				Status: row.Status, Charge: 1, OkNow: row.OkNow, Reserved: row.Reserved,
				LevelA: row.Level, EndA: row.EndValue, TsAUs: row.TsUs, NowUs: row.NowUs,
			}, err
		}
		row, err := q.DecideSharded(ctx, db, dbsqlc.DecideShardedParams{
			Now: now, Name: name, Key: key, Dry: dry, Count: count, Reserve: opts.Reserve, MaxReserved: s.maxRes,
			Cap: s.capacity, Kind: s.kind, Rate: s.rate, PeriodUs: s.periodUs, AnchorUs: s.anchorUs,
			Cands: cands, LockBase: shardLockBase(name, key),
		})
		a, b = int(row.ShardA), int(row.ShardB)
		return dbsqlc.DecideRow{
			Status: row.Status, Charge: row.Charge, OkNow: row.OkNow, Reserved: row.Reserved,
			LevelA: row.LevelA, LevelB: row.LevelB, EndA: row.EndA, EndB: row.EndB,
			TsAUs: row.TsAUs, TsBUs: row.TsBUs, NowUs: row.NowUs,
		}, err
	}
	for attempt := 1; ; attempt++ {
		row, err := decide(l.clock())
		if err != nil {
			return Result{}, dbError(ctx, db, op, err)
		}
		if row.Status == statusBusy {
			return Result{}, &BusyError{Name: name, Key: key, Candidates: len(cands)}
		}
		if row.Status == statusRerun {
			if attempt == maxReruns {
				return Result{}, fmt.Errorf("ratelimit: %s: limit row kept appearing concurrently; gave up after %d attempts", op, attempt)
			}
			continue
		}
		granted := row.OkNow || row.Reserved
		if !dry && granted && row.Status != statusWritten {
			return Result{}, fmt.Errorf("ratelimit: %s: internal error: granted but not written (status %d)", op, row.Status)
		}
		return toResult(s, row, a, b), nil
	}
}

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

// ManyOpts are the options of LimitMany and CheckMany. A nil *ManyOpts is the zero value.
type ManyOpts struct {
	// Throw turns a denial into a *LimitedError listing every denied limit. Defaults to false.
	Throw bool
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
	e := &LimitedError{RetryAt: m.RetryAt, Denied: d}
	if len(d) > 0 {
		e.Name, e.Key = d[0].Name, d[0].Key
	}
	return e
}

// LimitMany consumes every request or none, in one round trip: if any is denied, nothing is
// written. Rows are locked in one global order (name, key, shard), so two calls naming the same
// limits in different orders never deadlock. A (name, key) may appear only once.
func (l *Limiter) LimitMany(ctx context.Context, db Executor, reqs []Request, opts *ManyOpts) (ManyResult, error) {
	return l.manyOpts(ctx, db, "LimitMany", reqs, opts, false)
}

// CheckMany answers what LimitMany would, without consuming anything or taking a lock.
func (l *Limiter) CheckMany(ctx context.Context, db Executor, reqs []Request, opts *ManyOpts) (ManyResult, error) {
	return l.manyOpts(ctx, db, "CheckMany", reqs, opts, true)
}

func (l *Limiter) manyOpts(ctx context.Context, db Executor, op string, reqs []Request, opts *ManyOpts, dry bool) (ManyResult, error) {
	res, err := l.many(ctx, db, op, reqs, dry)
	if err != nil {
		return ManyResult{}, err
	}
	if opts != nil && opts.Throw && !res.OK {
		return res, res.Err()
	}
	return res, nil
}

// maxReruns bounds how often a decision is re-run because a missing row was created concurrently
// (status 3 of the Decide query). Each re-run sees the rows the previous one found or created.
const maxReruns = 8

func (l *Limiter) many(ctx context.Context, db Executor, op string, reqs []Request, dry bool) (ManyResult, error) {
	if err := checkExecutor(op, db); err != nil {
		return ManyResult{}, err
	}
	if len(reqs) == 0 {
		return ManyResult{}, &ArgumentError{Op: op, Arg: "requests", Reason: "must not be empty"}
	}
	specs := make([]spec, len(reqs))
	counts := make([]float64, len(reqs))
	seen := make(map[[2]string]bool, len(reqs))
	for i, r := range reqs {
		s, err := l.resolve(op, r.Name, r.Key, r.Config)
		if err != nil {
			return ManyResult{}, err
		}
		if seen[[2]string{r.Name, r.Key}] {
			return ManyResult{}, &ArgumentError{Op: op, Arg: "requests", Reason: fmt.Sprintf("name %q key %q appears twice", r.Name, r.Key)}
		}
		seen[[2]string{r.Name, r.Key}] = true
		counts[i] = r.Count
		if counts[i] == 0 {
			counts[i] = 1
		}
		if err := s.checkRequest(op, counts[i], r.Reserve); err != nil {
			return ManyResult{}, err
		}
		specs[i] = s
	}

	p := dbsqlc.DecideParams{Dry: dry}
	for i, s := range specs {
		a, b := 0, -1
		if s.shards >= 2 {
			a, b = l.pick(s.shards)
		}
		p.Names = append(p.Names, s.name)
		p.Keys = append(p.Keys, s.key)
		p.Counts = append(p.Counts, counts[i])
		p.Kinds = append(p.Kinds, s.kind)
		p.Rates = append(p.Rates, s.rate)
		p.PeriodsUs = append(p.PeriodsUs, s.periodUs)
		p.Caps = append(p.Caps, s.capacity)
		p.MaxReserved = append(p.MaxReserved, s.maxRes)
		p.Reserves = append(p.Reserves, reqs[i].Reserve)
		p.AnchorsUs = append(p.AnchorsUs, s.anchorUs)
		p.ShardsA = append(p.ShardsA, int32(a))
		p.ShardsB = append(p.ShardsB, int32(b))
	}

	q := dbsqlc.New()
	var rows []dbsqlc.DecideRow
	for attempt := 1; ; attempt++ {
		p.Now = l.clock()
		var err error
		rows, err = q.Decide(ctx, db, p)
		if err != nil {
			return ManyResult{}, dbError(ctx, db, op, err)
		}
		if len(rows) != len(specs) {
			return ManyResult{}, fmt.Errorf("ratelimit: %s: decision returned %d rows for %d requests", op, len(rows), len(specs))
		}
		if rows[0].Status != statusRerun {
			break
		}
		if attempt == maxReruns {
			return ManyResult{}, fmt.Errorf("ratelimit: %s: limit rows kept appearing concurrently; gave up after %d attempts", op, attempt)
		}
	}

	// Fail closed: a decision that granted every request must have written it (or be a dry run).
	if !dry && rows[0].Status != statusWritten && allGranted(rows) {
		return ManyResult{}, fmt.Errorf("ratelimit: %s: internal error: granted but not written (status %d)", op, rows[0].Status)
	}
	out := ManyResult{OK: rows[0].Status == statusWritten || (dry && allGranted(rows)), Results: make([]Result, len(rows))}
	for i, row := range rows {
		r := toResult(specs[i], row, int(p.ShardsA[i]), int(p.ShardsB[i]))
		if !out.OK && !dry {
			r.Shards = nil // nothing was consumed
		}
		out.Results[i] = r
		// Granted: act when the last reservation is due. Denied: retry when the last denial clears.
		if (out.OK || !r.OK) && r.RetryAt.After(out.RetryAt) {
			out.RetryAt = r.RetryAt
		}
	}
	return out, nil
}

// Statuses of the Decide query.
const (
	statusWritten   = 0 // every request granted and written
	statusDenied    = 1 // decided on locked rows: some request denied, nothing written
	statusUnwritten = 2 // decided on a lock-free read: dry run, or a denial visible without locking
	statusRerun     = 3 // a missing row appeared concurrently: nothing written, run again
	statusBusy      = 4 // DecideSharded only: every candidate shard taken under a snapshot; nothing read or written
)

func allGranted(rows []dbsqlc.DecideRow) bool {
	for _, r := range rows {
		if !r.OkNow && !r.Reserved {
			return false
		}
	}
	return true
}

// toResult turns one row of the Decide query into a Result; a and b are the candidate shards
// (b < 0 for an unsharded limit).
func toResult(s spec, row dbsqlc.DecideRow, a, b int) Result {
	r := Result{
		Name:     s.name,
		Key:      s.key,
		OK:       row.OkNow || row.Reserved,
		Reserved: row.Reserved,
		Time:     usTime(row.NowUs),
	}
	chargedA := row.Charge == 1 || row.Charge == 3
	chargedB := b >= 0 && (row.Charge == 2 || row.Charge == 3)
	if r.OK {
		r.Value = row.EndA
		if b >= 0 {
			r.Value += row.EndB
		}
		if chargedA {
			r.Shards = append(r.Shards, a)
		}
		if chargedB {
			r.Shards = append(r.Shards, b)
		}
	} else {
		r.Value = row.LevelA
		if b >= 0 {
			r.Value += row.LevelB
		}
	}
	if !row.OkNow {
		var at int64
		if chargedA {
			at = max(at, retryAtUs(s, row.EndA, row.TsAUs))
		}
		if chargedB {
			at = max(at, retryAtUs(s, row.EndB, row.TsBUs))
		}
		r.RetryAt = usTime(at)
	}
	return r
}

// maxWaitUs bounds a computed wait so that RetryAt stays a valid time (about 100,000 years).
const maxWaitUs = 1 << 61

// retryAtUs returns when a shard row left at value end (at tsUs) has accrued back to zero: the
// first microsecond (token bucket) or window start (fixed window) at which the row, evaluated as the
// SQL evaluates it, holds >= 0. The exact ceiling is the starting guess; float rounding can put the
// answer one step either side of it, so it is adjusted both ways.
func retryAtUs(s spec, end float64, tsUs int64) int64 {
	if end >= 0 {
		return tsUs
	}
	if s.kind == int16(TokenBucket) {
		level := func(w float64) float64 { return end + w*s.rate/float64(s.periodUs) }
		w := math.Ceil(-end * float64(s.periodUs) / s.rate)
		if w >= maxWaitUs {
			return tsUs + maxWaitUs
		}
		for w > 1 && level(w-1) >= 0 {
			w--
		}
		for level(w) < 0 {
			w++
		}
		return tsUs + int64(w)
	}
	level := func(n float64) float64 { return end + float64(s.rate*n) }
	n := math.Ceil(-end / s.rate)
	if n*float64(s.periodUs) >= maxWaitUs {
		return tsUs + maxWaitUs
	}
	for n > 1 && level(n-1) >= 0 {
		n--
	}
	for level(n) < 0 {
		n++
	}
	return tsUs + int64(n)*s.periodUs
}

func (l *Limiter) clock() pgtype.Timestamptz {
	if l.now == nil {
		return pgtype.Timestamptz{}
	}
	return pgtype.Timestamptz{Time: l.now(), Valid: true}
}

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

// checkExecutor rejects a nil Executor, including a typed nil pointer in the interface.
func checkExecutor(op string, db Executor) error {
	if db == nil {
		return &ArgumentError{Op: op, Arg: "db", Reason: "is nil: pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn"}
	}
	if v := reflect.ValueOf(db); v.Kind() == reflect.Pointer && v.IsNil() {
		return &ArgumentError{Op: op, Arg: "db", Reason: fmt.Sprintf("is a nil %T: pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn", db)}
	}
	return nil
}

// usTime converts microseconds since the Unix epoch, the database's precision, to a UTC time.
func usTime(us int64) time.Time { return time.UnixMicro(us).UTC() }
