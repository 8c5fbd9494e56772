package scheduler

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/txlimit/txlimit/ratelimit"
)

// Settlement is what a job needs to settle its reservation once the real cost is known: put it in
// the job's args (it marshals to {"name", "key", "reserved"}), with the values passed to
// ReserveTx, and call Settle from the worker.
//
//	type CompletionArgs struct {
//		Prompt string               `json:"prompt"`
//		Budget scheduler.Settlement `json:"budget"`
//	}
type Settlement struct {
	// Name is the limit's name.
	Name string `json:"name"`
	// Key is the limit's key. Defaults to "", the global instance.
	Key string `json:"key,omitempty"`
	// Reserved is the count of tokens reserved.
	Reserved float64 `json:"reserved"`
}

// SettleOpts are the options of Settle. A nil *SettleOpts is the zero value.
type SettleOpts struct {
	// Config, when set, is used instead of the limit registered under the name, as
	// ratelimit.LimitOpts.Config; pass the same one as to ReserveTx. Defaults to nil: the
	// registered config.
	Config *ratelimit.Config
}

// SettleResult is the outcome of Settle.
type SettleResult struct {
	// Charged is the overrun charged: Actual - Reserved when positive, else 0.
	Charged float64
	// Credited is the tokens given back: Reserved - Actual when positive, less where the limit was
	// too full to take them all (it never goes above capacity), else 0.
	Credited float64
}

// Settle makes the limit reflect actual, the real cost of the work that reserved s.Reserved
// tokens. When actual is less, the difference is credited back (ratelimit.Limiter.Credit). When it
// is more, the overrun is charged as a reservation (LimitN with Reserve) that is never denied: the
// work has been done, so its cost is booked even past MaxReserved, and later reservations wait for
// it to be repaid. Equal costs write nothing. actual must be finite and >= 0.
//
// Settle once per job: do it in the transaction that completes the job (river.JobCompleteTx) so
// that a retry of the job cannot settle twice.
func (s Settlement) Settle(ctx context.Context, db ratelimit.Executor, l *ratelimit.Limiter, actual float64, opts *SettleOpts) (SettleResult, error) {
	const op = "Settle"
	if l == nil {
		return SettleResult{}, &ratelimit.ArgumentError{Op: op, Arg: "limiter", Reason: "is nil"}
	}
	if math.IsNaN(actual) || math.IsInf(actual, 0) || actual < 0 {
		return SettleResult{}, &ratelimit.ArgumentError{Op: op, Arg: "actual", Reason: fmt.Sprintf("must be finite and >= 0, got %g", actual)}
	}
	if math.IsNaN(s.Reserved) || math.IsInf(s.Reserved, 0) || s.Reserved < 0 {
		return SettleResult{}, &ratelimit.ArgumentError{Op: op, Arg: "Settlement.Reserved", Reason: fmt.Sprintf("must be finite and >= 0, got %g", s.Reserved)}
	}
	if opts == nil {
		opts = &SettleOpts{}
	}
	if db == nil {
		return SettleResult{}, &ratelimit.ArgumentError{Op: op, Arg: "db", Reason: "is nil: pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn"}
	}
	// Refuse a bad name, key or config even when there is nothing to settle.
	cfg, err := l.Lookup(s.Name, s.Key, opts.Config)
	if err != nil {
		return SettleResult{}, fmt.Errorf("scheduler: %s: %w", op, err)
	}
	switch diff := actual - s.Reserved; {
	case diff < 0:
		res, err := l.Credit(ctx, db, s.Name, s.Key, -diff, &ratelimit.KeyOpts{Config: opts.Config})
		if err != nil {
			return SettleResult{}, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		return SettleResult{Credited: res.Credited}, nil
	case diff > 0:
		if err := charge(ctx, db, l, s.Name, s.Key, diff, cfg); err != nil {
			return SettleResult{}, fmt.Errorf("scheduler: %s: %w", op, err)
		}
		return SettleResult{Charged: diff}, nil
	}
	return SettleResult{}, nil
}

// charge books count tokens of (name, key), whose config is cfg, as a reservation that
// MaxReserved cannot deny. It tries the config as it is first (one round trip); only when that is
// denied, or count exceeds what it could ever grant, does it charge again with MaxReserved lifted.
func charge(ctx context.Context, db ratelimit.Executor, l *ratelimit.Limiter, name, key string, count float64, cfg ratelimit.Config) error {
	res, err := l.LimitN(ctx, db, name, key, count, &ratelimit.LimitOpts{Config: &cfg, Reserve: true})
	switch {
	case err == nil && res.OK:
		return nil
	case err != nil && !errors.Is(err, ratelimit.ErrInvalid):
		return err
	}
	unbounded := cfg
	unbounded.MaxReserved = ratelimit.Unbounded
	res, err = l.LimitN(ctx, db, name, key, count, &ratelimit.LimitOpts{Config: &unbounded, Reserve: true})
	if err == nil && !res.OK {
		err = fmt.Errorf("overrun of %g tokens of %q key %q was denied without a MaxReserved", count, name, key)
	}
	return err
}
