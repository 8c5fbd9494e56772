package ratelimit

import (
	"context"
	"math"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/driver"
)

// PruneOpts are the options of Prune. A nil *PruneOpts is the zero value.
type PruneOpts struct {
	// BatchSize is how many rows each round of Prune reads and deletes. Defaults to 1000; a size
	// above math.MaxInt32 is taken as math.MaxInt32 (what the statement's LIMIT can carry).
	BatchSize int

	// Config, when set, is used instead of the limit registered under the name. Defaults to nil.
	Config *Config
}

// Prune deletes the rows of limit name that are provably equivalent to missing rows, so that a
// table of per-user limits does not grow with every user ever seen. A row goes only if, at the
// clock, it holds its full (per-shard) capacity and, for a fixed window, lies on its key's window
// grid: then every later decision whose clock reading is at or after Prune's evaluates it exactly as
// a missing row, so pruning never changes such a decision (docs/spec.md §10 says why a reading
// before the row's ts can tell the two apart, and why one before Prune's takes no more than the
// row held). Rows charged meanwhile are re-checked and kept. Rows
// of shards beyond Config.Shards are left to Reset. It returns how many rows were deleted.
//
// Prune works in rounds of two statements (list, delete) over BatchSize rows in key order; run it
// from a periodic job, on a pool rather than inside a long transaction, and not in a SERIALIZABLE
// transaction: its statements may scan the table, which there takes a relation-level predicate
// lock that conflicts with every other writer of the table.
func (l *Limiter) Prune(ctx context.Context, db Executor, name string, opts *PruneOpts) (int64, error) {
	const op = "Prune"
	if opts == nil {
		opts = &PruneOpts{}
	}
	batch := opts.BatchSize
	if batch <= 0 {
		batch = 1000
	}
	batch = min(batch, math.MaxInt32) // Batch is an int32 parameter
	s, err := l.prepare(op, db, name, "", &LimitOpts{Config: opts.Config})
	if err != nil {
		return 0, err
	}
	q := on(db)
	var (
		deleted    int64
		afterKey   string
		afterShard int32 = -1
	)
	for {
		now, err := l.clock(op)
		if err != nil {
			return deleted, err
		}
		rows, err := via(q, ctx, dbsqlc.PruneCandidatesParams{
			NowUs: now, Name: name, AfterKey: afterKey, AfterShard: afterShard, Shards: int32(s.shards),
			StepUs: s.stepUs, Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity, Batch: int32(batch),
		}, (*dbsqlc.Queries).PruneCandidates, driver.Executor.PruneCandidates)
		if err != nil {
			return deleted, dbError(ctx, db, op, err)
		}
		if len(rows) == 0 {
			return deleted, nil
		}
		// The rows are deleted where txlimit_prunable holds: full at the clock the list was read at
		// and on the key's grid of steps, which starts at the key's anchor (as in every decision).
		del := dbsqlc.PruneDeleteParams{
			NowUs: rows[0].NowUs, Name: name, StepUs: s.stepUs, Rate: s.rate, PeriodUs: s.periodUs, Cap: s.capacity,
		}
		for _, r := range rows {
			del.Keys = append(del.Keys, r.Key)
			del.ShardList = append(del.ShardList, r.Shard)
			del.Anchors = append(del.Anchors, newSpec(name, r.Key, s.cfg).anchorUs)
		}
		if len(del.Keys) > 0 {
			n, err := via(q, ctx, del, (*dbsqlc.Queries).PruneDelete, driver.Executor.PruneDelete)
			if err != nil {
				return deleted, dbError(ctx, db, op, err)
			}
			deleted += n
		}
		last := rows[len(rows)-1]
		afterKey, afterShard = last.Key, last.Shard
		if len(rows) < batch {
			return deleted, nil
		}
	}
}
