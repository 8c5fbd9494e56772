package scheduler_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// The model of pull-forward: a limit is a ledger of operations in order, reservations and credits.
// A job's tokens of a limit have accrued at the earliest instant, from its reservation on, at which
// the level of the limit, counting every operation up to the job's reservation and every later
// credit out of the reservation of the job itself or of one before it, but no later reservation,
// is >= 0. Credits are what the limit really took (it never goes above capacity). The job is due when all its limits have accrued.

type mOp struct {
	at       time.Time
	job      int     // the reserving job, -1 for a credit
	from     int     // a credit's job: the one cancelled or settled
	count    float64 // reserved, or asked to credit
	credited float64 // a credit's amount as the limit took it
}

type mLimit struct {
	cfg ratelimit.Config // capacity = Rate; a fixed window starts at t0
	ops []mOp
}

// refill returns level after the time from..to.
func (l *mLimit) refill(level float64, from, to time.Time) float64 {
	if !to.After(from) {
		return level
	}
	if l.cfg.Kind == ratelimit.FixedWindow {
		n := float64(to.Sub(t0)/l.cfg.Period - from.Sub(t0)/l.cfg.Period) // window starts in (from, to]
		return math.Min(level+n*l.cfg.Rate, l.cfg.Rate)
	}
	return math.Min(level+l.cfg.Rate*float64(to.Sub(from))/float64(l.cfg.Period), l.cfg.Rate)
}

// add appends an operation and, for a credit, computes what the limit takes of it.
func (l *mLimit) add(op mOp) float64 {
	if op.job < 0 {
		level, at := l.cfg.Rate, t0
		for _, o := range l.ops {
			level, at = l.apply(level, at, o)
		}
		level = l.refill(level, at, op.at)
		op.credited = math.Min(level+op.count, l.cfg.Rate) - level
	}
	l.ops = append(l.ops, op)
	return op.credited
}

// apply is the ledger after o: the level refilled from at to o.at, then charged o's reservation
// or given its credit.
func (l *mLimit) apply(level float64, at time.Time, o mOp) (float64, time.Time) {
	level = l.refill(level, at, o.at)
	if o.job >= 0 {
		return level - o.count, o.at
	}
	return level + o.credited, o.at
}

// earliest returns when job's tokens of l have accrued, and whether it had to wait for them.
func (l *mLimit) earliest(job int) (time.Time, bool) {
	level, at := l.cfg.Rate, t0
	i := 0
	for ; i < len(l.ops); i++ { // the ledger as it was, up to the job's reservation
		o := l.ops[i]
		level, at = l.apply(level, at, o)
		if o.job == job {
			break
		}
	}
	if i == len(l.ops) {
		panic("job not in ledger")
	}
	if level >= 0 {
		return at, false
	}
	cross := func(until time.Time, bounded bool) (time.Time, bool) { // first instant in (at, until] with level >= 0
		if l.cfg.Kind == ratelimit.FixedWindow {
			for b := t0.Add((at.Sub(t0)/l.cfg.Period + 1) * l.cfg.Period); !bounded || !b.After(until); b = b.Add(l.cfg.Period) {
				if l.refill(level, at, b) >= 0 {
					return b, true
				}
				if !bounded && b.Sub(at) > time.Hour {
					panic("no crossing")
				}
			}
			return time.Time{}, false
		}
		t := at.Add(time.Duration(math.Ceil(-level*float64(l.cfg.Period)/l.cfg.Rate/1e3)) * time.Microsecond)
		return t, !bounded || !t.After(until)
	}
	for _, o := range l.ops[i+1:] {
		if o.job >= 0 || o.from > job {
			continue // later reservations wait behind the job, and their refunds do not help it
		}
		if t, ok := cross(o.at, true); ok {
			return t, true
		}
		level = l.refill(level, at, o.at) + o.credited
		at = o.at
		if level >= 0 {
			return at, true
		}
	}
	t, _ := cross(time.Time{}, false)
	return t, true
}

type mJob struct {
	id        int64
	limits    []string
	counts    []float64
	waited    bool
	cancelled bool
	settled   bool
}

// TestPullForwardModel runs random reservations (one limit and two), cancels, settles and clock
// steps on a token bucket, a second token bucket and a fixed window, and after each step compares
// the scheduled time of every waiting job with the model's earliest time for it, exactly.
func TestPullForwardModel(t *testing.T) {
	t.Parallel()
	for _, seed := range []uint64{1, 3, 5, 15} { // each a different history; seed 1 found a lost fixed-window credit
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			t.Parallel()
			pullForwardModel(t, conn{}, seed)
		})
	}
}

func pullForwardModel(t *testing.T, c conn, seed uint64) {
	ctx := context.Background()
	limits := map[string]*mLimit{
		"tok": {cfg: ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 1000}},
		"req": {cfg: ratelimit.Config{Rate: 2, Period: time.Second, MaxReserved: 1000}},
		"win": {cfg: ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 10, Period: time.Second, Start: t0, MaxReserved: 1000}},
	}
	cfgs := map[string]ratelimit.Config{}
	for name, l := range limits {
		cfgs[name] = l.cfg
	}
	var clock atomic.Int64
	clock.Store(t0.UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()).UTC() }
	b := setup(t, &setupOpts{limits: cfgs, now: now, conn: c})
	rng := rand.New(rand.NewPCG(seed, 6))

	var js []*mJob
	check := func(step int) {
		t.Helper()
		for i, j := range js {
			if j.cancelled || !j.waited {
				continue
			}
			var want time.Time
			for _, name := range j.limits {
				if at, _ := limits[name].earliest(i); at.After(want) {
					want = at
				}
			}
			require.Equal(t, want, jobRow(t, b, j.id).ScheduledAt.UTC(), "step %d: job %d (%v %v)", step, i, j.limits, j.counts)
		}
	}
	live := func() *mJob {
		var c []*mJob
		for _, j := range js {
			if !j.cancelled && !j.settled {
				c = append(c, j)
			}
		}
		if len(c) == 0 {
			return nil
		}
		return c[rng.IntN(len(c))]
	}
	index := func(j *mJob) int {
		for i := range js {
			if js[i] == j {
				return i
			}
		}
		panic("unknown job")
	}
	moved := 0
	for step := range 120 {
		switch p := rng.IntN(100); {
		case p < 45:
			j := &mJob{limits: []string{"tok"}, counts: []float64{float64(1 + rng.IntN(8))}}
			switch {
			case p < 15:
				j.limits, j.counts = []string{"tok", "req"}, []float64{j.counts[0], 1}
			case p < 27:
				j.limits, j.counts = []string{"win"}, []float64{float64(1 + rng.IntN(12))}
			}
			reqs := make([]ratelimit.Request, len(j.limits))
			for i := range reqs {
				reqs[i] = ratelimit.Request{Name: j.limits[i], Key: "k", Count: j.counts[i]}
			}
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.ReserveManyTx(ctx, tx, reqs, callArgs{N: len(js)}, nil)
				if err != nil {
					return err
				}
				j.id, j.waited = res.Job.ID, !res.RetryAt.IsZero()
				return nil
			}))
			for i, name := range j.limits {
				limits[name].add(mOp{at: now(), job: len(js), count: j.counts[i]})
			}
			js = append(js, j)
		case p < 65:
			j := live()
			if j == nil {
				continue
			}
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.CancelTx(ctx, tx, j.id)
				require.NoError(t, err)
				for i, name := range j.limits {
					want := limits[name].add(mOp{at: now(), job: -1, from: index(j), count: j.counts[i]})
					require.Equal(t, want, res.Limits[i].Credited, "step %d: refund of %s", step, name)
				}
				moved += res.PulledForward
				return nil
			}))
			j.cancelled = true
		case p < 85:
			j := live()
			if j == nil {
				continue
			}
			actual := make([]float64, len(j.counts))
			for i, c := range j.counts {
				actual[i] = math.Floor(c / 2)
			}
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.SettleManyTx(ctx, tx, j.id, actual)
				require.NoError(t, err)
				for i, name := range j.limits {
					want := limits[name].add(mOp{at: now(), job: -1, from: index(j), count: j.counts[i] - actual[i]})
					require.Equal(t, want, res.Limits[i].Credited, "step %d: credit of %s", step, name)
				}
				moved += res.PulledForward
				return nil
			}))
			j.settled = true
		default:
			clock.Add(int64(time.Duration(1+rng.IntN(5)) * 100 * time.Millisecond))
		}
		check(step)
	}
	require.Positive(t, moved, "no job was pulled forward: the test tests nothing")
	t.Logf("%d jobs, %d pulled forward", len(js), moved)
}

// TestPullForwardRecordsRow: a waiting job records, per limit, its RetryAt and the row its
// reservation left (value, ts); a credit out of an earlier reservation is added to that row and the
// RetryAt follows it, also a fixed window's credit too small to move the job by a window (recorded,
// so that the next credit adds to it). A sharded limit is recorded as fixed, with no row.
func TestPullForwardRecordsRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{
		"tok": {Rate: 10, Period: time.Second, MaxReserved: 1000},
		"win": {Kind: ratelimit.FixedWindow, Rate: 5, Period: 10 * time.Second, Start: t0, MaxReserved: 1000},
		"hot": {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 1000},
	}, now: frozen(t0)})
	reserved := func(id int64) string {
		return string(metadataValue(t, jobRow(t, b, id).Metadata, scheduler.ReservedKey))
	}
	cancel := func(id int64, moved int) {
		t.Helper()
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := b.sched.CancelTx(ctx, tx, id)
			require.NoError(t, err)
			require.Equal(t, moved, res.PulledForward)
			return nil
		}))
	}

	reserve(t, b, "tok", "k", 10) // runs now
	ja := reserve(t, b, "tok", "k", 5)
	jb := reserve(t, b, "tok", "k", 5)
	require.JSONEq(t, `{"limits":[{"name":"tok","key":"k","count":5,"retry_at":"2024-01-01T12:00:01Z",
		"row":{"value":-10,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(jb.Job.ID))
	cancel(ja.Job.ID, 1)
	require.JSONEq(t, `{"limits":[{"name":"tok","key":"k","count":5,"retry_at":"2024-01-01T12:00:00.5Z",
		"row":{"value":-5,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(jb.Job.ID))
	require.Equal(t, t0.Add(500*time.Millisecond), jobRow(t, b, jb.Job.ID).ScheduledAt.UTC())

	reserve(t, b, "win", "k", 5) // runs now: the window of t0 is empty
	jc := reserve(t, b, "win", "k", 0.25)
	jd := reserve(t, b, "win", "k", 0.25)
	je := reserve(t, b, "win", "k", 10) // −10.5: three windows
	require.JSONEq(t, `{"limits":[{"name":"win","key":"k","count":10,"retry_at":"2024-01-01T12:00:30Z",
		"row":{"value":-10.5,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(je.Job.ID))
	cancel(jc.Job.ID, 0) // −10.25: still three windows, but recorded
	require.JSONEq(t, `{"limits":[{"name":"win","key":"k","count":10,"retry_at":"2024-01-01T12:00:30Z",
		"row":{"value":-10.25,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(je.Job.ID))
	cancel(jd.Job.ID, 1) // −10.25 + 0.25 = −10: two windows
	require.JSONEq(t, `{"limits":[{"name":"win","key":"k","count":10,"retry_at":"2024-01-01T12:00:20Z",
		"row":{"value":-10,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(je.Job.ID))
	require.Equal(t, t0.Add(20*time.Second), jobRow(t, b, je.Job.ID).ScheduledAt.UTC())

	reserve(t, b, "hot", "k", 10)
	jf := reserve(t, b, "hot", "k", 4) // both shards at −2, 5/s each
	require.JSONEq(t, `{"limits":[{"name":"hot","key":"k","count":4,"retry_at":"2024-01-01T12:00:00.4Z","fixed":true}]}`, reserved(jf.Job.ID))
}

// TestPullForwardShardedKeepsTime: a credit to a sharded limit does not move the jobs waiting on it
// (it goes to the emptiest shards, not necessarily theirs): they keep their time, never earlier.
func TestPullForwardShardedKeepsTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{
		"hot": {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 1000},
	}, now: frozen(t0)})
	reserve(t, b, "hot", "k", 10)
	r1 := reserve(t, b, "hot", "k", 4)
	r2 := reserve(t, b, "hot", "k", 4)
	before := jobRow(t, b, r2.Job.ID).ScheduledAt
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.CancelTx(ctx, tx, r1.Job.ID)
		require.NoError(t, err)
		require.Equal(t, 0, res.PulledForward)
		return nil
	}))
	require.Equal(t, before, jobRow(t, b, r2.Job.ID).ScheduledAt)
	_ = scheduler.ReservedKey
}
