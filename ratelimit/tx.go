package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/internal/nilarg"
)

// TxBeginner starts transactions: a *pgxpool.Pool or *pgx.Conn.
type TxBeginner interface {
	BeginTx(ctx context.Context, txOptions pgx.TxOptions) (pgx.Tx, error)
}

// TxOpts are the options of InSerializableTx, and of a Batcher's retries (BatcherConfig.Retry). A
// nil *TxOpts is the zero value.
type TxOpts struct {
	// Limiter, when set, counts the retries in its metrics (txlimit.tx.retries) and logs them and a
	// give-up through its Logger. Defaults to nil: not counted, not logged.
	Limiter *Limiter
	// MaxAttempts is how many failed attempts make InSerializableTx give up: fn runs at most
	// MaxAttempts times, plus once more after each wait for a busy shard, which costs no attempt
	// (at most 100 such reruns; see InSerializableTx). Defaults to 10; negative is an
	// *ArgumentError, as for the two fields below.
	MaxAttempts int
	// MinBackoff is the backoff ceiling after the first failure; it doubles after each further
	// failure up to MaxBackoff, and the actual sleep is drawn uniformly from [0, ceiling]
	// ("full jitter"). Defaults to 2ms.
	MinBackoff time.Duration
	// MaxBackoff caps the backoff ceiling, the first one included: a MaxBackoff below MinBackoff
	// makes every ceiling MaxBackoff. Defaults to 200ms, or to MinBackoff when that is larger.
	MaxBackoff time.Duration
}

// InSerializableTx runs fn in a SERIALIZABLE transaction and commits it. When fn or the commit
// fails with a serialization failure (40001) or deadlock (40P01), it rolls back, sleeps a jittered,
// bounded backoff and runs fn again in a new transaction. fn must therefore be safe to repeat and
// do all its database work through tx. Any other error is returned at once. When attempts run out
// it returns a *RetriesExhaustedError wrapping the last cause. A nil db or fn, or a negative field
// of opts, is an *ArgumentError, returned before any transaction is begun.
//
// A *BusyError (every candidate shard of a sharded limit taken by other transactions) is not a
// failed attempt: when db can run a statement of its own (a *pgxpool.Pool or *pgx.Conn), the
// retry waits, outside any transaction, until one of those transactions ends, then runs fn again
// at once; it costs no attempt, up to 100 such waits (then it counts as a failure like any other).
//
// On a *pgxpool.Pool, the context fn is given carries the transaction's admission: a Limiter's
// lone calls on a sharded key, made with that context on tx, are admitted as its calls on the pool
// are, and keep their slot until the transaction ends, so that the callers of a hot key beyond its
// shards wait in this process rather than become busy attempts (the package documentation,
// "Shards").
func InSerializableTx(ctx context.Context, db TxBeginner, opts *TxOpts, fn func(ctx context.Context, tx pgx.Tx) error) error {
	const op = "InSerializableTx"
	if r := nilarg.Reason(db); r != "" {
		return &ArgumentError{Op: op, Arg: "db", Reason: r + ": pass a *pgxpool.Pool or *pgx.Conn"}
	}
	if fn == nil {
		return &ArgumentError{Op: op, Arg: "fn", Reason: "is nil: pass the function to run in the transaction"}
	}
	o := retryDefaults(TxOpts{})
	var obs *observer
	if opts != nil {
		if r := opts.negative(""); r != "" {
			return &ArgumentError{Op: op, Arg: "opts", Reason: r}
		}
		o = retryDefaults(*opts)
		if opts.Limiter != nil {
			obs = opts.Limiter.obs
		}
	}
	waiter, _ := db.(dbsqlc.DBTX) // a pool or a connection: a pgx handle that runs a statement of its own
	return retrying(ctx, o, obs, txWhat, func() error { return runTx(ctx, db, fn) }, waiter)
}

// negative names the first field of o that is negative (prefix before its name), "" when none is.
func (o TxOpts) negative(prefix string) string {
	switch {
	case o.MaxAttempts < 0:
		return fmt.Sprintf("%sMaxAttempts must be >= 0, 0 meaning the default (got %d)", prefix, o.MaxAttempts)
	case o.MinBackoff < 0:
		return fmt.Sprintf("%sMinBackoff must be >= 0, 0 meaning the default (got %v)", prefix, o.MinBackoff)
	case o.MaxBackoff < 0:
		return fmt.Sprintf("%sMaxBackoff must be >= 0, 0 meaning the default (got %v)", prefix, o.MaxBackoff)
	}
	return ""
}

// retryDefaults applies TxOpts' defaults to o.
func retryDefaults(o TxOpts) TxOpts {
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = 10
	}
	if o.MinBackoff <= 0 {
		o.MinBackoff = 2 * time.Millisecond
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = max(200*time.Millisecond, o.MinBackoff)
	}
	// The sleep is drawn from [0, ceiling], so the ceiling stays below math.MaxInt64.
	o.MaxBackoff = min(o.MaxBackoff, math.MaxInt64-1)
	return o
}

// nextCeiling is the backoff ceiling after ceiling: doubled, at most maxBackoff, never overflowing.
func nextCeiling(ceiling, maxBackoff time.Duration) time.Duration {
	if ceiling > maxBackoff/2 {
		return maxBackoff
	}
	return 2 * ceiling
}

// retrying is the retry loop of InSerializableTx and of the Batcher's batches. It runs try until
// it returns nil or an error that IsRetryable does not accept, at most o.MaxAttempts times,
// sleeping a full-jitter backoff between attempts (the ceiling starts at o.MinBackoff, at most
// o.MaxBackoff, and doubles up to o.MaxBackoff); when attempts run out it returns a
// *RetriesExhaustedError naming what gave up. A *BusyError is not a failed attempt when waiter is set: it waits there, outside any
// transaction, for the first shard the busy call tried, and tries again at once, up to
// maxBusyWaits times. obs, when set, counts and logs the retries and the give-up.
func retrying(ctx context.Context, o TxOpts, obs *observer, what string, try func() error, waiter dbsqlc.DBTX) error {
	ceiling := min(o.MinBackoff, o.MaxBackoff)
	var last error
	waits, runs := 0, 0
	for attempt := 1; attempt <= o.MaxAttempts; attempt++ {
		runs++
		last = try()
		if last == nil || !IsRetryable(last) {
			return last
		}
		var busy *BusyError
		if waiter != nil && waits < maxBusyWaits && errors.As(last, &busy) {
			waits++
			attempt--
			if err := queries.WaitForShard(ctx, waiter, dbsqlc.WaitForShardParams{
				LockKey: shardLockBase(busy.Name, busy.Key), Shard: int64(busy.first),
			}); err != nil {
				return errors.Join(err, last)
			}
			obs.retry(ctx, what, attempt+1, last) // a rerun, though it costs no attempt
			continue
		}
		if attempt == o.MaxAttempts {
			break
		}
		obs.retry(ctx, what, attempt, last)
		t := time.NewTimer(rand.N(ceiling + 1))
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(ctx.Err(), last)
		case <-t.C:
		}
		ceiling = nextCeiling(ceiling, o.MaxBackoff)
	}
	obs.exhausted(ctx, what, runs, last)
	return &RetriesExhaustedError{Attempts: runs, Err: last, what: what}
}

// txWhat is what InSerializableTx's retry loop retries (RetriesExhaustedError and the logs name it).
const txWhat = "serializable transaction"

// maxBusyWaits bounds how many times InSerializableTx waits for a shard after a *BusyError without
// counting the attempt.
const maxBusyWaits = 100

func runTx(ctx context.Context, db TxBeginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return err
	}
	ctx, ta := withTxAdmission(ctx, db, tx)
	if ta != nil {
		// The slots of the transaction's calls on sharded keys are given back once it has ended.
		defer ta.leave()
	}
	// Rolls back when fn fails or panics (the panic goes on, the connection is not left in a
	// transaction); after a commit it does nothing.
	defer func() { _ = tx.Rollback(ctx) }()
	if err := fn(ctx, tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}
