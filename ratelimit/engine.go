package ratelimit

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/txlimit/txlimit/internal/dbsqlc"
)

// rowID names one row of txlimit_state.
type rowID struct {
	name, key string
	shard     int32
}

func compareRows(a, b rowID) int {
	if c := cmp.Compare(a.name, b.name); c != 0 {
		return c
	}
	if c := cmp.Compare(a.key, b.key); c != 0 {
		return c
	}
	return cmp.Compare(a.shard, b.shard)
}

// decideCalls decides calls in list order, in one statement (one call of the database function
// txlimit_decide; a list of one request is sent as scalars, see decideSingle), and returns one
// outcome per call. Each call is an all-or-nothing group; a call sees the effect of the calls
// granted before it in the list. An error returned alone (a database error) fails every call:
// nothing of the list was granted.
func (l *Limiter) decideCalls(ctx context.Context, db Executor, calls []*call) ([]outcome, error) {
	var got []dbsqlc.DecideRow
	var err error
	if len(calls) == 1 && len(calls[0].specs) == 1 {
		got, err = l.decideSingle(ctx, db, calls[0])
	} else {
		got, err = l.decideList(ctx, db, calls)
	}
	if err != nil {
		return nil, err
	}
	return l.outcomes(ctx, calls, got), nil
}

// The one candidate shard of an unsharded request, and its row number in a list of one request:
// shared by every call, so never modified.
var (
	unshardedRow = []int32{0}
	firstRow     = []int32{1}
)

// candidates returns whether request s of call c steers (a single Limit on a sharded limit) and
// its candidate shards, the two random picks first: every shard in a random order when it steers,
// the two picks when sharded otherwise, shard 0 when unsharded.
func (l *Limiter) candidates(c *call, s *spec) (bool, []int32) {
	steer := c.single && !c.dry && s.shards >= 2
	if s.shards < 2 {
		return false, unshardedRow
	}
	a, b := l.pick(s.shards)
	if steer {
		return true, shardCandidates(s.shards, a, b)
	}
	return false, []int32{int32(a), int32(b)}
}

// allow returns how far below zero request i of call c may take one shard: 0 without Reserve.
func (c *call) allow(i int) float64 {
	if c.reqs[i].Reserve {
		return c.specs[i].maxRes
	}
	return 0
}

// decideSingle decides a list of one request: the same call of txlimit_decide as decideList's,
// its rows (the candidate shards of one name and key) sent as shard numbers.
func (l *Limiter) decideSingle(ctx context.Context, db Executor, c *call) ([]dbsqlc.DecideRow, error) {
	s := &c.specs[0]
	steer, cands := l.candidates(c, s)
	// The rows in lock order: one name and key, so by shard; each candidate's row number from 1.
	rowShard, candRow := unshardedRow, firstRow
	if len(cands) > 1 {
		rowShard = slices.Sorted(slices.Values(cands))
		candRow = make([]int32, len(cands))
		for i, sh := range cands {
			j, _ := slices.BinarySearch(rowShard, sh)
			candRow[i] = int32(j + 1)
		}
	}
	// The advisory locks of the rows derive from it: steering tries those of shards, and a call on
	// an unsharded row held by another transaction may queue on the row's (docs/spec.md §7).
	base := shardLockBase(s.name, s.key)
	d, err := dbsqlc.New().DecideSingle(ctx, db, dbsqlc.DecideSingleParams{
		Now: l.clock(), Count: c.counts[0], Allow: c.allow(0), Dry: c.dry, Steer: steer, Kind: s.kind,
		Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity, AnchorUs: s.anchorUs, LockBase: base,
		CandShard: cands, CandRow: candRow, RowShard: rowShard, Name: s.name, Key: s.key,
	})
	if err != nil {
		return nil, err
	}
	return []dbsqlc.DecideRow{dbsqlc.DecideRow(d)}, nil
}

// decideList decides any list: one request per element of each array, the rows numbered in the
// global lock order.
func (l *Limiter) decideList(ctx context.Context, db Executor, calls []*call) ([]dbsqlc.DecideRow, error) {
	var p dbsqlc.DecideParams
	p.Now = l.clock()
	n := 0
	for _, c := range calls {
		n += len(c.specs)
	}
	p.Grp, p.Count, p.Allow = make([]int32, 0, n), make([]float64, 0, n), make([]float64, 0, n)
	p.Dry, p.Steer, p.Kind = make([]bool, 0, n), make([]bool, 0, n), make([]int16, 0, n)
	p.Rate, p.PeriodUs, p.Cap = make([]float64, 0, n), make([]int64, 0, n), make([]float64, 0, n)
	p.AnchorUs, p.LockBase = make([]int64, 0, n), make([]int64, 0, n)
	p.CandOff, p.CandN = make([]int32, 0, n), make([]int32, 0, n)
	p.CandShard, p.CandRow = make([]int32, 0, n), make([]int32, 0, n)
	rows := make(map[rowID]int32, n) // row -> index in rowList, renumbered in global order below
	rowList := make([]rowID, 0, n)
	bulk := make([]bool, 0, n)
	row := func(id rowID, steer bool) int32 {
		i, ok := rows[id]
		if !ok {
			i = int32(len(rowList))
			rows[id] = i
			rowList = append(rowList, id)
			bulk = append(bulk, false)
		}
		if !steer {
			bulk[i] = true
		}
		return i
	}
	// A call is a group. Groups are numbered 0, 1, 2, ... without gaps, as txlimit_decide requires
	// (it tells a list of lone requests by its last group's number), even were a call empty.
	g := int32(-1)
	for _, c := range calls {
		if len(c.specs) > 0 {
			g++
		}
		for i, s := range c.specs {
			steer, cands := l.candidates(c, &c.specs[i])
			p.Grp = append(p.Grp, g)
			p.Count = append(p.Count, c.counts[i])
			p.Allow = append(p.Allow, c.allow(i))
			p.Dry = append(p.Dry, c.dry)
			p.Steer = append(p.Steer, steer)
			p.Kind = append(p.Kind, s.kind)
			p.Rate = append(p.Rate, s.rate)
			p.PeriodUs = append(p.PeriodUs, s.periodUs)
			p.Cap = append(p.Cap, s.capacity)
			p.AnchorUs = append(p.AnchorUs, s.anchorUs)
			p.LockBase = append(p.LockBase, shardLockBase(s.name, s.key))
			p.CandOff = append(p.CandOff, int32(len(p.CandShard)+1))
			p.CandN = append(p.CandN, int32(len(cands)))
			for _, sh := range cands {
				p.CandShard = append(p.CandShard, sh)
				p.CandRow = append(p.CandRow, row(rowID{s.name, s.key, sh}, steer))
			}
		}
	}
	// Rows are numbered (from 1) in the global lock order: name, key, shard, as bytes.
	order := make([]int32, len(rowList))
	for i := range order {
		order[i] = int32(i)
	}
	slices.SortFunc(order, func(a, b int32) int { return compareRows(rowList[a], rowList[b]) })
	number := make([]int32, len(rowList))
	m := len(rowList)
	p.RowName, p.RowKey = make([]string, 0, m), make([]string, 0, m)
	p.RowShard, p.RowBulk = make([]int32, 0, m), make([]bool, 0, m)
	for pos, i := range order {
		number[i] = int32(pos + 1)
		id := rowList[i]
		p.RowName = append(p.RowName, id.name)
		p.RowKey = append(p.RowKey, id.key)
		p.RowShard = append(p.RowShard, id.shard)
		p.RowBulk = append(p.RowBulk, bulk[i])
	}
	for i, r := range p.CandRow {
		p.CandRow[i] = number[r]
	}

	got, err := dbsqlc.New().Decide(ctx, db, p)
	if err != nil {
		return nil, err
	}
	if len(got) != len(p.Grp) {
		return nil, fmt.Errorf("decision returned %d rows for %d requests", len(got), len(p.Grp))
	}
	return got, nil
}

// outcomes turns the engine's rows (one per request, in list order) into one outcome per call.
func (l *Limiter) outcomes(ctx context.Context, calls []*call, got []dbsqlc.DecideRow) []outcome {
	out := make([]outcome, len(calls))
	k := 0
	for g, c := range calls {
		res := ManyResult{OK: true, Results: make([]Result, len(c.specs))}
		var busy *BusyError
		for i, s := range c.specs {
			d := got[k]
			k++
			if d.Busy {
				l.obs.busy(ctx, s.name)
				busy = &BusyError{Name: s.name, Key: s.key, Candidates: min(s.shards, maxCandidates)}
			}
			r := Result{
				Name: s.name, Key: s.key, Config: s.effective(),
				OK: d.Ok || d.Reserved, Reserved: d.Reserved,
				Value: d.LevelSum, Time: usTime(d.NowUs),
			}
			if d.RetryAtUs != 0 {
				r.RetryAt = usTime(d.RetryAtUs)
			}
			if r.OK {
				if d.Charged == 1 || d.Charged == 3 {
					r.Shards = append(r.Shards, int(d.ShardA))
				}
				if d.Charged == 2 || d.Charged == 3 {
					r.Shards = append(r.Shards, int(d.ShardB))
				}
			}
			res.OK = res.OK && r.OK && !d.Busy
			res.Results[i] = r
		}
		if busy != nil {
			out[g].err = busy
			continue
		}
		for i := range res.Results {
			r := &res.Results[i]
			if !res.OK && !c.dry {
				r.Shards = nil // nothing was consumed
			}
			// Granted: act when the last reservation is due. Denied: retry when the last denial clears.
			if (res.OK || !r.OK) && r.RetryAt.After(res.RetryAt) {
				res.RetryAt = r.RetryAt
			}
			if res.Time.IsZero() {
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
