package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txlimit/txlimit/internal/dbsqlc"
)

// TxBeginner starts transactions: a *pgxpool.Pool or *pgx.Conn.
type TxBeginner interface {
	BeginTx(ctx context.Context, txOptions pgx.TxOptions) (pgx.Tx, error)
}

// TxOpts are the options of InSerializableTx. A nil *TxOpts is the zero value.
type TxOpts struct {
	// Limiter, when set, counts the retries in its metrics (MetricTxRetries) and logs them and a
	// give-up through its Logger. Defaults to nil: not counted, not logged.
	Limiter *Limiter
	// MaxAttempts is how many times fn may run. Defaults to 10.
	MaxAttempts int
	// MinBackoff is the backoff ceiling after the first failure; it doubles after each further
	// failure up to MaxBackoff, and the actual sleep is drawn uniformly from [0, ceiling]
	// ("full jitter"). Defaults to 2ms.
	MinBackoff time.Duration
	// MaxBackoff caps the backoff ceiling. Defaults to 200ms.
	MaxBackoff time.Duration
}

// InSerializableTx runs fn in a SERIALIZABLE transaction and commits it. When fn or the commit
// fails with a serialization failure (40001) or deadlock (40P01), it rolls back, sleeps a jittered,
// bounded backoff and runs fn again in a new transaction. fn must therefore be safe to repeat and
// do all its database work through tx. Any other error is returned at once. When attempts run out
// it returns a *RetriesExhaustedError wrapping the last cause. A nil db or fn is an *ArgumentError,
// returned before any transaction is begun.
//
// A *BusyError (every candidate shard of a sharded limit taken by other transactions) is not a
// failed attempt: when db can run a statement of its own (a *pgxpool.Pool or *pgx.Conn), the
// retry waits, outside any transaction, until one of those transactions ends, then runs fn again
// at once; it costs no attempt, up to 100 such waits (then it counts as a failure like any other).
func InSerializableTx(ctx context.Context, db TxBeginner, opts *TxOpts, fn func(ctx context.Context, tx pgx.Tx) error) error {
	const op = "InSerializableTx"
	if db == nil {
		return &ArgumentError{Op: op, Arg: "db", Reason: "is nil: pass a *pgxpool.Pool or *pgx.Conn"}
	}
	if v := reflect.ValueOf(db); v.Kind() == reflect.Pointer && v.IsNil() {
		return &ArgumentError{Op: op, Arg: "db", Reason: fmt.Sprintf("is a nil %T: pass a *pgxpool.Pool or *pgx.Conn", db)}
	}
	if fn == nil {
		return &ArgumentError{Op: op, Arg: "fn", Reason: "is nil: pass the function to run in the transaction"}
	}
	o := TxOpts{MaxAttempts: 10, MinBackoff: 2 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}
	var obs *observer
	if opts != nil && opts.Limiter != nil {
		obs = opts.Limiter.obs
	}
	if opts != nil {
		if opts.MaxAttempts > 0 {
			o.MaxAttempts = opts.MaxAttempts
		}
		if opts.MinBackoff > 0 {
			o.MinBackoff = opts.MinBackoff
		}
		if opts.MaxBackoff > 0 {
			o.MaxBackoff = opts.MaxBackoff
		}
	}
	ceiling := o.MinBackoff
	var last error
	waits := 0
	for attempt := 1; attempt <= o.MaxAttempts; attempt++ {
		last = runTx(ctx, db, fn)
		if last == nil || !IsRetryable(last) {
			return last
		}
		var busy *BusyError
		if waiter, ok := db.(dbsqlc.DBTX); ok && waits < maxBusyWaits && errors.As(last, &busy) {
			waits++
			attempt--
			if err := dbsqlc.New().WaitForShard(ctx, waiter, dbsqlc.WaitForShardParams{
				LockKey: shardLockBase(busy.Name, busy.Key), Shard: int64(busy.first),
			}); err != nil {
				return errors.Join(err, last)
			}
			continue
		}
		if attempt == o.MaxAttempts {
			break
		}
		obs.retry(ctx, attempt, last)
		t := time.NewTimer(rand.N(ceiling + 1))
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(ctx.Err(), last)
		case <-t.C:
		}
		ceiling = min(2*ceiling, o.MaxBackoff)
	}
	obs.exhausted(ctx, o.MaxAttempts, last)
	return &RetriesExhaustedError{Attempts: o.MaxAttempts, Err: last}
}

// maxBusyWaits bounds how many times InSerializableTx waits for a shard after a *BusyError without
// counting the attempt.
const maxBusyWaits = 100

func runTx(ctx context.Context, db TxBeginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		return err
	}
	// Rolls back when fn fails or panics (the panic goes on, the connection is not left in a
	// transaction); after a commit it does nothing.
	defer func() { _ = tx.Rollback(ctx) }()
	if err := fn(ctx, tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}
