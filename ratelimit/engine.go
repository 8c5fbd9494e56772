package ratelimit

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// rowID names one row of txlimit_state.
type rowID struct {
	name, key string
	shard     int32
}

// compareRows is the global lock order: name, key, shard, names and keys compared as bytes (the
// order of the table's primary key, whose text columns are COLLATE "C").
func compareRows(a, b rowID) int {
	if c := cmp.Compare(a.name, b.name); c != 0 {
		return c
	}
	if c := cmp.Compare(a.key, b.key); c != 0 {
		return c
	}
	return cmp.Compare(a.shard, b.shard)
}

// decideCalls decides calls in list order, in one statement, and returns one outcome per call.
// Each call is an all-or-nothing group; a call sees the effect of the calls granted before it in
// the list. A list of one request is sent as scalars (DecideOneRow, DecideOne), any other as
// parallel arrays (Decide); all are the same road (migrations/00003_txlimit_decide.sql). An error returned alone
// (a database error) fails every call: nothing of the list was granted.
func (l *Limiter) decideCalls(ctx context.Context, db Executor, calls []*call) ([]outcome, error) {
	var got []answer
	var err error
	if len(calls) == 1 && len(calls[0].specs) == 1 {
		got, err = l.decideOne(ctx, db, calls[0])
	} else {
		got, err = l.decideList(ctx, db, calls)
	}
	if err != nil {
		return nil, err
	}
	return l.outcomes(ctx, calls, got), nil
}

// unshardedCandidates is the one candidate shard of an unsharded request: shared, never modified.
var unshardedCandidates = []int32{0}

// candidates returns the candidate shards of request s of call c: shard 0 when unsharded; the two
// random picks when sharded; and, for a lone call that is not a Check on a sharded limit (which
// steers away from shards other transactions are deciding on, at every isolation level, see
// txlimit_steer), further candidates after the two picks.
func (l *Limiter) candidates(c *call, s *spec, lone bool) []int32 {
	if s.shards < 2 {
		return unshardedCandidates
	}
	a, b := l.pick(s.shards)
	if lone && !c.dry {
		return shardCandidates(s.shards, a, b)
	}
	return []int32{int32(a), int32(b)}
}

// allow returns how far below zero request i of call c may take one shard: 0 without Reserve.
func (c *call) allow(i int) float64 {
	if c.asks[i].reserve {
		return c.specs[i].maxRes
	}
	return 0
}

// queueBit is the bit the lock key of a row's queue (DecideOneRow) adds to the row's own lock key.
const queueBit = 1 << 19

// decideOne decides a list of one request, sent as scalars: a Limit or LimitN on an unsharded
// limit by DecideOneRow, which first tries the one UPDATE, anything else by DecideOne.
func (l *Limiter) decideOne(ctx context.Context, db Executor, c *call) ([]answer, error) {
	var d answer // the answer, once unpacked
	s := &c.specs[0]
	lockKey := shardLockBase(s.name, s.key)
	now, err := l.clock(c.op)
	if err != nil {
		return nil, err
	}
	var a []byte
	if s.shards < 2 && !c.dry {
		a, err = via(on(db), ctx, dbsqlc.DecideOneRowParams{
			NowUs: now, Name: s.name, Key: s.key, Count: c.asks[0].count, Allow: c.allow(0),
			StepUs: s.stepUs, Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity, AnchorUs: s.missingTS(now),
			QueueKey: lockKey ^ queueBit, LockKey: lockKey,
		}, (*dbsqlc.Queries).DecideOneRow, driver.Executor.DecideOneRow)
	} else {
		if s.shards >= 2 && !c.dry {
			done, err := l.admit(ctx, db, s, c)
			if err != nil {
				return nil, err
			}
			defer func() { done(d) }()
		}
		a, err = via(on(db), ctx, dbsqlc.DecideOneParams{
			NowUs: now, Name: s.name, Key: s.key, Count: c.asks[0].count, Allow: c.allow(0), Dry: c.dry,
			StepUs: s.stepUs, Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity, AnchorUs: s.missingTS(now),
			Shards: l.candidates(c, s, true), LockKey: lockKey,
		}, (*dbsqlc.Queries).DecideOne, driver.Executor.DecideOne)
	}
	if err != nil {
		return nil, err
	}
	if d, err = unpack(a); err != nil {
		return nil, err
	}
	return []answer{d}, nil
}

// answer is the engine's answer to one request (txlimit_pack_v1 in migrations/00003_txlimit_decide.sql
// says what each number means).
type answer struct {
	seen                    bool // set by unpack
	ok, reserved, busy      bool
	levelSum                float64
	shardA, shardB, charged int32
	retryAtUs, nowUs, tsUs  int64
}

// poolOf returns the pool db is, when each of its statements is a transaction of its own (a
// *pgxpool.Pool, or another driver's pool, driver.Pooled: database/sql's *sql.DB through package
// sqldb), as a value equal for every handle of that pool; nil for a transaction or a connection.
func poolOf(db Executor) any {
	switch d := db.(type) {
	case *pgxpool.Pool:
		return d
	case driver.Pooled:
		return d.Pool()
	}
	return nil
}

// refusedFor is how long the answer says its key refuses such a request: RetryAt less the
// decision's time for a refusal (not a busy one), else 0.
func (d answer) refusedFor() time.Duration {
	if !d.seen || d.ok || d.busy || d.retryAtUs <= d.nowUs {
		return 0
	}
	return time.Duration(min(d.retryAtUs-d.nowUs, int64(time.Hour/time.Microsecond))) * time.Microsecond
}

// unpack reads one answer, the 48 bytes of txlimit_pack_v1, numbers in network byte order: flags
// (int4: 1 ok, 2 reserved, 4 busy), level_sum (float8), shard_a, shard_b, charged (int4),
// retry_at_us, now_us, ts_us (int8).
func unpack(a []byte) (answer, error) {
	if len(a) != 48 {
		return answer{}, fmt.Errorf("decision returned %d bytes, want 48", len(a))
	}
	be := binary.BigEndian
	flags := be.Uint32(a[0:])
	return answer{
		seen: true, ok: flags&1 != 0, reserved: flags&2 != 0, busy: flags&4 != 0,
		levelSum: math.Float64frombits(be.Uint64(a[4:])), shardA: int32(be.Uint32(a[12:])),
		shardB: int32(be.Uint32(a[16:])), charged: int32(be.Uint32(a[20:])), retryAtUs: int64(be.Uint64(a[24:])),
		nowUs: int64(be.Uint64(a[32:])), tsUs: int64(be.Uint64(a[40:])),
	}, nil
}

// decideList decides any list: one request per element of each array, its candidate rows given by
// their numbers in the global lock order. A request is marked fast when it is a call of one
// request alone on its row (no other request of the list uses that row), not a Check, and its row
// sorts before every row the other requests may lock: the engine first decides those in one
// UPDATE.
func (l *Limiter) decideList(ctx context.Context, db Executor, calls []*call) ([]answer, error) {
	var p dbsqlc.DecideParams
	var err error
	if p.NowUs, err = l.clock(calls[0].op); err != nil {
		return nil, err
	}
	n := 0
	for _, c := range calls {
		n += len(c.specs)
	}
	p.Grp, p.Count, p.Allow = make([]int32, 0, n), make([]float64, 0, n), make([]float64, 0, n)
	p.Dry, p.Fast, p.StepUs = make([]bool, 0, n), make([]bool, 0, n), make([]int64, 0, n)
	p.Rate, p.PeriodUs, p.Cap = make([]float64, 0, n), make([]int64, 0, n), make([]float64, 0, n)
	p.AnchorUs, p.RowA, p.RowB = make([]int64, 0, n), make([]int32, 0, n), make([]int32, 0, n)
	rows := make(map[rowID]int32, n) // row -> index in rowList, renumbered in global order below
	rowList := make([]rowID, 0, n)
	uses := make([]int32, 0, n) // how many requests use each row
	row := func(id rowID) int32 {
		i, ok := rows[id]
		if !ok {
			i = int32(len(rowList))
			rows[id] = i
			rowList = append(rowList, id)
			uses = append(uses, 0)
		}
		uses[i]++
		return i
	}
	// A call is a group, groups numbered 0, 1, 2, ... in list order.
	g := int32(-1)
	for _, c := range calls {
		if len(c.specs) > 0 {
			g++
		}
		for i := range c.specs {
			s := &c.specs[i]
			cands := l.candidates(c, s, false)
			p.Grp = append(p.Grp, g)
			p.Count = append(p.Count, c.asks[i].count)
			p.Allow = append(p.Allow, c.allow(i))
			p.Dry = append(p.Dry, c.dry)
			p.StepUs = append(p.StepUs, s.stepUs)
			p.Rate = append(p.Rate, s.rate)
			p.PeriodUs = append(p.PeriodUs, s.periodUs)
			p.Cap = append(p.Cap, s.capacity)
			p.AnchorUs = append(p.AnchorUs, s.missingTS(p.NowUs))
			p.RowA = append(p.RowA, row(rowID{s.name, s.key, cands[0]}))
			b := int32(-1)
			if len(cands) > 1 {
				b = row(rowID{s.name, s.key, cands[1]})
			}
			p.RowB = append(p.RowB, b)
			p.Fast = append(p.Fast, len(c.specs) == 1 && !c.dry && len(cands) == 1)
		}
	}
	// Rows are numbered (from 1) in the global lock order; a request stays fast only when it is
	// the one user of its row.
	order := make([]int32, len(rowList))
	for i := range order {
		order[i] = int32(i)
	}
	slices.SortFunc(order, func(a, b int32) int { return compareRows(rowList[a], rowList[b]) })
	number := make([]int32, len(rowList))
	m := len(rowList)
	p.RowName, p.RowKey, p.RowShard = make([]string, 0, m), make([]string, 0, m), make([]int32, 0, m)
	for pos, i := range order {
		number[i] = int32(pos + 1)
		id := rowList[i]
		p.RowName = append(p.RowName, id.name)
		p.RowKey = append(p.RowKey, id.key)
		p.RowShard = append(p.RowShard, id.shard)
	}
	for i, r := range p.RowA {
		p.Fast[i] = p.Fast[i] && uses[r] == 1
		p.RowA[i] = number[r]
		if p.RowB[i] >= 0 {
			p.RowB[i] = number[p.RowB[i]]
		} else {
			p.RowB[i] = 0
		}
	}
	// The engine's one UPDATE of the fast requests' rows locks them before any other row of the
	// list, and a row that sorts before one the call may hold is only tried, never waited for. So
	// a request stays fast only when its row sorts before every row another request may lock (a
	// request that is not fast and not a Check): else that row, held meanwhile by a transaction,
	// would refuse its requests to retry at once where each call alone waits and is granted.
	first := int32(m + 1)
	for i := range p.Fast {
		if !p.Fast[i] && !p.Dry[i] {
			first = min(first, p.RowA[i])
			if p.RowB[i] > 0 {
				first = min(first, p.RowB[i])
			}
		}
	}
	for i := range p.Fast {
		p.Fast[i] = p.Fast[i] && p.RowA[i] < first
	}

	answers, err := via(on(db), ctx, p, (*dbsqlc.Queries).Decide, driver.Executor.Decide)
	if err != nil {
		return nil, err
	}
	// One answer per request, in no particular order: each names its place in the list.
	got := make([]answer, len(p.Grp))
	for _, d := range answers {
		if d.I < 1 || int(d.I) > len(got) || got[d.I-1].seen {
			return nil, fmt.Errorf("decision returned request %d twice or out of range (%d requests)", d.I, len(got))
		}
		if got[d.I-1], err = unpack(d.Answer); err != nil {
			return nil, err
		}
	}
	if len(answers) != len(got) {
		return nil, fmt.Errorf("decision returned %d rows for %d requests", len(answers), len(got))
	}
	return got, nil
}

// outcomes turns the engine's rows (one per request, in list order) into one outcome per call.
func (l *Limiter) outcomes(ctx context.Context, calls []*call, got []answer) []outcome {
	out := make([]outcome, len(calls))
	k := 0
	for g, c := range calls {
		res := ManyResult{OK: true, Results: make([]Result, len(c.specs))}
		var busy *BusyError
		for i, s := range c.specs {
			d := got[k]
			k++
			if d.busy {
				l.obs.busy(ctx, s.name)
				busy = &BusyError{Name: s.name, Key: s.key, Candidates: min(s.shards, maxCandidates), first: d.shardA}
			}
			r := Result{
				Name: s.name, Key: s.key, Config: s.effective(),
				OK: d.ok || d.reserved, Reserved: d.reserved,
				Value: d.levelSum, Time: usTime(d.nowUs),
			}
			// The engine sends 0 for "none", but 0 is also the Unix epoch, an instant an injected
			// clock may reach: a denial and a reservation always carry a RetryAt, a grant that
			// charged one row always its ts.
			if !r.OK || r.Reserved {
				r.RetryAt = usTime(d.retryAtUs)
			}
			if r.OK && (d.charged == 1 || d.charged == 2) {
				r.TS = usTime(d.tsUs)
			}
			if r.OK {
				if d.charged == 1 || d.charged == 3 {
					r.Shards = append(r.Shards, int(d.shardA))
				}
				if d.charged == 2 || d.charged == 3 {
					r.Shards = append(r.Shards, int(d.shardB))
				}
				if len(r.Shards) == 2 && r.Shards[0] > r.Shards[1] {
					r.Shards[0], r.Shards[1] = r.Shards[1], r.Shards[0] // ascending, whichever was picked first
				}
			}
			res.OK = res.OK && r.OK && !d.busy
			res.Results[i] = r
		}
		if busy != nil {
			out[g].err = busy
			continue
		}
		waits := false // whether res.RetryAt is set: a RetryAt can lie before year 1, the zero time.Time
		for i := range res.Results {
			r := &res.Results[i]
			if !res.OK && !c.dry {
				r.Shards, r.TS = nil, time.Time{} // nothing was consumed
			}
			// Granted: act when the last reservation is due. Denied: retry when the last denial clears.
			if (res.OK || !r.OK) && (!r.OK || r.Reserved) && (!waits || r.RetryAt.After(res.RetryAt)) {
				res.RetryAt, waits = r.RetryAt, true
			}
			if i == 0 {
				res.Time = r.Time
			}
		}
		out[g].res = res
	}
	return out
}

// allowance is how far below zero a reservation may take one shard: MaxReserved per shard, or
// +Inf for Unbounded.
func allowance(maxReserved float64, shards int) float64 {
	if math.IsInf(maxReserved, 1) {
		return math.Inf(1)
	}
	return maxReserved / float64(shards)
}
