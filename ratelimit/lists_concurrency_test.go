package ratelimit_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// listLimits are limits of every shape a list can hold: unsharded token bucket, fixed window,
// sharded, reservations. On a frozen clock nothing refills, so what each row lost is exactly
// what was granted on it.
var listLimits = map[string]ratelimit.Config{
	"u":  {Rate: 30, Period: time.Hour, Capacity: 30, MaxReserved: 4},
	"w":  {Kind: ratelimit.FixedWindow, Rate: 25, Period: time.Hour, Capacity: 25},
	"s":  {Rate: 40, Period: time.Hour, Capacity: 40, Shards: 4, MaxReserved: 8},
	"s2": {Rate: 16, Period: time.Hour, Capacity: 16, Shards: 2},
}

type listTarget struct{ name, key string }

var listTargets = []listTarget{{"u", "a"}, {"u", "b"}, {"w", "a"}, {"s", "a"}, {"s2", "b"}, {"u", "c"}}

// randomList is a LimitMany of 1 to 4 distinct targets in random order.
func randomList(rng *rand.Rand) []ratelimit.Request {
	n := 1 + rng.IntN(4)
	perm := rng.Perm(len(listTargets))[:n]
	reqs := make([]ratelimit.Request, n)
	for i, j := range perm {
		tg := listTargets[j]
		reqs[i] = ratelimit.Request{Name: tg.name, Key: tg.key, Count: float64(1 + rng.IntN(2))}
		if (tg.name == "u" || tg.name == "s") && rng.IntN(4) == 0 {
			reqs[i].Reserve = true
		}
	}
	return reqs
}

// listLedger adds up what granted lists charged per target.
type listLedger struct {
	mu      sync.Mutex
	charged map[listTarget]float64
	grants  int
	denials int
	now     int // denials with RetryAt = Time
}

func (l *listLedger) record(t *testing.T, reqs []ratelimit.Request, m ratelimit.ManyResult) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(m.Results) != len(reqs) {
		t.Errorf("%d results for %d requests", len(m.Results), len(reqs))
		return
	}
	all := true
	for i, r := range m.Results {
		if r.Name != reqs[i].Name || r.Key != reqs[i].Key {
			t.Errorf("result %d names %s/%s, request %s/%s", i, r.Name, r.Key, reqs[i].Name, reqs[i].Key)
		}
		all = all && r.OK
		if !r.Time.Equal(m.Time) {
			t.Errorf("result %d at %v, list at %v", i, r.Time, m.Time)
		}
	}
	if all != m.OK {
		t.Errorf("ManyResult.OK %v but every result OK: %v (%+v)", m.OK, all, m)
	}
	if m.OK {
		l.grants++
		for i, r := range reqs {
			l.charged[listTarget{r.Name, r.Key}] += r.Count
			if len(m.Results[i].Shards) == 0 {
				t.Errorf("granted request %d charged no shard", i)
			}
		}
		return
	}
	l.denials++
	if m.RetryAt.Equal(m.Time) {
		l.now++
	}
	if !m.RetryAt.After(m.Time) && !m.RetryAt.Equal(m.Time) {
		t.Errorf("denied with RetryAt %v before Time %v", m.RetryAt, m.Time)
	}
}

// check requires that every target's rows lost exactly what the granted lists charged.
func (l *listLedger) check(t *testing.T, b *testBundle) {
	t.Helper()
	for _, tg := range listTargets {
		st, err := b.lim.State(b.ctx, b.pool, tg.name, tg.key, nil)
		require.NoError(t, err)
		cfg := listLimits[tg.name]
		got := cfg.Capacity - st.Value
		require.Equal(t, l.charged[tg], got, "%s/%s: granted lists charged %v, rows lost %v", tg.name, tg.key, l.charged[tg], got)
	}
	t.Logf("%d lists granted, %d denied (%d to retry at once)", l.grants, l.denials, l.now)
}

// TestListsConcurrentLedger: many goroutines decide random overlapping lists (sharded and
// unsharded limits mixed, reservations, rows created by the lists, opposite orders) on a frozen
// clock, on the pool, in READ COMMITTED transactions, and through a Batcher of two lanes. Every
// row must have lost exactly what the granted lists charged (nothing refills), and no call may
// fail. (A list may be refused to retry at once even here: a sharded request whose plan charged
// one pick, which another list drained before the lock, while the other pick would serve.)
func TestListsConcurrentLedger(t *testing.T) {
	t.Parallel()
	b, bat := frozenBatcher(t, 12, 2)
	led := &listLedger{charged: map[listTarget]float64{}}
	batLed := &listLedger{charged: map[listTarget]float64{}}
	inParallel(12, 7, func(w int, rng *rand.Rand) {
		for i := 0; i < 150; i++ {
			reqs := randomList(rng)
			var m ratelimit.ManyResult
			var err error
			onBatcher := false
			switch w % 3 {
			case 0, 1:
				m, err = limitManyOnPool(b, w%3 == 1, reqs)
			case 2:
				onBatcher = true
				if len(reqs) == 1 && rng.IntN(2) == 0 {
					var r ratelimit.Result
					r, err = bat.LimitN(b.ctx, reqs[0].Name, reqs[0].Key, reqs[0].Count, &ratelimit.LimitOpts{Reserve: reqs[0].Reserve})
					m = ratelimit.ManyResult{OK: r.OK, RetryAt: r.RetryAt, Results: []ratelimit.Result{r}, Time: r.Time}
				} else {
					m, err = bat.LimitMany(b.ctx, reqs, nil)
				}
			}
			if err != nil {
				t.Errorf("worker %d call %d: %v", w, i, err)
				return
			}
			if onBatcher {
				batLed.record(t, reqs, m)
				led.mu.Lock()
				if m.OK {
					for _, r := range reqs {
						led.charged[listTarget{r.Name, r.Key}] += r.Count
					}
				}
				led.mu.Unlock()
			} else {
				led.record(t, reqs, m)
			}
		}
	})
	led.check(t, b)
	t.Logf("batcher: %d granted, %d denied (%d to retry at once)", batLed.grants, batLed.denials, batLed.now)
}

// frozenBundle is setup's bundle (the clock at t0) on a pool of conns connections.
func frozenBundle(t *testing.T, conns int32) *testBundle {
	t.Helper()
	clock := &testClock{t: t0}
	b := newBundle(t, &testdb.Options{MaxConns: conns}, &ratelimit.LimiterConfig{Limits: listLimits, Now: clock.Now})
	b.clock = clock
	return b
}

// inParallel runs workers goroutines, each given its number w and a generator of its own (seeded
// with w and stream), and waits for them all.
func inParallel(workers int, stream uint64, work func(w int, rng *rand.Rand)) {
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() { work(w, rand.New(rand.NewPCG(uint64(w), stream))) })
	}
	wg.Wait()
}

// frozenBatcher is frozenBundle with a Batcher of lanes lanes on it, closed when the test ends.
func frozenBatcher(t *testing.T, conns int32, lanes int) (*testBundle, *ratelimit.Batcher) {
	t.Helper()
	b := frozenBundle(t, conns)
	bat, err := ratelimit.NewBatcher(b.pool, b.lim, &ratelimit.BatcherConfig{Lanes: lanes})
	require.NoError(t, err)
	t.Cleanup(bat.Close)
	return b, bat
}

// isCode reports whether err carries SQLSTATE code.
func isCode(err error, code string) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == code
}

// TestListsSerializableNoDeadlock: the same lists, each in a SERIALIZABLE transaction of its own
// (one call each), retried here on 40001 only: docs/spec.md §7 promises that two calls never
// deadlock (40P01) on each other's rows, so no 40P01 may appear, and the ledger holds.
func TestListsSerializableNoDeadlock(t *testing.T) {
	t.Parallel()
	b := frozenBundle(t, 12)
	led := &listLedger{charged: map[listTarget]float64{}}
	var mu sync.Mutex
	serial, other := 0, []error{}
	inParallel(12, 11, func(w int, rng *rand.Rand) {
		for i := 0; i < 100; i++ {
			reqs := randomList(rng)
			for {
				var m ratelimit.ManyResult
				err := pgx.BeginTxFunc(b.ctx, b.pool, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
					var err error
					m, err = b.lim.LimitMany(b.ctx, tx, reqs, nil)
					return err
				})
				if err == nil {
					led.record(t, reqs, m)
					break
				}
				mu.Lock()
				var busy *ratelimit.BusyError
				if isCode(err, "40001") || errors.As(err, &busy) {
					serial++
					mu.Unlock()
					continue
				}
				other = append(other, fmt.Errorf("worker %d list %d: %w", w, i, err))
				mu.Unlock()
				break
			}
		}
	})
	t.Logf("%d serialization failures retried", serial)
	require.Empty(t, other)
	led.check(t, b)
}

// serialLimits: an unsharded token bucket and fixed window, and two sharded buckets, all with
// reservations but the window.
var serialLimits = map[string]ratelimit.Config{
	"a": {Rate: 5, Period: time.Second, Capacity: 5, MaxReserved: 3},
	"b": {Kind: ratelimit.FixedWindow, Rate: 4, Period: time.Second, Start: t0},
	"c": {Rate: 8, Period: time.Second, Capacity: 8, Shards: 4, MaxReserved: 4},
	"d": {Rate: 4, Period: time.Second, Capacity: 4, Shards: 2, MaxReserved: 2},
}

// TestListsMatchModelAnyGroupOrder decides random lists of calls, serially, on a moving injected
// clock, and compares every result with the model run call after call: groups of several requests
// anywhere in the list, Checks anywhere, reservations, sharded and unsharded limits, the same key
// in many calls. Beyond what FuzzModel compares, it checks Result.TS: the ts the one row a grant
// charged was left with (for a Check: would be left with), zero when denied or two rows charged.
func TestListsMatchModelAnyGroupOrder(t *testing.T) {
	t.Parallel()
	clock := &testClock{t: t0}
	b := newBundle(t, nil, &ratelimit.LimiterConfig{Limits: serialLimits, Now: clock.Now})
	var picks [][2]int
	ratelimit.SetShardPicker(b.lim, func(n int) (int, int) {
		if len(picks) == 0 {
			t.Fatalf("picker called more often than expected")
		}
		p := picks[0]
		picks = picks[1:]
		return p[0], p[1]
	})
	md := newModel()
	seed := uint64(5)
	if v := os.Getenv("LISTSEED"); v != "" {
		seed, _ = strconv.ParseUint(v, 10, 64)
	}
	rng := rand.New(rand.NewPCG(seed, 9))
	stats := map[string]int{}
	defer func() { t.Logf("%v", stats) }()
	names := []string{"a", "b", "c", "d"}
	keys := []string{"k", "j"}
	now := t0.UnixMicro()
	for step := 0; step < 300; step++ {
		now += int64(rng.IntN(250_000))
		clock.Set(time.UnixMicro(now))
		var calls []ratelimit.ListCall
		var mcalls [][]modelReq
		picks = nil
		n := 2 + rng.IntN(5)
		for range n {
			k := 1
			if rng.IntN(3) == 0 {
				k = 2 + rng.IntN(2)
			}
			dry := rng.IntN(4) == 0
			used := map[[2]string]bool{}
			var reqs []ratelimit.Request
			var mreqs []modelReq
			for len(reqs) < k {
				name, key := names[rng.IntN(len(names))], keys[rng.IntN(len(keys))]
				if used[[2]string{name, key}] {
					continue
				}
				used[[2]string{name, key}] = true
				cfg := serialLimits[name]
				ml, err := modelResolve(name, key, &cfg)
				require.NoError(t, err)
				count := []float64{0.5, 1, 2, 3}[rng.IntN(4)]
				reserve := cfg.MaxReserved > 0 && rng.IntN(3) == 0
				if ml.neverGranted(count, reserve) {
					continue
				}
				mr := modelReq{lim: ml, count: count, reserve: reserve, a: 0, b: -1}
				if ml.shards >= 2 {
					mr.a = rng.IntN(ml.shards)
					mr.b = (mr.a + 1 + rng.IntN(ml.shards-1)) % ml.shards
					picks = append(picks, [2]int{mr.a, mr.b})
				}
				reqs = append(reqs, ratelimit.Request{Name: name, Key: key, Count: count, Reserve: reserve})
				mreqs = append(mreqs, mr)
			}
			calls = append(calls, ratelimit.ListCall{Reqs: reqs, Dry: dry, Single: k == 1})
			mcalls = append(mcalls, mreqs)
		}
		got, errs, err := ratelimit.DecideList(b.ctx, b.lim, b.pool, calls)
		require.NoError(t, err, "step %d", step)
		for i, mreqs := range mcalls {
			require.NoError(t, errs[i], "step %d call %d", step, i)
			before := map[modelRowKey]modelRow{}
			for k, v := range md.rows {
				before[k] = v
			}
			want := md.decide(now, mreqs, calls[i].Dry)
			g := got[i]
			what := fmt.Sprintf("step %d call %d (%+v dry=%v)", step, i, calls[i].Reqs, calls[i].Dry)
			require.Equal(t, want.OK, g.OK, what)
			stats[fmt.Sprintf("ok=%v dry=%v k=%d", g.OK, calls[i].Dry, len(mreqs))]++
			require.True(t, sameTime(g.RetryAt, want.RetryAt), "%s: RetryAt %v, want %d", what, g.RetryAt, want.RetryAt-t0.UnixMicro())
			require.True(t, g.Time.Equal(time.UnixMicro(now)), what)
			for j, w := range want.Results {
				r := g.Results[j]
				if r.OK != w.OK || r.Reserved != w.Reserved || !sameTime(r.RetryAt, w.RetryAt) || !sameFloat(r.Value, w.Value) ||
					fmt.Sprint(r.Shards) != fmt.Sprint(w.Shards) {
					t.Fatalf("%s result %d: got ok=%v reserved=%v retryAt=%v value=%v shards=%v; want ok=%v reserved=%v retryAt=%d value=%v shards=%v",
						what, j, r.OK, r.Reserved, sinceT0(r.RetryAt), r.Value, r.Shards, w.OK, w.Reserved, w.RetryAt-t0.UnixMicro(), w.Value, w.Shards)
				}
				// TS: the row a grant charged alone, as it was (would be) left.
				wantTS := modelNoTime
				mr := mreqs[j]
				if len(w.Shards) == 1 {
					row, ok := before[modelRowKey{mr.lim.name, mr.lim.key, w.Shards[0]}]
					if !ok {
						row = mr.lim.missingRow(now)
					}
					_, wantTS = mr.lim.level(row, now)
				}
				require.True(t, sameTime(r.TS, wantTS), "%s result %d: TS %v, want %d", what, j, sinceT0(r.TS), wantTS-t0.UnixMicro())
			}
		}
		require.Empty(t, picks, "step %d: picks left", step)
	}
}

// TestListsConcurrentWithCreditsAndNewRows: the ledger of TestListsConcurrentLedger with Credit
// giving tokens back meanwhile (so rows gain tokens between a list's plan and its locks) and keys
// that start missing (so concurrent lists create the same rows). A list refused to retry at once
// is retried at once, and must not be refused so again and again.
func TestListsConcurrentWithCreditsAndNewRows(t *testing.T) {
	t.Parallel()
	b, bat := frozenBatcher(t, 14, 3)
	var targets []listTarget
	for i := range 8 {
		for _, n := range []string{"u", "s", "s2", "w"} {
			targets = append(targets, listTarget{n, fmt.Sprintf("n%d", i)})
		}
	}
	var mu sync.Mutex
	charged := map[listTarget]float64{}
	granted, denied, atOnce, maxRun := 0, 0, 0, 0
	stop := time.Now().Add(2 * time.Second)
	inParallel(14, 13, func(w int, rng *rand.Rand) {
		for time.Now().Before(stop) {
			if w == 13 { // the creditor
				tg := targets[rng.IntN(len(targets))]
				c, err := b.lim.Credit(b.ctx, b.pool, tg.name, tg.key, float64(1+rng.IntN(3)), nil)
				if err != nil {
					t.Errorf("credit: %v", err)
					return
				}
				mu.Lock()
				charged[tg] -= c.Credited
				mu.Unlock()
				continue
			}
			n := 1 + rng.IntN(4)
			perm := rng.Perm(len(targets))[:n]
			reqs := make([]ratelimit.Request, n)
			for i, j := range perm {
				reqs[i] = ratelimit.Request{Name: targets[j].name, Key: targets[j].key, Count: float64(1 + rng.IntN(3))}
			}
			for run := 1; ; run++ {
				var m ratelimit.ManyResult
				var err error
				switch w % 3 {
				case 0, 1:
					m, err = limitManyOnPool(b, w%3 == 1, reqs)
				default:
					m, err = bat.LimitMany(b.ctx, reqs, nil)
				}
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				mu.Lock()
				if m.OK {
					granted++
					for _, r := range reqs {
						charged[listTarget{r.Name, r.Key}] += r.Count
					}
				} else {
					denied++
				}
				again := !m.OK && m.RetryAt.Equal(m.Time)
				if again {
					atOnce++
					maxRun = max(maxRun, run)
				}
				mu.Unlock()
				if !again {
					break
				}
				if run > 100 {
					t.Errorf("worker %d: refused to retry at once %d times in a row: %+v", w, run, m)
					return
				}
			}
		}
	})
	t.Logf("%d granted, %d denied, %d to retry at once (at most %d in a row)", granted, denied, atOnce, maxRun)
	for _, tg := range targets {
		st, err := b.lim.State(b.ctx, b.pool, tg.name, tg.key, nil)
		require.NoError(t, err)
		require.Equal(t, charged[tg], listLimits[tg.name].Capacity-st.Value, "%s/%s", tg.name, tg.key)
	}
}

// TestListsOppositeOrdersOnNewRows: workers decide the same lists in opposite orders, each in a
// READ COMMITTED transaction that holds its locks a while before it commits, on keys that start
// missing (so the lists create the rows they lock) and on sharded limits: docs/spec.md §7
// promises no deadlock (40P01) between two calls, whatever the order of their requests.
func TestListsOppositeOrdersOnNewRows(t *testing.T) {
	t.Parallel()
	b := frozenBundle(t, 8)
	inParallel(8, 17, func(w int, rng *rand.Rand) {
		for i := range 200 {
			key := fmt.Sprintf("k%d", i/4) // two rounds on each key: created, then existing
			reqs := []ratelimit.Request{{Name: "u", Key: key}, {Name: "s", Key: key}, {Name: "s2", Key: key}, {Name: "w", Key: key}}
			rng.Shuffle(len(reqs), func(i, j int) { reqs[i], reqs[j] = reqs[j], reqs[i] })
			if w%2 == 1 {
				slices.Reverse(reqs)
			}
			err := pgx.BeginFunc(b.ctx, b.pool, func(tx pgx.Tx) error {
				var err error
				if w%4 == 3 { // a lone call: one row, or two shards
					_, err = b.lim.LimitN(b.ctx, tx, reqs[0].Name, reqs[0].Key, float64(1+rng.IntN(2)), nil)
				} else {
					_, err = b.lim.LimitMany(b.ctx, tx, reqs, nil)
				}
				time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
				return err
			})
			if err != nil {
				t.Errorf("worker %d list %d: %v", w, i, err)
				return
			}
		}
	})
}

// limitManyOnPool makes LimitMany(reqs) on b's pool: in a transaction of its own when inTx, else
// as one statement.
func limitManyOnPool(b *testBundle, inTx bool, reqs []ratelimit.Request) (ratelimit.ManyResult, error) {
	if !inTx {
		return b.lim.LimitMany(b.ctx, b.pool, reqs, nil)
	}
	var m ratelimit.ManyResult
	err := pgx.BeginFunc(b.ctx, b.pool, func(tx pgx.Tx) error {
		var err error
		m, err = b.lim.LimitMany(b.ctx, tx, reqs, nil)
		return err
	})
	return m, err
}
