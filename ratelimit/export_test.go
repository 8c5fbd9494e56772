package ratelimit

import (
	"context"
	"time"
)

// SetShardPicker replaces how l picks the two candidate shards of a sharded limit (n >= 2), so
// tests can choose them. It must return two distinct shards in [0, n).
func SetShardPicker(l *Limiter, pick func(n int) (a, b int)) { l.pick = pick }

// SetAdmissionWait sets how long l's lone calls on a pool wait in the process for a free slot of
// a sharded key (admission.go) before going on without one.
func SetAdmissionWait(l *Limiter, d time.Duration) { l.admission.wait = d }

// Pooled reports whether l's calls on db take admission slots (a pool's).
func Pooled(db Executor) bool { return poolOf(db) != nil }

// Admitted returns how many of l's calls on (name, key), on any pool, hold or wait for an
// admission slot or passed a refusal's opening. The calls of an entry replaced after a change of
// Shards are not counted.
func Admitted(l *Limiter, name, key string) (n int) {
	l.admission.mu.Lock()
	defer l.admission.mu.Unlock()
	for k, e := range l.admission.keys {
		if k.name == name && k.key == key {
			n += e.users
		}
	}
	return n
}

// ListCall is one call of a list decided by DecideList: a group of requests, all or nothing.
type ListCall struct {
	Reqs   []Request
	Dry    bool // Check/CheckMany
	Single bool // a Limit/LimitN/Check/CheckN call (exactly one request)
}

// DecideList decides calls as one list, in one statement, the way the engine decides any list, and
// returns each call's result or error (a validation error leaves the list undecided).
func DecideList(ctx context.Context, l *Limiter, db Executor, calls []ListCall) ([]ManyResult, []error, error) {
	prepared := make([]*call, len(calls))
	for i, c := range calls {
		reqs, op := c.Reqs, "LimitMany"
		if c.Single {
			r := c.Reqs[0]
			if r.Count == 0 {
				r.Count = 1
			}
			reqs, op = []Request{r}, "LimitN"
		}
		var err error
		prepared[i], err = l.prepareCall(op, reqs, c.Single, c.Dry)
		if err != nil {
			return nil, nil, err
		}
	}
	out, err := l.decideCalls(ctx, db, prepared)
	if err != nil {
		return nil, nil, err
	}
	res := make([]ManyResult, len(out))
	errs := make([]error, len(out))
	for i, o := range out {
		res[i], errs[i] = o.res, o.err
	}
	return res, errs, nil
}

// ShardLockBase is the hash of (name, key) from which the decision function derives the advisory
// lock of each of the limit's rows (see the package doc, "Shards"), so tests can find it in pg_locks.
func ShardLockBase(name, key string) int64 { return shardLockBase(name, key) }

// The bounds on arguments, for tests.
const (
	MaxAmount  = maxAmount
	MinAmount  = minAmount
	MaxNameLen = maxNameLen
	MaxShards  = maxShards
	MaxPeriod  = maxPeriod

	// MaxRetryWaitMicros bounds every wait a decision reports, in microseconds (Result.RetryAt):
	// txlimit_retry_at's bound, which no Go code applies.
	MaxRetryWaitMicros = 1 << 61
)

// QueueKey is the key of the advisory lock that a lone Limit on an unsharded (name, key) queues on
// in DecideOneRow (before the XOR with the table's OID shifted left 20 bits, done in SQL).
func QueueKey(name, key string) int64 { return shardLockBase(name, key) ^ queueBit }
