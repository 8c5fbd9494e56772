package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/txlimit/txlimit/ratelimit"
)

// Limit is a rate limit that every contender enforces the same way: a token bucket holding at most
// Burst tokens, refilled at Rate tokens per Period, one token per decision.
type Limit struct {
	Name   string
	Rate   float64
	Period time.Duration
	Burst  float64
}

// PerSecond is the refill rate in tokens per second.
func (l Limit) PerSecond() float64 { return l.Rate / l.Period.Seconds() }

// The limits of the benchmark, registered by name with every contender.
var (
	// limitAllow is generous: practically every decision is granted (allow-heavy mix).
	limitAllow = Limit{Name: "allow", Rate: 1e9, Period: time.Second, Burst: 1e9}
	// limitDeny is tight: 10 per second per key, so nearly every decision is denied (deny-heavy mix).
	limitDeny = Limit{Name: "deny", Rate: 10, Period: time.Second, Burst: 10}
	// limitOverGrant is the over-grant test's limit: burst 10, rate 10/s, cost 1.
	limitOverGrant = Limit{Name: "overgrant", Rate: 10, Period: time.Second, Burst: 10}

	benchLimits = []Limit{limitAllow, limitDeny, limitOverGrant}
)

// Decision is the outcome of one rate-limit decision.
type Decision struct {
	// Allowed reports whether the token was granted.
	Allowed bool
	// At is when the decision was evaluated, on the clock of whoever decided (Postgres, Redis or
	// this process). The over-grant test bounds the grants by the span of these times.
	At time.Time
	// Retries is how many failed attempts (serialization failures) preceded the decision.
	Retries int
}

// Contender decides rate limits one way. It must be safe for concurrent use.
type Contender interface {
	// Decide consumes one token of the named limit (one of benchLimits) for key, if it is there.
	Decide(ctx context.Context, limit, key string) (Decision, error)
	// Close releases what New acquired (not the shared pool or Redis client).
	Close()
}

// Family groups contenders by what they run on; it decides which counters apply to them.
type Family int

const (
	FamilyTxlimit  Family = iota // the library under test, on Postgres
	FamilyRedis                  // Redis
	FamilyPostgres               // Postgres without the library
	FamilyMemory                 // this process only
)

// OnPostgres reports whether WAL and pgx round trips are measured for the family.
func (f Family) OnPostgres() bool { return f == FamilyTxlimit || f == FamilyPostgres }

// Def describes a contender: one entry of the table contenders (contenders.go).
type Def struct {
	// Order is the contender's place in tables (1 for the first); Defs sets it from the table.
	Order int
	// ID is short, stable and used in keys, flags and the picture's legend.
	ID string
	// Name is the label in tables.
	Name string
	// What says in one sentence how it decides.
	What string
	// Family is what it runs on.
	Family Family
	// Shards is Config.Shards of a txlimit contender. Defaults to 0, which means 1: unsharded.
	Shards int
	// SweepOnly keeps the contender out of the throughput cells, the picture and the over-grant
	// test: it runs only in the shard comparison. Defaults to false.
	SweepOnly bool
	// NotALimit marks a contender that does not enforce the limit (the floor): it runs in the
	// throughput cells only, never in the over-grant test. Defaults to false.
	NotALimit bool
	// OverGrantOnly keeps the contender out of the throughput cells, the picture and the shard
	// comparison: it runs only in the over-grant test, to show what txlimit prevents. Defaults to
	// false.
	OverGrantOnly bool
	// New builds the contender on env. It returns a *SkipError when it cannot run here (e.g.
	// Redis is not reachable), which skips it without failing the run.
	New func(ctx context.Context, env *Env) (Contender, error)
}

// Defs returns the contenders in the order of the table, each with its Order set.
func Defs() []*Def {
	out := make([]*Def, len(contenders))
	for i, d := range contenders {
		d.Order = i + 1
		out[i] = d
	}
	return out
}

// SkipError says why a contender cannot run in this environment.
type SkipError struct{ Reason string }

func (e *SkipError) Error() string { return "skipped: " + e.Reason }

// Env is what contenders are built on.
type Env struct {
	// Pool is the Postgres pool: search_path is the bench schema (already migrated) and every
	// query is counted by PGTrips.
	Pool *pgxpool.Pool
	// PGTrips counts the statements sent through Pool (BEGIN and COMMIT included).
	PGTrips *pgCounter
	// PGFrom says where the Postgres came from and which it is (devdb.DB.String), for the report.
	// PGThrowaway: the Postgres is a private throwaway cluster (fsync off), whose figures are not
	// comparable with a real server's.
	PGThrowaway bool
	PGFrom      string
	// Redis is nil when Redis is not reachable; RedisErr then says why.
	Redis    *redis.Client
	RedisErr error
	// RedisTrips counts the commands sent through Redis.
	RedisTrips *redisCounter
	// RedisPrefix starts every Redis key of this run.
	RedisPrefix string
	// Limits are the limits contenders must know by name.
	Limits []Limit
	// ServerPIDs are the process IDs of the servers on this machine, by server name (cpu.go); a
	// server elsewhere is absent.
	ServerPIDs map[string]int
	// Batcher configures every ratelimit.Batcher of the run (the batched contender, the HTTP
	// cell); nil for the defaults. The -lanes flag sets its Lanes.
	Batcher *ratelimit.BatcherConfig
}

// limitByName finds one of env's limits.
func (env *Env) limitByName(name string) (Limit, error) {
	for _, l := range env.Limits {
		if l.Name == name {
			return l, nil
		}
	}
	return Limit{}, fmt.Errorf("bench: unknown limit %q", name)
}

// stopKey carries, in a context, the instant after which a contender must not start another
// attempt of a decision (a retry after a serialization failure). Measurements end at a deadline;
// without this, a decision in a retry backoff would stretch a cell by up to its whole retry budget.
type stopKey struct{}

// ErrStopped is returned by a decision abandoned between two attempts because the measurement
// window closed. Its failed attempts were rolled back, so it consumed nothing.
var ErrStopped = errors.New("bench: measurement window closed between attempts")

// WithStop returns ctx carrying the instant after which no new attempt may start.
func WithStop(ctx context.Context, at time.Time) context.Context {
	return context.WithValue(ctx, stopKey{}, at)
}

// Stopped reports whether ctx's stop instant has passed.
func Stopped(ctx context.Context) bool {
	at, ok := ctx.Value(stopKey{}).(time.Time)
	return ok && !time.Now().Before(at)
}
