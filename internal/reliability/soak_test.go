//go:build reliability

package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// The soak's knobs. TXLIMIT_SOAK_DURATION and TXLIMIT_SOAK_WORKERS set how long and how many;
// TXLIMIT_SOAK_SEED replays the workers' choices (not the interleavings, which the scheduler and
// the faults decide).
const (
	soakEnvDurationName = "TXLIMIT_SOAK_DURATION"
	soakEnvWorkersName  = "TXLIMIT_SOAK_WORKERS"
	soakEnvSeedName     = "TXLIMIT_SOAK_SEED"

	// soakMaxPoolConns bounds the workers' pool. With the killer's and the verifier's connections
	// the soak never holds more than soakMaxPoolConns+2 connections of the shared server.
	soakMaxPoolConns = 20
)

// The soak's virtual time. The limiter's clock (LimiterConfig.Now) starts at soakT0 and moves
// one soakStep forward every soakOpsPerStep operations, whatever the machine's speed, so the
// balance of demand and refill (and with it the mix of grants and denials) does not depend on how
// fast the machine or the race detector is.
const (
	soakStep       = 10 * time.Millisecond
	soakOpsPerStep = 128
)

// soakT0 is where virtual time starts.
var soakT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// soakCapShard is every shard's capacity: 2^40 tokens, so large that no shard ever gets near it
// (TestSoak checks the bound at the end). The invariant is exact only while no bucket is clamped at
// its capacity: a clamp drops refill or credit that the ledger cannot see. Each shard is drained to a
// small level at soakT0 before the workers start, so from then on every shard refills linearly.
const soakCapShard = 1 << 40

// soakLimit is one limit of the soak and the keys the workers use with it.
//
// The numbers keep float8 arithmetic exact, so that the invariant can be checked with ==:
//   - every count, credit and initial level is an integer, and a shard refills an integer number
//     of tokens per soakStep (token bucket) or per window (fixed window, whose Period is a whole
//     number of steps and whose grid starts at soakT0);
//   - sharded limits are charged without Reserve, 1 or 2 tokens at a time in SERIALIZABLE
//     transactions and 1 at a time in READ COMMITTED ones. When a request charges both of its
//     shards, each ends at (va + vb - count)/2. With integer levels that is granted without
//     Reserve only for (1 + 1 - 2)/2 = 0, so the shards stay integers, provided the levels the
//     choice was made on are the levels charged. Under SERIALIZABLE they are (a row changed since
//     the snapshot fails the locking read with 40001). Under READ COMMITTED the charge is chosen
//     on the lock-free read and kept when the locked rows show newer levels: a choice of both made
//     on (1, 1) and applied to (2, 1) leaves (0.5, 0.5). A single token is never split (both
//     shards are charged only when neither holds it, and then neither holds anything).
//
// With reservations, larger counts or such splits, halves appear, then quarters, and after
// enough combined charges the levels need more than float8's 53 bits and round: an exact
// comparison would then report a sub-ulp mismatch that says nothing about the limiter.
type soakLimit struct {
	name     string
	cfg      ratelimit.Config
	keys     []string
	weights  []int   // how often each key is picked, relative to the other (limit, key) pairs
	level    float64 // what each shard holds after the drain at soakT0
	maxCount int     // counts are drawn from 1..maxCount (see soakReqCount)
	reserve  bool    // may be charged with Reserve (unsharded limits only, see above)
}

func (l *soakLimit) shards() int { return max(l.cfg.Shards, 1) }

// refill is what all the limit's shards together accrue from soakT0 to soakT0+elapsed, elapsed
// being a whole number of steps: exactly what the database adds up, because each of its
// evaluations adds an integer.
func (l *soakLimit) refill(elapsed time.Duration) float64 {
	if l.cfg.Kind == ratelimit.FixedWindow {
		return l.cfg.Rate * float64(elapsed/l.cfg.Period)
	}
	perStep := l.cfg.Rate * float64(soakStep) / float64(l.cfg.Period)
	return perStep * float64(elapsed/soakStep)
}

// check fails the test unless the limit's numbers keep float8 arithmetic exact (see soakLimit).
func (l *soakLimit) check(t *testing.T) {
	t.Helper()
	n := float64(l.shards())
	whole := func(x float64) bool { return x >= 1 && x == math.Trunc(x) }
	switch l.cfg.Kind {
	case ratelimit.FixedWindow:
		if !whole(l.cfg.Rate/n) || l.cfg.Period%soakStep != 0 || !l.cfg.Start.Equal(soakT0) {
			t.Fatalf("%s: a fixed window needs an integer Rate per shard, a Period of whole steps and Start = soakT0", l.name)
		}
	default:
		if !whole(l.cfg.Rate / n * float64(soakStep) / float64(l.cfg.Period)) {
			t.Fatalf("%s: a token bucket needs an integer refill per shard per step", l.name)
		}
	}
	if len(l.weights) != len(l.keys) {
		t.Fatalf("%s: one weight per key", l.name)
	}
	if l.cfg.Capacity != soakCapShard*n || !whole(l.level) || (l.shards() > 1 && (l.reserve || l.maxCount > 2)) {
		t.Fatalf("%s: capacity must be soakCapShard per shard, the level an integer, and a sharded limit charged 1 or 2 tokens without Reserve", l.name)
	}
}

// soakLimits are the limits of the soak: plain and sharded (4 and 16 shards), token buckets and
// fixed windows. Rates and weights are set so that the demand on each key (tokens per step, with
// soakOpsPerStep operations per step) exceeds its refill, so that every limit sees grants and
// denials.
func soakLimits() []*soakLimit {
	capOf := func(shards int) float64 { return soakCapShard * float64(shards) }
	return []*soakLimit{
		{name: "soak_plain", cfg: ratelimit.Config{Rate: 32, Period: soakStep, Capacity: capOf(1), MaxReserved: 40},
			keys: []string{"a", "b", "c"}, weights: []int{2, 2, 2}, level: 20, maxCount: 6, reserve: true},
		{name: "soak_window", cfg: ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 256, Period: 8 * soakStep, Capacity: capOf(1), MaxReserved: 40, Start: soakT0},
			keys: []string{"a", "b"}, weights: []int{2, 2}, level: 20, maxCount: 6, reserve: true},
		{name: "soak_shard4", cfg: ratelimit.Config{Rate: 4, Period: soakStep, Capacity: capOf(4), Shards: 4},
			keys: []string{"hot", "b"}, weights: []int{2, 1}, level: 2, maxCount: 2},
		{name: "soak_shard16", cfg: ratelimit.Config{Rate: 16, Period: soakStep, Capacity: capOf(16), Shards: 16},
			keys: []string{"hot"}, weights: []int{10}, level: 2, maxCount: 2},
		{name: "soak_window_shard4", cfg: ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 8, Period: 2 * soakStep, Capacity: capOf(4), Shards: 4, Start: soakT0},
			keys: []string{"hot"}, weights: []int{3}, level: 2, maxCount: 2},
	}
}

// soakClock is the limiter's clock: soakT0 plus one soakStep per soakOpsPerStep operations. Every
// instant it returns is soakT0 plus a whole number of steps, and it never goes back.
type soakClock struct{ ops atomic.Int64 }

func (c *soakClock) Now() time.Time {
	return soakT0.Add(time.Duration(c.ops.Load()/soakOpsPerStep) * soakStep)
}

func (c *soakClock) tick()               { c.ops.Add(1) }
func (c *soakClock) advance(steps int64) { c.ops.Add(steps * soakOpsPerStep) }

// soakJobArgs is the job of a reservation: the operation that made it and what it reserved, so
// that the jobs can be matched one for one against the ledger.
type soakJobArgs struct {
	Op       int64          `json:"op"`
	Reserved []soakReserved `json:"reserved"`
}

type soakReserved struct {
	Name   string  `json:"name"`
	Key    string  `json:"key"`
	Tokens float64 `json:"tokens"`
}

func (soakJobArgs) Kind() string { return "txlimit_soak_reserve" }

// soakLedgerDDL creates the ledger. Every operation that consumes, reserves or credits writes its
// rows here in the same transaction as the limiter's write, so the ledger holds exactly the
// committed changes, also when a connection dies during COMMIT and the client cannot tell whether
// it committed. delta is the change to the (name, key)'s value: -count for a grant, +credited for
// a credit.
const soakLedgerDDL = `CREATE TABLE soak_ledger (
	id    bigserial PRIMARY KEY,
	op    bigint NOT NULL,
	kind  text NOT NULL,
	name  text NOT NULL,
	key   text NOT NULL,
	delta double precision NOT NULL
)`

// errSoakRollback makes a transaction roll back on purpose after its work is done.
var errSoakRollback = errors.New("soak: deliberate rollback")

// The kinds of operation the workers mix.
const (
	soakOpLimit       = "limit"        // LimitN, sometimes with Reserve or AsError
	soakOpMany        = "many"         // LimitMany over 2 or 3 limits
	soakOpReserve     = "reserve"      // scheduler.ReserveTx
	soakOpReserveMany = "reserve_many" // scheduler.ReserveManyTx over 2 limits
	soakOpCredit      = "credit"       // Credit
	soakOpSelfKill    = "selfkill"     // LimitN, then the worker terminates its own backend before COMMIT
	soakOpDrain       = "drain"        // the drain at soakT0, before the workers start
)

// soakReq is one limit of an operation.
type soakReq struct {
	lim     *soakLimit
	key     string
	count   float64
	reserve bool
}

// soakPlan is an operation drawn before its transaction starts, so that a SERIALIZABLE retry
// repeats the same operation.
type soakPlan struct {
	kind         string
	reqs         []soakReq
	throw        bool
	serializable bool
	rollback     bool
}

// soakRun is the state of one soak.
type soakRun struct {
	t       *testing.T
	pool    *pgxpool.Pool
	lim     *ratelimit.Limiter
	sched   *scheduler.Scheduler
	clock   *soakClock
	limits  []*soakLimit
	appName string

	pidsMu sync.Mutex
	pids   map[uint32]bool // backends the pool opened (AfterConnect)

	nextOp atomic.Int64

	decisions, granted, denied     atomic.Int64
	commits, rollbacks, throwRolls atomic.Int64
	commitErrs, retries            atomic.Int64
	killed, selfKilled             atomic.Int64
	credits, combined              atomic.Int64
	invariants, failures           atomic.Int64
	opsByKind                      sync.Map // kind -> *atomic.Int64
	perLimit                       map[string]*[2]atomic.Int64
	errs                           soakTally
	batch                          *soakBatch // soak_batcher_test.go
}

// failf records a failure of the soak. It is safe to call from the workers.
func (s *soakRun) failf(format string, args ...any) {
	if s.failures.Add(1) <= 20 {
		s.t.Errorf(format, args...)
	}
}

// check counts one invariant check and records a failure when it does not hold.
func (s *soakRun) check(ok bool, format string, args ...any) {
	s.invariants.Add(1)
	if !ok {
		s.failf("invariant: "+format, args...)
	}
}

func (s *soakRun) addPID(pid uint32) {
	s.pidsMu.Lock()
	s.pids[pid] = true
	s.pidsMu.Unlock()
}

func (s *soakRun) pidList() []uint32 {
	s.pidsMu.Lock()
	defer s.pidsMu.Unlock()
	out := make([]uint32, 0, len(s.pids))
	for p := range s.pids {
		out = append(out, p)
	}
	return out
}

// decided counts a decision of one limit call.
func (s *soakRun) decided(lim *soakLimit, ok bool) {
	s.decisions.Add(1)
	i := 1
	if ok {
		s.granted.Add(1)
		i = 0
	} else {
		s.denied.Add(1)
	}
	if lim != nil {
		s.perLimit[lim.name][i].Add(1)
	}
}

// TestSoak runs workers that mix every consuming call of the library (Limit/LimitN, LimitMany,
// ReserveTx and ReserveManyTx with River, Credit) over plain and sharded limits, token buckets and
// fixed windows, in READ COMMITTED and SERIALIZABLE transactions, with deliberate rollbacks and
// with their own backends terminated at random moments. At the end it checks, exactly, that every
// limit holds what its committed consumption, credits and refill imply, and that the committed
// reservations and the River jobs match one for one.
func TestSoak(t *testing.T) {
	duration := soakEnvDuration(t, soakEnvDurationName, 60*time.Second)
	workers := soakEnvInt(t, soakEnvWorkersName, 16)
	seed := uint64(time.Now().UnixNano())
	if s := soakEnvInt(t, soakEnvSeedName, 0); s != 0 {
		seed = uint64(s)
	}
	s := &soakRun{t: t, clock: &soakClock{}, limits: soakLimits(), pids: map[uint32]bool{}, perLimit: map[string]*[2]atomic.Int64{}}
	for _, l := range s.limits {
		l.check(t)
		s.perLimit[l.name] = &[2]atomic.Int64{}
	}
	start := time.Now()
	defer func() {
		failures := s.failures.Load()
		if t.Failed() && failures == 0 {
			failures = 1 // a require or Fatal outside failf
		}
		fmt.Printf("reliability: soak: duration=%s workers=%d decisions=%d granted=%d denied=%d rollbacks=%d killed=%d retries=%d invariants=%d failures=%d\n",
			soakSeconds(duration), workers, s.decisions.Load(), s.granted.Load(), s.denied.Load(), s.rollbacks.Load(),
			s.killed.Load(), s.retries.Load(), s.invariants.Load(), failures)
		t.Logf("wall time %s (seed %d: %s=%d replays the choices)", time.Since(start).Round(time.Millisecond), seed, soakEnvSeedName, seed)
	}()

	if deadline, ok := t.Deadline(); ok && time.Until(deadline) < duration+2*time.Minute {
		t.Fatalf("%s=%s does not fit in what is left of the test binary's -timeout (%s): run go test with -timeout %s",
			soakEnvDurationName, duration, time.Until(deadline).Round(time.Second), (duration + 5*time.Minute).Round(time.Minute))
	}

	ctx := context.Background()
	s.setup(t, workers)
	s.drain(t)
	t.Logf("drained %d limits at %s; running %d workers for %s on a pool of %d", len(s.limits), soakT0, workers, duration, s.pool.Config().MaxConns)

	killerCtx, stopKiller := context.WithCancel(ctx)
	killerDone := make(chan struct{})
	go func() {
		defer close(killerDone)
		s.killer(killerCtx, rand.New(rand.NewPCG(seed, math.MaxUint64)))
	}()

	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for time.Now().Before(deadline) && s.failures.Load() == 0 {
				s.once(rng)
			}
		}()
	}
	s.startSched(t, &wg, deadline, seed) // cancels and settlements (soak_sched_test.go)
	waitBatcher := s.startBatcher(max(2, workers/4), seed, deadline)
	wg.Wait()
	waitBatcher()
	stopKiller()
	<-killerDone
	ran := time.Since(start)
	virtual := s.clock.Now().Sub(soakT0) // verify moves the clock on

	s.pool.Close()
	s.verify(t)

	var kinds []string
	s.opsByKind.Range(func(k, v any) bool {
		kinds = append(kinds, fmt.Sprintf("%s=%d", k, v.(*atomic.Int64).Load()))
		return true
	})
	var lims []string
	for _, l := range s.limits {
		c := s.perLimit[l.name]
		lims = append(lims, fmt.Sprintf("%s granted %d denied %d", l.name, c[0].Load(), c[1].Load()))
	}
	t.Logf("ran %s: %d operations (%s), %.0f/s; virtual time %s",
		ran.Round(time.Millisecond), s.nextOp.Load(), strings.Join(kinds, " "), float64(s.nextOp.Load())/ran.Seconds(), virtual)
	t.Logf("single-limit decisions: %s", strings.Join(lims, "; "))
	t.Logf("transactions: %d committed, %d rolled back on purpose, %d rolled back after an AsError denial, %d COMMITs failed (outcome unknown to the client), %d serializable retries",
		s.commits.Load(), s.rollbacks.Load(), s.throwRolls.Load(), s.commitErrs.Load(), s.retries.Load())
	t.Logf("%d credits; %d grants charged both of their shards", s.credits.Load(), s.combined.Load())
	t.Logf("%s", s.batch.summary())
	t.Logf("faults: %d backends terminated (%d by the killer, %d by their own worker); errors by class:%s",
		s.killed.Load(), s.killed.Load()-s.selfKilled.Load(), s.selfKilled.Load(), s.errs.String())
	if s.decisions.Load() == 0 || s.granted.Load() == 0 || s.denied.Load() == 0 || s.killed.Load() == 0 || s.rollbacks.Load() == 0 {
		s.failf("the soak did not exercise what it claims: decisions %d, granted %d, denied %d, killed %d, rollbacks %d",
			s.decisions.Load(), s.granted.Load(), s.denied.Load(), s.killed.Load(), s.rollbacks.Load())
	}
}

// setup creates the soak's schema, pool, ledger, limiter and insert-only River client.
func (s *soakRun) setup(t *testing.T, workers int) {
	t.Helper()
	ctx := context.Background()
	schema := testdb.NewSchema(t)
	s.appName = "txlimit_" + schema // unique to this run: the killer only ever terminates these
	cfg, err := pgxpool.ParseConfig(testdb.DSN(t))
	if err != nil {
		t.Fatalf("parse DSN: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = s.appName
	cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	cfg.MaxConns = int32(min(workers, soakMaxPoolConns))
	cfg.AfterConnect = func(_ context.Context, conn *pgx.Conn) error {
		s.addPID(conn.PgConn().PID())
		return nil
	}
	s.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(s.pool.Close)
	if err := migrations.Up(ctx, s.pool); err != nil {
		t.Fatalf("migrations.Up: %v", err)
	}
	if err := scheduler.Migrate(ctx, s.pool, &scheduler.MigrateOpts{Logger: soakQuietLogger()}); err != nil {
		t.Fatalf("scheduler.Migrate: %v", err)
	}
	if _, err := s.pool.Exec(ctx, soakLedgerDDL); err != nil {
		t.Fatalf("create ledger: %v", err)
	}
	limits := map[string]ratelimit.Config{}
	for _, l := range s.limits {
		limits[l.name] = l.cfg
	}
	s.lim, err = ratelimit.New(&ratelimit.LimiterConfig{Limits: limits, Now: s.clock.Now})
	if err != nil {
		t.Fatalf("ratelimit.New: %v", err)
	}
	_, s.sched = testdb.InsertScheduler(t, s.pool, s.lim, nil)
}

// drain takes every shard of every (limit, key) from its capacity down to the limit's level, at
// soakT0 and before any fault, writing the drained tokens to the ledger. Afterwards every shard
// row exists and is far below capacity, so from soakT0 on each refills linearly (see soakCapShard).
// A sharded call charges the fuller of two random shards, so it takes a few calls per shard.
func (s *soakRun) drain(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	for _, l := range s.limits {
		for _, key := range l.keys {
			count := soakCapShard - l.level
			for attempt := 0; ; attempt++ {
				st, err := s.lim.State(ctx, s.pool, l.name, key, nil)
				if err != nil {
					t.Fatalf("drain %s/%s: %v", l.name, key, err)
				}
				full := 0
				for _, v := range st.Shards {
					if v >= soakCapShard {
						full++
					}
				}
				if full == 0 {
					break
				}
				if attempt > 40*l.shards() {
					t.Fatalf("drain %s/%s: %d shards still full after %d calls", l.name, key, full, attempt)
				}
				err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
					res, err := s.lim.LimitN(ctx, tx, l.name, key, count, nil)
					if err != nil || !res.OK {
						return err
					}
					return s.ledger(ctx, tx, 0, soakOpDrain, []soakReq{{lim: l, key: key, count: count}}, -1)
				})
				if err != nil {
					t.Fatalf("drain %s/%s: %v", l.name, key, err)
				}
			}
		}
	}
	if !s.clock.Now().Equal(soakT0) {
		t.Fatalf("the clock moved during the drain")
	}
}

// ledger writes one row per request: sign*count for each (sign -1 for a grant, +1 for a credit).
func (s *soakRun) ledger(ctx context.Context, tx pgx.Tx, op int64, kind string, reqs []soakReq, sign float64) error {
	names := make([]string, len(reqs))
	keys := make([]string, len(reqs))
	deltas := make([]float64, len(reqs))
	for i, r := range reqs {
		names[i], keys[i], deltas[i] = r.lim.name, r.key, sign*r.count
	}
	_, err := tx.Exec(ctx, `INSERT INTO soak_ledger (op, kind, name, key, delta)
		SELECT $1, $2, u.name, u.key, u.delta FROM unnest($3::text[], $4::text[], $5::float8[]) AS u(name, key, delta)`,
		op, kind, names, keys, deltas)
	return err
}

// soakReqCount draws the count of a request: 1..maxCount, except 1 for a sharded limit in a
// READ COMMITTED transaction (see soakLimit).
func soakReqCount(rng *rand.Rand, lim *soakLimit, serializable bool) float64 {
	if lim.shards() > 1 && !serializable {
		return 1
	}
	return float64(1 + rng.IntN(lim.maxCount))
}

// pick draws an operation.
func (s *soakRun) pick(rng *rand.Rand) *soakPlan {
	p := &soakPlan{serializable: rng.IntN(2) == 0, rollback: rng.IntN(100) < 10}
	// targets draws n distinct (limit, key) pairs by weight, of reserve-capable limits when
	// onlyReserve, each with a count.
	targets := func(n int, onlyReserve bool) []soakReq {
		var all []soakReq
		var weights []int
		total := 0
		for _, l := range s.limits {
			if onlyReserve && !l.reserve {
				continue
			}
			for i, k := range l.keys {
				all = append(all, soakReq{lim: l, key: k})
				weights = append(weights, l.weights[i])
				total += l.weights[i]
			}
		}
		var out []soakReq
		for len(out) < n {
			x := rng.IntN(total)
			i := 0
			for ; x >= weights[i]; i++ {
				x -= weights[i]
			}
			r := all[i]
			total -= weights[i]
			weights[i] = 0 // without replacement
			r.count = soakReqCount(rng, r.lim, p.serializable)
			out = append(out, r)
		}
		return out
	}
	switch r := rng.IntN(100); {
	case r < 35:
		p.kind = soakOpLimit
		p.reqs = targets(1, false)
		p.reqs[0].reserve = p.reqs[0].lim.reserve && rng.IntN(3) == 0
		p.throw = rng.IntN(5) == 0
	case r < 50:
		p.kind = soakOpMany
		p.reqs = targets(2+rng.IntN(2), false)
		for i := range p.reqs {
			p.reqs[i].reserve = p.reqs[i].lim.reserve && rng.IntN(3) == 0
		}
		p.throw = rng.IntN(5) == 0
	case r < 65:
		p.kind = soakOpReserve
		p.reqs = targets(1, true)
	case r < 75:
		p.kind = soakOpReserveMany
		p.reqs = targets(2, true)
	case r < 85:
		p.kind = soakOpCredit
		p.reqs = targets(1, false)
		p.reqs[0].count = float64(1 + rng.IntN(3))
	case r < 87:
		p.kind = soakOpSelfKill
		p.reqs = targets(1, false)
		p.rollback = false
	default:
		p.kind = soakOpLimit
		p.reqs = targets(1, false)
	}
	return p
}

// once runs one operation in its own transaction and tallies the outcome. A panic anywhere in it
// is recorded as a failure.
func (s *soakRun) once(rng *rand.Rand) {
	defer func() {
		if r := recover(); r != nil {
			s.failf("panic: %v\n%s", r, debug.Stack())
		}
	}()
	p := s.pick(rng)
	op := s.nextOp.Add(1)
	s.clock.tick()
	if v, ok := s.opsByKind.Load(p.kind); ok {
		v.(*atomic.Int64).Add(1)
	} else {
		n := &atomic.Int64{}
		n.Add(1)
		if v, loaded := s.opsByKind.LoadOrStore(p.kind, n); loaded {
			v.(*atomic.Int64).Add(1)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var err error
	if p.serializable {
		attempts := 0
		// A shorter backoff ceiling than the default (200 ms): the hot keys make most SERIALIZABLE
		// transactions retry at least once, and the soak should spend its time deciding.
		opts := &ratelimit.TxOpts{MaxAttempts: 8, MaxBackoff: 50 * time.Millisecond}
		err = ratelimit.InSerializableTx(ctx, s.pool, opts, func(ctx context.Context, tx pgx.Tx) error {
			if attempts++; attempts > 1 {
				s.retries.Add(1)
			}
			return s.body(ctx, tx, op, p)
		})
	} else {
		err = s.readCommitted(ctx, op, p)
	}
	switch {
	case err == nil:
		s.commits.Add(1)
	case errors.Is(err, errSoakRollback):
		s.rollbacks.Add(1)
	case ratelimit.IsLimited(err):
		s.throwRolls.Add(1)
	default:
		s.errs.add(err)
		if soakBug(err) {
			s.failf("op %d (%s): %v", op, p.kind, err)
		}
	}
}

// readCommitted runs the operation in a READ COMMITTED transaction.
func (s *soakRun) readCommitted(ctx context.Context, op int64, p *soakPlan) error {
	tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return err
	}
	if err := s.body(ctx, tx, op, p); err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		s.commitErrs.Add(1)
		return err
	}
	return nil
}

// body is the operation's work inside tx: the call, then its ledger rows (and its job, written by
// the scheduler) in the same transaction. A denial writes nothing. Whatever the call returns, a
// result that says granted together with an error is a failure: the library must fail closed.
func (s *soakRun) body(ctx context.Context, tx pgx.Tx, op int64, p *soakPlan) error {
	switch p.kind {
	case soakOpLimit, soakOpSelfKill:
		r := p.reqs[0]
		res, err := s.lim.LimitN(ctx, tx, r.lim.name, r.key, r.count, &ratelimit.LimitOpts{Reserve: r.reserve, AsError: p.throw})
		if err != nil && res.OK {
			s.failf("op %d: LimitN(%s/%s, %g) said OK with error %v", op, r.lim.name, r.key, r.count, err)
		}
		if err != nil && !ratelimit.IsLimited(err) {
			return err
		}
		s.decided(r.lim, res.OK)
		if err != nil {
			return err // an AsError denial: roll back, as a caller would
		}
		if len(res.Shards) == 2 {
			s.combined.Add(1)
		}
		if res.OK {
			if err := s.ledger(ctx, tx, op, p.kind, p.reqs, -1); err != nil {
				return err
			}
		}
		if p.kind == soakOpSelfKill {
			_, err := tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
			if err == nil {
				s.failf("op %d: a backend survived terminating itself", op)
				return errors.New("soak: backend survived pg_terminate_backend")
			}
			s.killed.Add(1)
			s.selfKilled.Add(1)
			return err
		}

	case soakOpMany:
		reqs := make([]ratelimit.Request, len(p.reqs))
		for i, r := range p.reqs {
			reqs[i] = ratelimit.Request{Name: r.lim.name, Key: r.key, Count: r.count, Reserve: r.reserve}
		}
		res, err := s.lim.LimitMany(ctx, tx, reqs, &ratelimit.LimitOpts{AsError: p.throw})
		if err != nil && res.OK {
			s.failf("op %d: LimitMany said OK with error %v", op, err)
		}
		if err != nil && !ratelimit.IsLimited(err) {
			return err
		}
		s.decided(nil, res.OK)
		if err != nil {
			return err
		}
		if res.OK {
			if len(res.Results) != len(reqs) {
				s.failf("op %d: LimitMany granted %d requests with %d results", op, len(reqs), len(res.Results))
			}
			for i, r := range res.Results {
				if !r.OK {
					s.failf("op %d: LimitMany OK but request %d (%s/%s) not granted", op, i, r.Name, r.Key)
				}
				if len(r.Shards) == 2 {
					s.combined.Add(1)
				}
			}
			if err := s.ledger(ctx, tx, op, p.kind, p.reqs, -1); err != nil {
				return err
			}
		}

	case soakOpReserve, soakOpReserveMany:
		args := soakJobArgs{Op: op}
		for _, r := range p.reqs {
			args.Reserved = append(args.Reserved, soakReserved{Name: r.lim.name, Key: r.key, Tokens: r.count})
		}
		var res *scheduler.Reservation
		var err error
		if p.kind == soakOpReserve {
			r := p.reqs[0]
			res, err = s.sched.ReserveTx(ctx, tx, r.lim.name, r.key, r.count, args, nil)
		} else {
			reqs := make([]ratelimit.Request, len(p.reqs))
			for i, r := range p.reqs {
				reqs[i] = ratelimit.Request{Name: r.lim.name, Key: r.key, Count: r.count}
			}
			res, err = s.sched.ReserveManyTx(ctx, tx, reqs, args, nil)
		}
		if err != nil && res != nil {
			s.failf("op %d: %s returned a reservation with error %v", op, p.kind, err)
		}
		if ratelimit.IsLimited(err) {
			// Past MaxReserved: nothing reserved, no job, tx untouched. Commit it as it is.
			s.decided(soakSingle(p), false)
			break
		}
		if err != nil {
			return err
		}
		if res == nil || res.Job == nil || res.Duplicate {
			s.failf("op %d: %s returned no error but reservation %+v", op, p.kind, res)
			return errors.New("soak: bad reservation")
		}
		s.decided(soakSingle(p), true)
		if err := s.ledger(ctx, tx, op, p.kind, p.reqs, -1); err != nil {
			return err
		}

	case soakOpCredit:
		r := p.reqs[0]
		cr, err := s.lim.Credit(ctx, tx, r.lim.name, r.key, r.count, nil)
		if err != nil {
			return err
		}
		s.credits.Add(1)
		if cr.Credited != r.count {
			// Only the capacity can cut a credit short, and no shard ever gets near it.
			s.failf("op %d: Credit(%s/%s, %g) credited %g", op, r.lim.name, r.key, r.count, cr.Credited)
		}
		if err := s.ledger(ctx, tx, op, p.kind, []soakReq{{lim: r.lim, key: r.key, count: cr.Credited}}, +1); err != nil {
			return err
		}
	}
	if p.rollback {
		return errSoakRollback
	}
	return nil
}

// soakSingle returns the limit of a single-limit operation, nil for one over several limits.
func soakSingle(p *soakPlan) *soakLimit {
	if len(p.reqs) == 1 {
		return p.reqs[0].lim
	}
	return nil
}

// sideConn connects a connection of its own, beside the workers' pool: its application_name is
// this run's with suffix, so the killer never picks it nor verify waits for it, and its pid is not
// recorded (no AfterConnect).
func (s *soakRun) sideConn(ctx context.Context, suffix string) (*pgx.Conn, error) {
	cfg := s.pool.Config().ConnConfig.Copy()
	cfg.RuntimeParams["application_name"] = s.appName + suffix
	cfg.AfterConnect = nil
	return pgx.ConnectConfig(ctx, cfg)
}

// killer terminates a random backend of the workers' pool every 20 to 200 ms until ctx ends. It
// only ever picks a backend whose pid the pool reported when it connected (AfterConnect) and
// whose application_name is this run's, so no other session's backend is ever touched.
func (s *soakRun) killer(ctx context.Context, rng *rand.Rand) {
	conn, err := s.sideConn(ctx, "_killer")
	if err != nil {
		s.failf("killer: connect: %v", err)
		return
	}
	defer conn.Close(context.Background())
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(20+rng.IntN(180)) * time.Millisecond):
		}
		var killed bool
		err := conn.QueryRow(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name = $1 AND pid = ANY($2::int4[]) AND pid <> pg_backend_pid()
			ORDER BY random() LIMIT 1`, s.appName, s.pidList()).Scan(&killed)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			if ctx.Err() == nil {
				s.failf("killer: %v", err)
			}
			return
		case killed:
			s.killed.Add(1)
		}
	}
}

// verify checks the invariants once every worker is done and the pool is closed:
//
//   - for every (limit, key), at two instants, the stored value (Limiter.State, summed over the
//     shards) equals N·capacity per shard + the ledger's deltas (drain, grants, reservations,
//     credits) + the refill from soakT0. Nothing else may have changed it: a denied call that
//     wrote, a rolled-back write that stayed, or a grant whose ledger row was lost would each show.
//   - every shard is an integer and far below its capacity (the preconditions of exactness).
//   - the committed reservations (ledger) and the River jobs match one for one, in count and tokens.
//   - no state rows exist but those of the soak's limits and keys, and no shard beyond the config.
func (s *soakRun) verify(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	conn, err := s.sideConn(ctx, "_verify")
	if err != nil {
		t.Fatalf("verify: connect: %v", err)
	}
	defer conn.Close(ctx)

	// A terminated backend decides its transaction's fate as it exits: wait until all are gone.
	for waited := time.Duration(0); ; waited += 50 * time.Millisecond {
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", s.appName).Scan(&n); err != nil {
			t.Fatalf("verify: %v", err)
		}
		if n == 0 {
			break
		}
		if waited > 30*time.Second {
			t.Fatalf("verify: %d backends of the pool are still there 30 s after it closed", n)
		}
		time.Sleep(50 * time.Millisecond)
	}

	type nk struct{ name, key string }
	deltas := map[nk]float64{}
	credited := map[nk]float64{}
	rows, err := conn.Query(ctx, `SELECT name, key, sum(delta), coalesce(sum(delta) FILTER (WHERE kind = 'credit'), 0)
		FROM soak_ledger GROUP BY name, key`)
	if err != nil {
		t.Fatalf("verify: read ledger: %v", err)
	}
	for rows.Next() {
		var k nk
		var d, c float64
		if err := rows.Scan(&k.name, &k.key, &d, &c); err != nil {
			t.Fatalf("verify: read ledger: %v", err)
		}
		deltas[k], credited[k] = d, c
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("verify: read ledger: %v", err)
	}

	for _, extra := range []int64{0, 37} { // now, and 37 steps later (crossing window boundaries)
		s.clock.advance(extra)
		at := s.clock.Now()
		elapsed := at.Sub(soakT0)
		for _, l := range s.limits {
			n := float64(l.shards())
			for _, key := range l.keys {
				k := nk{l.name, key}
				st, err := s.lim.State(ctx, conn, l.name, key, nil)
				if err != nil {
					t.Fatalf("verify: Value(%s/%s): %v", l.name, key, err)
				}
				implied := n*soakCapShard + deltas[k] + s.batch.knownDelta(l.name, key) + l.refill(elapsed)
				s.check(s.batch.explains(l.name, key, st.Value, implied), "%s/%s at %s: stored %.17g, implied by the ledger, the Batcher's answered calls and refill %.17g (difference %g, not explained by the Batcher calls of unknown outcome)",
					l.name, key, elapsed, st.Value, implied, st.Value-implied)
				integral := true
				for _, v := range st.Shards {
					integral = integral && v == math.Trunc(v)
				}
				s.check(integral, "%s/%s at %s: a shard is not an integer: %v", l.name, key, elapsed, st.Shards)
				// No shard could ever have reached its capacity: none starts above level, and none
				// gains more than its refill plus every credit of the key.
				bound := l.level + l.refill(elapsed)/n + credited[k]
				s.check(bound < soakCapShard, "%s/%s: a shard could have reached capacity (bound %g)", l.name, key, bound)
				if extra == 0 {
					t.Logf("%-18s %-4s value %8g = %d·2^40 %+g (ledger) %+g (refill over %s); credits %g",
						l.name, key, st.Value, l.shards(), deltas[k], l.refill(elapsed), elapsed, credited[k])
				}
			}
		}
	}

	var ledgerOnly, jobOnly, ledgerOps, jobs int64
	var ledgerTokens, jobTokens float64
	err = conn.QueryRow(ctx, `WITH
		l AS (SELECT op, name, key, -delta AS tokens FROM soak_ledger WHERE kind IN ('reserve', 'reserve_many')),
		j AS (SELECT (args->>'op')::bigint AS op, r->>'name' AS name, r->>'key' AS key, (r->>'tokens')::float8 AS tokens
		      FROM river_job, jsonb_array_elements(args->'reserved') AS r WHERE kind = $1)
		SELECT (SELECT count(*) FROM (SELECT * FROM l EXCEPT ALL SELECT * FROM j) x),
		       (SELECT count(*) FROM (SELECT * FROM j EXCEPT ALL SELECT * FROM l) x),
		       (SELECT count(DISTINCT op) FROM l),
		       (SELECT count(*) FROM river_job WHERE kind = $1),
		       (SELECT coalesce(sum(tokens), 0) FROM l),
		       (SELECT coalesce(sum(tokens), 0) FROM j)`, soakJobArgs{}.Kind()).
		Scan(&ledgerOnly, &jobOnly, &ledgerOps, &jobs, &ledgerTokens, &jobTokens)
	if err != nil {
		t.Fatalf("verify: compare jobs: %v", err)
	}
	s.check(ledgerOnly == 0, "%d committed reservations have no job", ledgerOnly)
	s.check(jobOnly == 0, "%d jobs have no committed reservation", jobOnly)
	s.check(ledgerOps == jobs, "%d committed reservations, %d jobs", ledgerOps, jobs)
	s.check(ledgerTokens == jobTokens, "committed reservations hold %g tokens, jobs %g", ledgerTokens, jobTokens)
	t.Logf("reservations: %d committed (%g tokens), %d jobs (%g tokens)", ledgerOps, ledgerTokens, jobs, jobTokens)

	var stray int64
	names, keys, shards := []string{}, []string{}, []int32{}
	for _, l := range s.limits {
		for _, k := range l.keys {
			names, keys, shards = append(names, l.name), append(keys, k), append(shards, int32(l.shards()))
		}
	}
	err = conn.QueryRow(ctx, `SELECT count(*) FROM txlimit_state s
		WHERE s.name <> '' AND NOT EXISTS (
			SELECT 1 FROM unnest($1::text[], $2::text[], $3::int4[]) AS u(name, key, shards)
			WHERE u.name = s.name AND u.key = s.key AND s.shard < u.shards)`, names, keys, shards).Scan(&stray)
	if err != nil {
		t.Fatalf("verify: stray rows: %v", err)
	}
	s.check(stray == 0, "%d state rows belong to no limit, key and shard of the soak", stray)
}
