package ratelimit

import (
	"context"
	"time"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// State is the current state of one (name, key), as returned by Limiter.State.
type State struct {
	// Name and Key identify the limit.
	Name, Key string
	// Config is the config the state was evaluated with, defaults applied (Capacity and Shards as
	// in force).
	Config Config
	// Value is the number of tokens available now (refill applied), summed over every configured
	// shard; a missing shard row counts as full. Negative while reservations are owed. Values are
	// float8: a charge that combines two shards splits its count in halves, so after many of them
	// the sum can differ from the exact total by rounding (a few units in the last place).
	Value float64
	// TS is the latest stored timestamp of the rows of shards 0 to Config.Shards-1; zero when none
	// of them has a row (a full limit). Rows of shards ≥ Shards (left by an earlier, larger shard
	// count) are ignored, as Value ignores them.
	TS time.Time
	// Shards has the tokens available now in each configured shard, indexed by shard.
	Shards []float64
	// Time is the instant the state was evaluated at.
	Time time.Time
}

// State returns the current state of (name, key) without locking or writing. Rows of shards beyond
// Config.Shards (left by an earlier, larger shard count) are ignored, as decisions ignore them.
func (l *Limiter) State(ctx context.Context, db Executor, name, key string, opts *LimitOpts) (State, error) {
	const op = "State"
	s, err := l.prepare(op, db, name, key, opts)
	if err != nil {
		return State{}, err
	}
	now, err := l.clock(op)
	if err != nil {
		return State{}, err
	}
	rows, err := via(on(db), ctx, dbsqlc.LevelsParams{
		NowUs: now, Name: name, Key: key,
		StepUs: s.stepUs, Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity,
	}, (*dbsqlc.Queries).Levels, driver.Executor.Levels)
	if err != nil {
		return State{}, dbError(ctx, db, op, err)
	}
	st := State{Name: name, Key: key, Config: s.effective(), Shards: make([]float64, s.shards)}
	for i := range st.Shards {
		st.Shards[i] = s.capacity
	}
	hasRow := false // whether st.TS is set: a ts can lie before year 1, the zero time.Time
	for _, row := range rows {
		st.Time = usTime(row.NowUs)
		if row.Shard < 0 || int(row.Shard) >= s.shards { // shard -1: the clock-only row of a limit without rows
			continue
		}
		st.Shards[row.Shard] = row.Level
		if ts := usTime(row.TsUs); !hasRow || ts.After(st.TS) {
			st.TS, hasRow = ts, true
		}
	}
	for _, v := range st.Shards {
		st.Value += v
	}
	return st, nil
}

// Reset removes every shard row of (name, key), so the limit is full again. Resetting a limit that
// has no rows is not an error; a name needs no config to be reset. It holds the key's shards as
// Credit does (in shard order, up to the highest that has a row, with the same cost in Postgres's
// lock table: see Credit), so that under READ COMMITTED a Reset that waits for a decision also
// deletes the rows that decision created.
func (l *Limiter) Reset(ctx context.Context, db Executor, name, key string) error {
	const op = "Reset"
	if err := checkExecutor(op, db); err != nil {
		return err
	}
	if err := checkName(op, name); err != nil {
		return err
	}
	if err := checkKey(op, key); err != nil {
		return err
	}
	if _, err := via(on(db), ctx, dbsqlc.ResetParams{Name: name, Key: key}, (*dbsqlc.Queries).Reset, driver.Executor.Reset); err != nil {
		return dbError(ctx, db, op, err)
	}
	return nil
}

// CreditResult is the outcome of Credit.
type CreditResult struct {
	// Name and Key identify the limit.
	Name, Key string
	// Credited is how many tokens were given back: count, or less where the limit was too full to
	// take them all.
	Credited float64
	// Value is the number of tokens available after the credit, summed over every shard (see
	// State.Value on rounding).
	Value float64
	// Time is the instant the credit was evaluated at.
	Time time.Time
}

// Credit gives count tokens back to (name, key), e.g. to settle a reservation with the actual
// usage: the value becomes min(value + count, capacity), never above capacity. With shards, the
// tokens go to the emptiest shards first. To charge more instead, call LimitN with Reserve.
//
// Credit first holds the key's shards in shard order (the order decisions lock rows in), up to the
// highest that has a row: an existing row by its row lock, a missing one by the transaction-scoped
// advisory lock that a decision creating that row holds, so that under READ COMMITTED it waits for
// such a decision as for one writing a row and credits the shards as they are at one instant. Both
// are held until the transaction ends (a decision that would create a held missing shard waits for
// it); each missing shard held takes an entry of Postgres's lock table, shared by every session
// (max_locks_per_transaction × max_connections entries, 6,400 by default). On a limit of many
// shards whose rows are few and far apart a Credit can take nearly one per shard: 1,023 for a key
// of 1,024 shards whose only row is the last; raise max_locks_per_transaction before crediting or
// resetting such keys concurrently, or their calls and everyone else's fail with "out of shared
// memory".
func (l *Limiter) Credit(ctx context.Context, db Executor, name, key string, count float64, opts *LimitOpts) (CreditResult, error) {
	const op = "Credit"
	s, err := l.prepare(op, db, name, key, opts)
	if err != nil {
		return CreditResult{}, err
	}
	if err := checkCount(op, count); err != nil {
		return CreditResult{}, err
	}
	now, err := l.clock(op)
	if err != nil {
		return CreditResult{}, err
	}
	rows, err := via(on(db), ctx, dbsqlc.CreditParams{
		NowUs: now, Name: name, Key: key, Shards: int32(s.shards), Count: count,
		StepUs: s.stepUs, Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity,
	}, (*dbsqlc.Queries).Credit, driver.Executor.Credit)
	if err != nil {
		return CreditResult{}, dbError(ctx, db, op, err)
	}
	existing := 0
	for _, row := range rows {
		if row.Shard >= 0 { // shard -1 is the clock-only row of a limit without rows
			existing++
		}
	}
	res := CreditResult{Name: name, Key: key, Value: float64(s.shards-existing) * s.capacity}
	for _, row := range rows {
		res.Time = usTime(row.NowUs)
		if row.Shard >= 0 {
			res.Credited += row.After - row.Before
			res.Value += row.After
		}
	}
	return res, nil
}

// prepare validates the common arguments of State, Credit and Prune and resolves the config: of
// opts, they read only Config (Prune passes its PruneOpts.Config).
func (l *Limiter) prepare(op string, db Executor, name, key string, opts *LimitOpts) (spec, error) {
	if err := checkExecutor(op, db); err != nil {
		return spec{}, err
	}
	var inline *Config
	if opts != nil {
		if opts.Reserve || opts.AsError {
			return spec{}, &ArgumentError{Op: op, Arg: "opts", Reason: "sets Reserve or AsError, which only a decision reads: " + op + " reads only opts.Config"}
		}
		inline = opts.Config
	}
	return l.resolve(op, name, key, inline)
}

// Lookup returns the config that a call on (name, key) would use, with its defaults applied (the
// Capacity and Shards in force): cfg when it is not nil, otherwise the one registered under name.
// It returns the error such a call would return for
// them (an *ArgumentError for a bad name or key, a *ConfigError for a bad cfg, an
// *UnknownLimitError for an unregistered name without cfg; all match ErrInvalid), and does no I/O.
func (l *Limiter) Lookup(name, key string, cfg *Config) (Config, error) {
	s, err := l.resolve("Lookup", name, key, cfg)
	if err != nil {
		return Config{}, err
	}
	return s.effective(), nil
}
