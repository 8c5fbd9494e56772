//go:build reliability

package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// badWant is how a hostile input must be answered.
type badWant int

const (
	badArgument badWant = iota // *ratelimit.ArgumentError, errors.Is(err, ratelimit.ErrInvalid)
	badConfig                  // *ratelimit.ConfigError, errors.Is(err, ratelimit.ErrInvalid)
	badUnknown                 // *ratelimit.UnknownLimitError, errors.Is(err, ratelimit.ErrInvalid)
	badCanceled                // errors.Is(err, context.Canceled), not ErrInvalid
	badDeadline                // errors.Is(err, context.DeadlineExceeded), not ErrInvalid
)

func (w badWant) String() string {
	return [...]string{"*ratelimit.ArgumentError", "*ratelimit.ConfigError", "*ratelimit.UnknownLimitError",
		"context.Canceled", "context.DeadlineExceeded"}[w]
}

// badBundle is what the cases call into: a migrated schema (txlimit and River) with some state.
type badBundle struct {
	pool  *pgxpool.Pool
	lim   *ratelimit.Limiter
	river *river.Client[pgx.Tx]
	sched *scheduler.Scheduler
}

// badCase is one hostile input. Exactly one of call and tx is set: tx runs inside a transaction
// that the case runner commits after the refusal, since bad input must leave the caller's
// transaction as it was.
type badCase struct {
	name     string
	want     badWant
	contains []string // what the error text must say: the argument or field, and what is wrong
	call     func(ctx context.Context, b *badBundle) error
	tx       func(ctx context.Context, b *badBundle, tx pgx.Tx) error
	// brokenTx: the call is interrupted mid-statement, after which pgx closes the connection and
	// the transaction cannot commit (nothing must be written all the same).
	brokenTx bool
}

// badArgs is a job whose args JSON cannot encode when F is NaN.
type badArgs struct {
	F float64 `json:"f"`
}

func (badArgs) Kind() string { return "txlimit_bad_job" }

// badSnapshot is everything a call could have written: the state rows and River's jobs.
type badSnapshot struct {
	stateRows int64  // rows of txlimit_state
	stateSum  string // md5 of every row of txlimit_state
	jobs      int64
	jobsSum   string // md5 of every river_job row
}

func badSnap(t *testing.T, db *pgxpool.Pool) badSnapshot {
	t.Helper()
	var s badSnapshot
	err := db.QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM txlimit_state WHERE name <> ''),
		(SELECT md5(coalesce(string_agg(format('%L %L %s %s %s', name, key, shard, value, ts), E'\n' ORDER BY name, key, shard), ''))
			FROM txlimit_state),
		(SELECT count(*) FROM river_job),
		(SELECT md5(coalesce(string_agg(format('%s %s %s %s %s %s', id, state, scheduled_at, args, metadata, attempt), E'\n' ORDER BY id), ''))
			FROM river_job)`).Scan(&s.stateRows, &s.stateSum, &s.jobs, &s.jobsSum)
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	return s
}

// badCheck reports what is wrong with err as the answer to c, or "" when it is right.
func badCheck(c badCase, err error) string {
	if err == nil {
		return "accepted: no error"
	}
	var (
		ae *ratelimit.ArgumentError
		ce *ratelimit.ConfigError
		ue *ratelimit.UnknownLimitError
	)
	var problems []string
	invalid := errors.Is(err, ratelimit.ErrInvalid)
	switch c.want {
	case badArgument:
		if !errors.As(err, &ae) {
			problems = append(problems, "not a *ratelimit.ArgumentError")
		}
	case badConfig:
		if !errors.As(err, &ce) {
			problems = append(problems, "not a *ratelimit.ConfigError")
		}
	case badUnknown:
		if !errors.As(err, &ue) {
			problems = append(problems, "not a *ratelimit.UnknownLimitError")
		}
	case badCanceled:
		if !errors.Is(err, context.Canceled) {
			problems = append(problems, "not errors.Is(err, context.Canceled)")
		}
	case badDeadline:
		if !errors.Is(err, context.DeadlineExceeded) {
			problems = append(problems, "not errors.Is(err, context.DeadlineExceeded)")
		}
	}
	switch {
	case c.want <= badUnknown && !invalid:
		problems = append(problems, "not errors.Is(err, ratelimit.ErrInvalid)")
	case c.want > badUnknown && invalid:
		problems = append(problems, "a cancelled call must not claim invalid input (errors.Is(err, ratelimit.ErrInvalid))")
	}
	for _, w := range c.contains {
		if !strings.Contains(err.Error(), w) {
			problems = append(problems, fmt.Sprintf("the text does not say %q", w))
		}
	}
	if len(problems) == 0 {
		return ""
	}
	return fmt.Sprintf("%s (got %T: %v)", strings.Join(problems, "; "), err, err)
}

// badCases is the table: hostile inputs through the public API of ratelimit and scheduler. It
// complements ratelimit/badinput_test.go, which covers each validation rule once through LimitN:
// here every call of both packages gets the inputs that API takes, plus what only an outside
// caller can do (contexts, nil values of each kind, River's arguments).
func badCases() []badCase {
	cfg := func(c ratelimit.Config) *ratelimit.Config { return &c }
	limitN := func(name, key string, n float64, opts *ratelimit.LimitOpts) func(context.Context, *badBundle) error {
		return func(ctx context.Context, b *badBundle) error {
			_, err := b.lim.LimitN(ctx, b.pool, name, key, n, opts)
			return err
		}
	}
	many := func(reqs ...ratelimit.Request) func(context.Context, *badBundle) error {
		return func(ctx context.Context, b *badBundle) error {
			_, err := b.lim.LimitMany(ctx, b.pool, reqs, nil)
			return err
		}
	}
	credit := func(name, key string, n float64, opts *ratelimit.LimitOpts) func(context.Context, *badBundle) error {
		return func(ctx context.Context, b *badBundle) error {
			_, err := b.lim.Credit(ctx, b.pool, name, key, n, opts)
			return err
		}
	}
	reserve := func(name, key string, n float64, args river.JobArgs, opts *scheduler.ReserveOpts) func(context.Context, *badBundle, pgx.Tx) error {
		return func(ctx context.Context, b *badBundle, tx pgx.Tx) error {
			_, err := b.sched.ReserveTx(ctx, tx, name, key, n, args, opts)
			return err
		}
	}
	reserveMany := func(args river.JobArgs, reqs ...ratelimit.Request) func(context.Context, *badBundle, pgx.Tx) error {
		return func(ctx context.Context, b *badBundle, tx pgx.Tx) error {
			_, err := b.sched.ReserveManyTx(ctx, tx, reqs, args, nil)
			return err
		}
	}
	settle := func(s scheduler.Settlement, actual float64) func(context.Context, *badBundle) error {
		return func(ctx context.Context, b *badBundle) error {
			_, err := s.Settle(ctx, b.pool, b.lim, actual, nil)
			return err
		}
	}
	cancelled := func() context.Context {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		return ctx
	}
	expired := func() context.Context {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		defer cancel() // Err stays DeadlineExceeded after cancel
		return ctx
	}
	var (
		nilConn *pgx.Conn
		nilPool *pgxpool.Pool
		nilTx   pgx.Tx
	)
	noFn := func(context.Context, pgx.Tx) error { return nil }
	dropKey := "'; DROP TABLE txlimit_state; --\x00"
	longUTF8 := strings.Repeat("é", ratelimit.MaxKeyLen/2+1) // 513 runes, 1026 bytes: the bound is in bytes
	zero := ratelimit.Config{}
	job := badArgs{F: 1}

	return []badCase{
		// Counts: non-finite, negative, zero, huge and tiny, through every call that takes one.
		{name: "LimitN count math.MaxFloat64 with an unbounded Reserve", want: badArgument, contains: []string{"count", "at most 1e+15"},
			call: limitN("ok", "k", math.MaxFloat64, &ratelimit.LimitOpts{Reserve: true})},
		{name: "LimitN count smallest denormal 5e-324", want: badArgument, contains: []string{"count", "at least 1e-09"},
			call: limitN("ok", "k", math.SmallestNonzeroFloat64, nil)},
		{name: "LimitN count negative zero", want: badArgument, contains: []string{"count must be > 0"},
			call: limitN("ok", "k", math.Copysign(0, -1), nil)},
		{name: "CheckN count NaN", want: badArgument, contains: []string{"CheckN", "count must be finite"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.CheckN(ctx, b.pool, "ok", "k", math.NaN(), nil)
				return err
			}},
		{name: "Credit count +Inf", want: badArgument, contains: []string{"Credit", "count must be finite"}, call: credit("ok", "seed", math.Inf(1), nil)},
		{name: "Credit count negative (a charge in disguise)", want: badArgument, contains: []string{"count must be > 0"}, call: credit("ok", "seed", -5, nil)},
		{name: "Credit count 1e300", want: badArgument, contains: []string{"count", "at most 1e+15"}, call: credit("ok", "seed", 1e300, nil)},
		{name: "LimitMany Request.Count NaN", want: badArgument, contains: []string{"LimitMany", "count must be finite"},
			call: many(ratelimit.Request{Name: "ok", Key: "a"}, ratelimit.Request{Name: "ok", Key: "b", Count: math.NaN()})},
		{name: "LimitMany Request.Count +Inf with Reserve", want: badArgument, contains: []string{"count must be finite"},
			call: many(ratelimit.Request{Name: "ok", Key: "a", Count: math.Inf(1), Reserve: true})},
		{name: "CheckMany Request.Count -Inf", want: badArgument, contains: []string{"CheckMany", "count must be finite"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.CheckMany(ctx, b.pool, []ratelimit.Request{{Name: "ok", Key: "a", Count: math.Inf(-1)}}, nil)
				return err
			}},
		{name: "LimitMany Request.Count 1e16 with an unbounded Reserve", want: badArgument, contains: []string{"at most 1e+15"},
			call: many(ratelimit.Request{Name: "ok", Key: "a", Count: 1e16, Reserve: true})},

		// Keys: NUL bytes, invalid UTF-8 and over-long, through every call that takes one.
		{name: "key of 513 two-byte runes (1026 bytes) through LimitMany", want: badArgument, contains: []string{"key", "MaxKeyLen"},
			call: many(ratelimit.Request{Name: "ok", Key: longUTF8})},
		{name: "key with an encoded surrogate (invalid UTF-8) through Check", want: badArgument, contains: []string{"key", "UTF-8"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Check(ctx, b.pool, "ok", "\xed\xa0\x80", nil)
				return err
			}},
		{name: "key with an overlong encoding of '/' through Value", want: badArgument, contains: []string{"key", "UTF-8"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.State(ctx, b.pool, "ok", "\xc0\xaf", nil)
				return err
			}},
		{name: "key of a single NUL byte through Credit", want: badArgument, contains: []string{"key", "NUL"}, call: credit("ok", "\x00", 1, nil)},
		{name: "key: SQL injection ending in a NUL byte, through Reset", want: badArgument, contains: []string{"key", "NUL"},
			call: func(ctx context.Context, b *badBundle) error { return b.lim.Reset(ctx, b.pool, "ok", dropKey) }},
		{name: "key not UTF-8 through CheckMany", want: badArgument, contains: []string{"key", "UTF-8"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.CheckMany(ctx, b.pool, []ratelimit.Request{{Name: "ok", Key: "seed"}, {Name: "ok", Key: "\xff"}}, nil)
				return err
			}},

		// Names.
		{name: "name over MaxNameLen through Credit", want: badArgument, contains: []string{"name", "more than 256"},
			call: credit(strings.Repeat("n", 257), "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Rate: 1, Period: time.Second})})},
		{name: "name with a NUL byte through Reset", want: badArgument, contains: []string{"name", "NUL"},
			call: func(ctx context.Context, b *badBundle) error { return b.lim.Reset(ctx, b.pool, "ok\x00", "seed") }},
		{name: "name not UTF-8 through Prune", want: badArgument, contains: []string{"name", "UTF-8"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Prune(ctx, b.pool, "\xfe\xff", &ratelimit.PruneOpts{Config: cfg(ratelimit.Config{Rate: 1, Period: time.Second})})
				return err
			}},
		{name: "empty name through Prune", want: badArgument, contains: []string{"name must not be empty"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Prune(ctx, b.pool, "", &ratelimit.PruneOpts{Config: cfg(ratelimit.Config{Rate: 1, Period: time.Second})})
				return err
			}},
		{name: "zero-value Request (empty name) in LimitMany", want: badArgument, contains: []string{"name must not be empty"},
			call: many(ratelimit.Request{Name: "ok", Key: "a"}, ratelimit.Request{})},
		{name: "New: a registered name with a NUL byte", want: badArgument, contains: []string{"name", "NUL"},
			call: func(context.Context, *badBundle) error {
				_, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"a\x00b": ratelimit.Config{Rate: 1, Period: time.Second}}})
				return err
			}},
		{name: "New: a registered name over MaxNameLen", want: badArgument, contains: []string{"name", "more than 256"},
			call: func(context.Context, *badBundle) error {
				_, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{strings.Repeat("x", 300): ratelimit.Config{Rate: 1, Period: time.Second}}})
				return err
			}},

		// Unknown names, in every call that resolves a config.
		{name: "unknown name through Credit", want: badUnknown, contains: []string{`"nope"`}, call: credit("nope", "k", 1, nil)},
		{name: "unknown name through Prune", want: badUnknown, contains: []string{`"nope"`},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Prune(ctx, b.pool, "nope", nil)
				return err
			}},
		{name: "unknown name after a known one in LimitMany", want: badUnknown, contains: []string{`"nope"`},
			call: many(ratelimit.Request{Name: "ok", Key: "seed"}, ratelimit.Request{Name: "nope", Key: "seed"})},

		// Zero-value and out-of-range configs, through every place a config is passed.
		{name: "zero-value Config inline in LimitOpts", want: badConfig, contains: []string{"Config.Rate must be > 0"},
			call: limitN("ok", "k", 1, &ratelimit.LimitOpts{Config: &zero})},
		{name: "zero-value Config in LimitOpts (Value)", want: badConfig, contains: []string{"Config.Rate must be > 0"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.State(ctx, b.pool, "ok", "seed", &ratelimit.LimitOpts{Config: &zero})
				return err
			}},
		{name: "zero-value Config in PruneOpts", want: badConfig, contains: []string{"Config.Rate must be > 0"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Prune(ctx, b.pool, "ok", &ratelimit.PruneOpts{Config: &zero})
				return err
			}},
		{name: "zero-value Config in a Request", want: badConfig, contains: []string{"Config.Rate must be > 0"},
			call: many(ratelimit.Request{Name: "ok", Key: "seed", Config: &zero})},
		{name: "New: a zero-value Config registered", want: badConfig, contains: []string{`limit "z"`, "Config.Rate must be > 0"},
			call: func(context.Context, *badBundle) error {
				_, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"z": {}}})
				return err
			}},
		{name: "Config.Rate above MaxAmount", want: badConfig, contains: []string{"Config.Rate", "at most 1e+15"},
			call: limitN("inline", "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Rate: 1e16, Period: time.Second})})},
		{name: "Config.Rate below MinAmount", want: badConfig, contains: []string{"Config.Rate", "at least 1e-09"},
			call: limitN("inline", "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Rate: 1e-12, Period: time.Second})})},
		{name: "Config.Rate -Inf", want: badConfig, contains: []string{"Config.Rate must be finite"},
			call: limitN("inline", "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Rate: math.Inf(-1), Period: time.Second})})},
		{name: "Config.Period above MaxPeriod", want: badConfig, contains: []string{"Config.Period", "at most 100 years"},
			call: limitN("inline", "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Rate: 1, Period: 200 * 365 * 24 * time.Hour})})},
		{name: "Config.Capacity +Inf through Credit", want: badConfig, contains: []string{"Config.Capacity must be finite"},
			call: credit("inline", "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Rate: 1, Period: time.Second, Capacity: math.Inf(1)})})},
		{name: "Config.MaxReserved NaN in a Request", want: badConfig, contains: []string{"Config.MaxReserved must be finite"},
			call: many(ratelimit.Request{Name: "inline", Config: cfg(ratelimit.Config{Rate: 1, Period: time.Second, MaxReserved: math.NaN()}), Reserve: true})},
		{name: "Config.Kind -1", want: badConfig, contains: []string{"Config.Kind"},
			call: limitN("inline", "k", 1, &ratelimit.LimitOpts{Config: cfg(ratelimit.Config{Kind: -1, Rate: 1, Period: time.Second})})},

		// Nil executors of every kind, in every call.
		{name: "nil executor: Credit", want: badArgument, contains: []string{"Credit", "db is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Credit(ctx, nil, "ok", "seed", 1, nil)
				return err
			}},
		{name: "nil executor: State", want: badArgument, contains: []string{"State", "db is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.State(ctx, nil, "ok", "seed", nil)
				return err
			}},
		{name: "nil executor: Reset", want: badArgument, contains: []string{"Reset", "db is nil"},
			call: func(ctx context.Context, b *badBundle) error { return b.lim.Reset(ctx, nil, "ok", "seed") }},
		{name: "nil executor: Prune", want: badArgument, contains: []string{"Prune", "db is nil"},
			call: func(ctx context.Context, b *badBundle) error { _, err := b.lim.Prune(ctx, nil, "ok", nil); return err }},
		{name: "nil executor: CheckMany", want: badArgument, contains: []string{"CheckMany", "db is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.CheckMany(ctx, nil, []ratelimit.Request{{Name: "ok"}}, nil)
				return err
			}},
		{name: "nil pgx.Tx interface as the executor: LimitN", want: badArgument, contains: []string{"db is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.LimitN(ctx, nilTx, "ok", "seed", 1, nil)
				return err
			}},
		{name: "typed nil *pgx.Conn: Check", want: badArgument, contains: []string{"nil *pgx.Conn"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.Check(ctx, nilConn, "ok", "seed", nil)
				return err
			}},
		{name: "typed nil *pgxpool.Pool: LimitMany", want: badArgument, contains: []string{"nil *pgxpool.Pool"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.LimitMany(ctx, nilPool, []ratelimit.Request{{Name: "ok"}}, nil)
				return err
			}},
		{name: "InSerializableTx: nil db", want: badArgument, contains: []string{"InSerializableTx", "db"},
			call: func(ctx context.Context, b *badBundle) error { return ratelimit.InSerializableTx(ctx, nil, nil, noFn) }},
		{name: "InSerializableTx: typed nil *pgxpool.Pool", want: badArgument, contains: []string{"InSerializableTx", "db"},
			call: func(ctx context.Context, b *badBundle) error {
				return ratelimit.InSerializableTx(ctx, nilPool, nil, noFn)
			}},
		{name: "InSerializableTx: nil fn", want: badArgument, contains: []string{"InSerializableTx", "fn"},
			call: func(ctx context.Context, b *badBundle) error {
				// A connection of its own: if the call panics inside its transaction, closing the
				// connection ends that transaction, which a pool could not.
				conn, err := pgx.ConnectConfig(ctx, b.pool.Config().ConnConfig.Copy())
				if err != nil {
					return fmt.Errorf("test setup: %w", err)
				}
				defer conn.Close(context.Background())
				return ratelimit.InSerializableTx(ctx, conn, nil, nil)
			}},

		// Empty and duplicate request lists.
		{name: "CheckMany with an empty, non-nil list", want: badArgument, contains: []string{"requests must not be empty"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.CheckMany(ctx, b.pool, []ratelimit.Request{}, nil)
				return err
			}},
		{name: "LimitMany: the same limit twice with different counts and configs", want: badArgument, contains: []string{"appears twice"},
			call: many(ratelimit.Request{Name: "ok", Key: "seed", Count: 1},
				ratelimit.Request{Name: "ok", Key: "seed", Count: 2, Config: cfg(ratelimit.Config{Rate: 100, Period: time.Minute}), Reserve: true})},
		{name: "CheckMany: the same limit twice", want: badArgument, contains: []string{"appears twice"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.lim.CheckMany(ctx, b.pool, []ratelimit.Request{{Name: "ok"}, {Name: "sharded"}, {Name: "ok"}}, nil)
				return err
			}},

		// Cancelled contexts and expired deadlines: the context's error, nothing written.
		{name: "Limit with a cancelled context", want: badCanceled, contains: []string{"canceled"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := b.lim.Limit(cancelled(), b.pool, "ok", "seed", nil)
				return err
			}},
		{name: "LimitMany with an expired deadline", want: badDeadline, contains: []string{"deadline exceeded"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := b.lim.LimitMany(expired(), b.pool, []ratelimit.Request{{Name: "ok", Key: "seed"}, {Name: "sharded", Key: "seed"}}, nil)
				return err
			}},
		{name: "Credit with a cancelled context", want: badCanceled, contains: []string{"canceled"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := b.lim.Credit(cancelled(), b.pool, "ok", "seed", 1, nil)
				return err
			}},
		{name: "Reset with a cancelled context", want: badCanceled, contains: []string{"canceled"},
			call: func(_ context.Context, b *badBundle) error { return b.lim.Reset(cancelled(), b.pool, "ok", "seed") }},
		{name: "Prune with an expired deadline", want: badDeadline, contains: []string{"deadline exceeded"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := b.lim.Prune(expired(), b.pool, "ok", nil)
				return err
			}},
		{name: "InSerializableTx with a cancelled context", want: badCanceled, contains: []string{"canceled"},
			call: func(_ context.Context, b *badBundle) error {
				return ratelimit.InSerializableTx(cancelled(), b.pool, nil, func(ctx context.Context, tx pgx.Tx) error {
					_, err := b.lim.Limit(ctx, tx, "ok", "seed", nil)
					return err
				})
			}},
		{name: "Limit in a transaction whose deadline expires while it waits for a row lock", want: badDeadline, contains: []string{"deadline exceeded"},
			brokenTx: true,
			tx: func(ctx context.Context, b *badBundle, tx pgx.Tx) error {
				// Another transaction holds the row lock until the call has returned. pgx gives
				// up on the connection at the deadline; the case then waits for that
				// connection's server process to be gone, so that the snapshot after it shows
				// whatever the process did once the lock was free.
				pid := tx.Conn().PgConn().PID()
				holder, err := b.pool.Begin(ctx)
				if err != nil {
					return fmt.Errorf("test setup: %w", err)
				}
				var one int
				if err := holder.QueryRow(ctx, "SELECT 1 FROM txlimit_state WHERE name = 'ok' AND key = 'seed' AND shard = 0 FOR UPDATE").Scan(&one); err != nil {
					_ = holder.Rollback(ctx)
					return fmt.Errorf("test setup: lock the row: %w", err)
				}
				dctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
				defer cancel()
				_, callErr := b.lim.Limit(dctx, tx, "ok", "seed", nil)
				if err := holder.Rollback(ctx); err != nil {
					return fmt.Errorf("test setup: release the lock: %w", err)
				}
				for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
					var n int
					if err := b.pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n); err != nil || n == 0 {
						break
					}
				}
				return callErr
			}},

		// scheduler: ReserveTx and ReserveManyTx, inside the caller's transaction.
		{name: "ReserveTx with a nil tx", want: badArgument, contains: []string{"ReserveTx", "tx is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.sched.ReserveTx(ctx, nil, "ok", "k", 1, job, nil)
				return err
			}},
		{name: "ReserveTx with nil args", want: badArgument, contains: []string{"ReserveTx", "args is nil"}, tx: reserve("ok", "k", 1, nil, nil)},
		{name: "ReserveTx count NaN", want: badArgument, contains: []string{"ReserveTx", "count must be finite"}, tx: reserve("ok", "k", math.NaN(), job, nil)},
		{name: "ReserveTx count negative", want: badArgument, contains: []string{"count must be > 0"}, tx: reserve("ok", "k", -3, job, nil)},
		{name: "ReserveTx count zero", want: badArgument, contains: []string{"count must be > 0"}, tx: reserve("ok", "k", 0, job, nil)},
		{name: "ReserveTx count +Inf", want: badArgument, contains: []string{"count must be finite"}, tx: reserve("ok", "k", math.Inf(1), job, nil)},
		{name: "ReserveTx count above capacity plus MaxReserved", want: badArgument, contains: []string{"count", "plus MaxReserved"},
			tx: reserve("bounded", "k", 16, job, nil)},
		{name: "ReserveTx negative Jitter", want: badArgument, contains: []string{"Jitter", "must be >= 0"},
			tx: reserve("ok", "k", 1, job, &scheduler.ReserveOpts{Jitter: -time.Second})},
		{name: "ReserveTx metadata that is a JSON array", want: badArgument, contains: []string{"Metadata", "JSON object"},
			tx: reserve("ok", "k", 1, job, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Metadata: []byte(`[1,2]`)}})},
		{name: "ReserveTx metadata that is not JSON", want: badArgument, contains: []string{"Metadata"},
			tx: reserve("ok", "k", 1, job, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Metadata: []byte(`{"a":`)}})},
		{name: "ReserveTx unknown limit", want: badUnknown, contains: []string{`"nope"`}, tx: reserve("nope", "k", 1, job, nil)},
		{name: "ReserveTx key with a NUL byte", want: badArgument, contains: []string{"key", "NUL"}, tx: reserve("ok", "a\x00", 1, job, nil)},
		{name: "ReserveTx zero-value Config", want: badConfig, contains: []string{"Config.Rate must be > 0"},
			tx: reserve("ok", "k", 1, job, &scheduler.ReserveOpts{Config: &zero})},
		{name: "ReserveTx with a cancelled context", want: badCanceled, contains: []string{"canceled"},
			tx: func(_ context.Context, b *badBundle, tx pgx.Tx) error {
				_, err := b.sched.ReserveTx(cancelled(), tx, "ok", "k", 1, job, nil)
				return err
			}},
		{name: "ReserveTx args that JSON cannot encode (a NaN field)", want: badArgument, contains: []string{"args"},
			tx: reserve("ok", "nan-args", 1, badArgs{F: math.NaN()}, nil)},
		{name: "ReserveTx InsertOpts.Priority 9 (River allows 1 to 4)", want: badArgument, contains: []string{"priority"},
			tx: reserve("ok", "priority", 1, job, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Priority: 9}})},
		{name: "ReserveManyTx with an empty list", want: badArgument, contains: []string{"requests must not be empty"}, tx: reserveMany(job)},
		{name: "ReserveManyTx with a duplicate", want: badArgument, contains: []string{"appears twice"},
			tx: reserveMany(job, ratelimit.Request{Name: "ok", Key: "k"}, ratelimit.Request{Name: "bounded"}, ratelimit.Request{Name: "ok", Key: "k", Count: 2})},
		{name: "ReserveManyTx with nil args", want: badArgument, contains: []string{"ReserveManyTx", "args is nil"},
			tx: reserveMany(nil, ratelimit.Request{Name: "ok", Key: "k"})},
		{name: "ReserveManyTx with a nil tx", want: badArgument, contains: []string{"ReserveManyTx", "tx is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := b.sched.ReserveManyTx(ctx, nil, []ratelimit.Request{{Name: "ok"}}, job, nil)
				return err
			}},
		{name: "ReserveManyTx Request.Count NaN", want: badArgument, contains: []string{"count must be finite"},
			tx: reserveMany(job, ratelimit.Request{Name: "ok", Key: "k"}, ratelimit.Request{Name: "bounded", Key: "k", Count: math.NaN()})},

		// scheduler: Settle, New, NewGate, Migrate.
		{name: "Settle actual NaN", want: badArgument, contains: []string{"actual", "finite"}, call: settle(scheduler.Settlement{Name: "ok", Key: "seed", Reserved: 1}, math.NaN())},
		{name: "Settle actual negative", want: badArgument, contains: []string{"actual", ">= 0"}, call: settle(scheduler.Settlement{Name: "ok", Key: "seed", Reserved: 1}, -1)},
		{name: "Settle actual +Inf", want: badArgument, contains: []string{"actual", "finite"}, call: settle(scheduler.Settlement{Name: "ok", Key: "seed", Reserved: 1}, math.Inf(1))},
		{name: "Settle Settlement.Reserved NaN", want: badArgument, contains: []string{"Reserved", "finite"}, call: settle(scheduler.Settlement{Name: "ok", Key: "seed", Reserved: math.NaN()}, 1)},
		{name: "Settle Settlement.Reserved negative", want: badArgument, contains: []string{"Reserved", ">= 0"}, call: settle(scheduler.Settlement{Name: "ok", Key: "seed", Reserved: -5}, 1)},
		{name: "Settle with a nil limiter", want: badArgument, contains: []string{"limiter", "nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := scheduler.Settlement{Name: "ok", Key: "seed", Reserved: 2}.Settle(ctx, b.pool, nil, 1, nil)
				return err
			}},
		{name: "Settle with a nil executor", want: badArgument, contains: []string{"db is nil"},
			call: func(ctx context.Context, b *badBundle) error {
				_, err := scheduler.Settlement{Name: "ok", Key: "seed", Reserved: 2}.Settle(ctx, nil, b.lim, 1, nil)
				return err
			}},
		{name: "Settle an unknown limit", want: badUnknown, contains: []string{`"nope"`}, call: settle(scheduler.Settlement{Name: "nope", Reserved: 2}, 1)},
		{name: "Settle a zero-value Settlement (no name) at cost 0", want: badArgument, contains: []string{"name must not be empty"},
			call: settle(scheduler.Settlement{}, 0)},
		{name: "Settle with a cancelled context", want: badCanceled, contains: []string{"canceled"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := scheduler.Settlement{Name: "ok", Key: "seed", Reserved: 2}.Settle(cancelled(), b.pool, b.lim, 1, nil)
				return err
			}},
		{name: "scheduler.New with a nil limiter", want: badArgument, contains: []string{"limiter is nil"},
			call: func(_ context.Context, b *badBundle) error { _, err := scheduler.New(b.river, nil, nil); return err }},
		{name: "scheduler.NewGate with a nil executor (GateConfig.DB)", want: badArgument, contains: []string{"DB is nil"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := scheduler.NewGate(&scheduler.GateConfig{Limiter: b.lim, Limit: func(*rivertype.JobRow) (scheduler.GateRequest, bool) { return scheduler.GateRequest{}, false }})
				return err
			}},
		{name: "scheduler.NewGate with a negative Jitter", want: badArgument, contains: []string{"Jitter"},
			call: func(_ context.Context, b *badBundle) error {
				_, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.lim, Jitter: -time.Second,
					Limit: func(*rivertype.JobRow) (scheduler.GateRequest, bool) { return scheduler.GateRequest{}, false }})
				return err
			}},
		{name: "scheduler.Migrate with a nil pool", want: badArgument, contains: []string{"pool is nil"},
			call: func(ctx context.Context, _ *badBundle) error { return scheduler.Migrate(ctx, nil, nil) }},
	}
}

// badRun runs one case and returns its error, turning a panic into an error.
func badRun(t *testing.T, b *badBundle, c badCase) (callErr, commitErr error) {
	t.Helper()
	ctx := context.Background()
	defer func() {
		if r := recover(); r != nil {
			callErr = fmt.Errorf("panicked: %v", r)
		}
	}()
	if c.call != nil {
		return c.call(ctx, b), nil
	}
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit; ends the tx after a panic
	err = c.tx(ctx, b, tx)
	// Bad input leaves the caller's transaction as it was, so the caller may go on and commit
	// its own work: commit, and see that nothing of the refused call was written.
	return err, tx.Commit(ctx)
}

// TestBadInput: hostile inputs through the public API of ratelimit and scheduler are each refused
// with the documented typed error naming what is wrong, and nothing is written; SQL
// metacharacters are ordinary keys and names.
func TestBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, &testdb.Options{MaxConns: 4})
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		t.Fatal(err)
	}
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"ok":      {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded},
		"bounded": {Rate: 10, Period: time.Second, MaxReserved: 5},
		"sharded": {Rate: 8, Period: time.Second, Shards: 4},
	}})
	if err != nil {
		t.Fatal(err)
	}
	client, sched := testdb.InsertScheduler(t, pool, lim, nil)
	b := &badBundle{pool: pool, lim: lim, river: client, sched: sched}

	// State for a wrong write to change: rows of each limit, a reservation and its job.
	if _, err := lim.LimitN(ctx, pool, "ok", "seed", 3, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := lim.LimitN(ctx, pool, "bounded", "seed", 12, &ratelimit.LimitOpts{Reserve: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := lim.LimitMany(ctx, pool, []ratelimit.Request{{Name: "sharded", Key: "seed", Count: 3}, {Name: "ok", Key: "k"}}, nil); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := sched.ReserveTx(ctx, tx, "bounded", "job", 2, badArgs{F: 2}, nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	cases := badCases()
	var refused, written, failures int
	ordinary, ordinaryFailures := 0, 0
	defer func() {
		fmt.Printf("reliability: badinput: cases=%d refused=%d written=%d failures=%d ordinary_keys=%d\n",
			len(cases), refused, written, failures+ordinaryFailures, ordinary)
	}()
	if len(cases) < 30 {
		t.Fatalf("only %d cases; the suite promises at least 30", len(cases))
	}
	for _, c := range cases {
		ok := t.Run(c.name, func(t *testing.T) {
			before := badSnap(t, pool)
			err, commitErr := badRun(t, b, c)
			after := badSnap(t, pool)
			if problem := badCheck(c, err); problem != "" {
				t.Errorf("want %s: %s", c.want, problem)
			}
			if commitErr != nil && !c.brokenTx {
				t.Errorf("the refusal left the caller's transaction unusable: commit: %v", commitErr)
			}
			if after != before {
				written++
				t.Errorf("wrote: state rows %d -> %d (checksum %s -> %s), river_job rows %d -> %d (checksum %s -> %s)",
					before.stateRows, after.stateRows, before.stateSum[:8], after.stateSum[:8],
					before.jobs, after.jobs, before.jobsSum[:8], after.jobsSum[:8])
			}
		})
		if ok {
			refused++
		} else {
			failures++
		}
	}

	ordinary, ordinaryFailures = badOrdinaryKeys(t, pool)
}

// badOrdinaryKeys checks that keys and names made of SQL metacharacters, LIKE and regex
// wildcards, escapes and look-alike Unicode are ordinary: accepted, stored as given, and never
// matching another key or name in Limit, Value, Reset or Prune. It returns how many such keys and
// names it checked and how many of those checks failed.
func badOrdinaryKeys(t *testing.T, pool *pgxpool.Pool) (checked, failed int) {
	ctx := context.Background()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	cfg := ratelimit.Config{Rate: 10, Period: time.Second}
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"ord": cfg},
		Now:    func() time.Time { return now },
	})
	if err != nil {
		t.Fatal(err)
	}
	maxKey := strings.Repeat("m", ratelimit.MaxKeyLen)
	// Each hostile key, with the neighbours a LIKE, a regex, a trim, a case fold, a Unicode
	// normalisation or a truncation would confuse it with.
	keys := []struct{ key, neighbour string }{
		{"'; DROP TABLE txlimit_state; --", "x"},
		{"%", "abc"},
		{"_", "a"},
		{"a%", "abcd"},
		{"k_1", "kx1"},
		{`\`, `\\`},
		{`\%`, "%%"},
		{".*", "anything"},
		{`" OR ""="`, "or"},
		{"$1", ""},
		{"é", "e\u0301"}, // NFC and NFD of the same letter
		{"Key", "key"},
		{"k ", "k"},
		{"\t", " "},
		{maxKey, maxKey[:ratelimit.MaxKeyLen-1]},
		{"\u202eevil", "live"}, // right-to-left override
	}
	value := func(name, key string, c *ratelimit.Config) float64 {
		t.Helper()
		st, err := lim.State(ctx, pool, name, key, &ratelimit.LimitOpts{Config: c})
		if err != nil {
			t.Errorf("Value(%q, %q): %v", name, key, err)
		}
		return st.Value
	}
	rows := func(name, key string) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM txlimit_state WHERE name = $1 AND key = $2", name, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Neighbours hold 7 tokens, hostile keys 9: any mix-up shows in a value.
	for _, k := range keys {
		if k.neighbour == "" || rows("ord", k.neighbour) > 0 {
			continue
		}
		if _, err := lim.LimitN(ctx, pool, "ord", k.neighbour, 3, nil); err != nil {
			t.Fatalf("neighbour %q: %v", k.neighbour, err)
		}
	}
	if _, err := lim.LimitN(ctx, pool, "ord", "", 3, nil); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		checked++
		ok := t.Run(fmt.Sprintf("ordinary key %.40q", k.key), func(t *testing.T) {
			total := testdb.CountRows(t, pool)
			r, err := lim.Limit(ctx, pool, "ord", k.key, nil)
			if err != nil || !r.OK || r.Value != 9 {
				t.Fatalf("Limit: got %+v, %v; want granted leaving 9 (a fresh row of its own)", r, err)
			}
			if n := rows("ord", k.key); n != 1 || testdb.CountRows(t, pool) != total+1 {
				t.Errorf("stored %d rows under the key (want 1) and %d rows in all (want %d)", n, testdb.CountRows(t, pool), total+1)
			}
			if v := value("ord", k.key, nil); v != 9 {
				t.Errorf("Value: %v, want 9", v)
			}
			if v := value("ord", k.neighbour, nil); v != 7 {
				t.Errorf("Value of neighbour %q: %v, want 7 (untouched)", k.neighbour, v)
			}
			if err := lim.Reset(ctx, pool, "ord", k.key); err != nil {
				t.Fatalf("Reset: %v", err)
			}
			if rows("ord", k.key) != 0 || rows("ord", k.neighbour) != 1 || testdb.CountRows(t, pool) != total {
				t.Errorf("Reset removed the wrong rows: key %d rows, neighbour %q %d rows, %d rows in all (want 0, 1, %d)",
					rows("ord", k.key), k.neighbour, rows("ord", k.neighbour), testdb.CountRows(t, pool), total)
			}
		})
		if !ok {
			failed++
		}
	}

	// Names: Prune works by name and deletes rows that are full. An hour later every "ord" row is
	// full, so a Prune whose name matched "ord" as a pattern would delete them.
	for _, name := range []string{"o%", "or_", "%", "ord'; DELETE FROM txlimit_state; --", "ORD", "ord "} {
		checked++
		ok := t.Run(fmt.Sprintf("ordinary name %q", name), func(t *testing.T) {
			if r, err := lim.LimitN(ctx, pool, name, "abc", 1, &ratelimit.LimitOpts{Config: &cfg}); err != nil || !r.OK || r.Value != 9 {
				t.Fatalf("Limit: got %+v, %v; want granted leaving 9", r, err)
			}
			if v := value("ord", "abc", nil); v != 7 {
				t.Errorf("Value of \"ord\" key \"abc\": %v, want 7 (untouched)", v)
			}
			ordRows := rows("ord", "abc")
			now = now.Add(time.Hour)
			n, err := lim.Prune(ctx, pool, name, &ratelimit.PruneOpts{Config: &cfg})
			if err != nil || n != 1 {
				t.Errorf("Prune(%q): deleted %d, %v; want its own row only (1)", name, n, err)
			}
			if rows("ord", "abc") != ordRows {
				t.Errorf("Prune(%q) deleted rows of \"ord\"", name)
			}
			// Consume the neighbours again at the new time, so the next name sees them at 7.
			if _, err := lim.LimitN(ctx, pool, "ord", "abc", 3, nil); err != nil {
				t.Fatal(err)
			}
		})
		if !ok {
			failed++
		}
	}
	// Sanity: the "ord" rows were prunable all along.
	now = now.Add(time.Hour)
	if n, err := lim.Prune(ctx, pool, "ord", nil); err != nil || n == 0 {
		t.Errorf("Prune(\"ord\"): deleted %d, %v; want its full rows deleted", n, err)
	}
	return checked, failed
}
