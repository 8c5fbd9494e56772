package ratelimit

import (
	"context"
	"fmt"
	"sort"
)

// PruneAll runs Prune on every limit registered in LimiterConfig.Limits, one after the other in
// name order, and returns how many rows it deleted per limit (every registered name is present,
// with 0 when nothing went). Like Prune it never changes a later decision. Limits used only with
// an inline Config are not registered, so PruneAll cannot know them: call Prune for those.
//
// opts.BatchSize applies to each limit; opts.Config must be nil (an *ArgumentError otherwise,
// before anything is deleted). On an error (a database error, a cancelled context) it stops and
// returns the counts so far with the error, which names the limit. Rows already deleted stay
// deleted: each round of Prune is its own statement unless db is a transaction.
func (l *Limiter) PruneAll(ctx context.Context, db Executor, opts *PruneOpts) (map[string]int64, error) {
	const op = "PruneAll"
	if err := checkExecutor(op, db); err != nil {
		return nil, err
	}
	var batch int
	if opts != nil {
		if opts.Config != nil {
			return nil, &ArgumentError{Op: op, Arg: "opts.Config", Reason: "must be nil: PruneAll prunes each registered limit with its own config (use Prune for one limit)"}
		}
		batch = opts.BatchSize
	}
	names := make([]string, 0, len(l.limits))
	for name := range l.limits {
		names = append(names, name)
	}
	sort.Strings(names)
	deleted := make(map[string]int64, len(names))
	for _, name := range names {
		n, err := l.Prune(ctx, db, name, &PruneOpts{BatchSize: batch})
		deleted[name] = n
		if err != nil {
			return deleted, fmt.Errorf("ratelimit: %s: limit %q: %w", op, name, err)
		}
	}
	return deleted, nil
}
