package ratelimit

// White-box tests of the package's internals that need no database: the driver boundary, the
// shard candidates and lock base, and the retry loop.

import (
	"context"
	"errors"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// fakePgx has the methods of a pgx handle and runs nothing.
type fakePgx struct{}

func (*fakePgx) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, nil
}
func (*fakePgx) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, nil }
func (*fakePgx) QueryRow(context.Context, string, ...any) pgx.Row        { return nil }

// TestDriverBoundaryAllocatesNothing: resolving a pgx handle to its statements, as every call does,
// allocates nothing (the pgx driver is held by value, not behind an interface).
func TestDriverBoundaryAllocatesNothing(t *testing.T) {
	var db Executor = &fakePgx{}
	allocs := testing.AllocsPerRun(100, func() {
		s := on(db)
		if s.other != nil {
			t.Fatal("a pgx handle resolved to another driver")
		}
	})
	if allocs != 0 {
		t.Fatalf("got %v allocations per resolution; want 0", allocs)
	}
}

// The candidate list starts with the two picks, holds distinct shards in [0, n), and covers every
// shard when there are at most maxCandidates of them.
func TestShardCandidates(t *testing.T) {
	for _, n := range []int{2, 3, 16, 17, 1024} {
		for range 200 {
			a, b := pickTwo(n)
			c := shardCandidates(n, a, b)
			if want := min(n, maxCandidates); len(c) != want {
				t.Fatalf("n=%d: %d candidates, want %d", n, len(c), want)
			}
			if int(c[0]) != a || int(c[1]) != b {
				t.Fatalf("n=%d: candidates %v do not start with the picks %d, %d", n, c, a, b)
			}
			s := slices.Clone(c)
			slices.Sort(s)
			if len(slices.Compact(s)) != len(c) || s[0] < 0 || int(s[len(s)-1]) >= n {
				t.Fatalf("n=%d: candidates %v are not distinct shards in [0, %d)", n, c, n)
			}
		}
	}
}

// The advisory lock base depends on both name and key, with the NUL separator keeping ("ab", "c")
// and ("a", "bc") apart, and is the same in every process (a fixed FNV-1a value, not a seeded hash).
func TestShardLockBase(t *testing.T) {
	if shardLockBase("ab", "c") == shardLockBase("a", "bc") {
		t.Fatal("name/key boundary is not part of the hash")
	}
	if got, want := shardLockBase("a", "k"), int64(-4701120880994912986); got != want {
		t.Fatalf("shardLockBase(%q, %q) = %d, want %d (FNV-1a of \"txlimit\\x00a\\x00k\")", "a", "k", got, want)
	}
}

// The one retry loop (InSerializableTx and the Batcher's batches): a serialization failure or
// deadlock runs the attempt again, at most MaxAttempts times, then gives up with a
// *RetriesExhaustedError naming what gave up and wrapping the last cause; any other error, or
// success, ends it at once.
func TestRetrying(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := retryDefaults(TxOpts{MaxAttempts: 3, MinBackoff: time.Microsecond, MaxBackoff: time.Microsecond})
	serialization := &pgconn.PgError{Severity: "ERROR", Code: "40001", Message: "could not serialize access"}
	other := errors.New("other")
	for i, c := range []struct {
		errs     []error // what each attempt returns; the last repeats
		attempts int
		want     error
	}{
		{errs: []error{nil}, attempts: 1},
		{errs: []error{serialization, &pgconn.PgError{Code: "40P01"}, nil}, attempts: 3},
		{errs: []error{other}, attempts: 1, want: other},
		{errs: []error{serialization, other}, attempts: 2, want: other},
		{errs: []error{serialization}, attempts: 3, want: serialization},
	} {
		n := 0
		err := retrying(ctx, o, nil, "batch of 2 calls", func() error {
			n++
			return c.errs[min(n, len(c.errs))-1]
		}, nil)
		if n != c.attempts {
			t.Errorf("case %d: %d attempts, want %d", i, n, c.attempts)
		}
		if !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
			t.Errorf("case %d: got %v, want %v", i, err, c.want)
		}
		var ex *RetriesExhaustedError
		if exhausted := errors.As(err, &ex); exhausted != (c.want == serialization) {
			t.Errorf("case %d: %v is a *RetriesExhaustedError: %t", i, err, exhausted)
		} else if exhausted {
			if want := "ratelimit: batch of 2 calls gave up after 3 attempts: ERROR: could not serialize access (SQLSTATE 40001)"; ex.Error() != want || ex.Attempts != 3 {
				t.Errorf("case %d: %q after %d attempts, want %q after 3", i, ex.Error(), ex.Attempts, want)
			}
		}
	}
}

// TxOpts.MaxBackoff caps the backoff ceiling, the first one (MinBackoff) included: a MinBackoff of
// an hour under a MaxBackoff of a millisecond sleeps at most a millisecond between attempts.
// (Before, the first sleep was drawn from [0, MinBackoff], here up to an hour.)
func TestRetryingMaxBackoffCapsTheFirstSleep(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	o := retryDefaults(TxOpts{MaxAttempts: 3, MinBackoff: time.Hour, MaxBackoff: time.Millisecond})
	conflict := &pgconn.PgError{Code: "40001"}
	n := 0
	err := retrying(ctx, o, nil, "serializable transaction", func() error { n++; return conflict }, nil)
	var ex *RetriesExhaustedError
	if !errors.As(err, &ex) || n != 3 {
		t.Fatalf("got %v after %d attempts; want a *RetriesExhaustedError after 3 (each sleep at most MaxBackoff)", err, n)
	}
}

// A MinBackoff above MaxBackoff's default raises that default to MinBackoff rather than being cut
// to 200ms; the largest durations neither panic nor overflow the ceiling (before, a MinBackoff of
// math.MaxInt64 made rand.N panic on the first retry).
func TestRetryingHugeBackoff(t *testing.T) {
	t.Parallel()
	if o := retryDefaults(TxOpts{MinBackoff: time.Second}); o.MaxBackoff != time.Second {
		t.Errorf("MinBackoff 1s alone: MaxBackoff %v, want 1s", o.MaxBackoff)
	}
	if o := retryDefaults(TxOpts{}); o.MinBackoff != 2*time.Millisecond || o.MaxBackoff != 200*time.Millisecond || o.MaxAttempts != 10 {
		t.Errorf("defaults: %+v", o)
	}
	conflict := &pgconn.PgError{Code: "40001"}
	for _, o := range []TxOpts{
		{MaxAttempts: 2, MinBackoff: math.MaxInt64},
		{MaxAttempts: 2, MinBackoff: math.MaxInt64, MaxBackoff: math.MaxInt64},
		{MaxAttempts: 2, MinBackoff: math.MaxInt64 / 2, MaxBackoff: math.MaxInt64},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Errorf("%+v: panicked: %v", o, p)
				}
			}()
			err := retrying(ctx, retryDefaults(o), nil, "serializable transaction", func() error { return conflict }, nil)
			if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, conflict) {
				t.Errorf("%+v: got %v, want the context's error joined with the conflict", o, err)
			}
		}()
		cancel()
	}
	// The ceiling saturates instead of doubling past math.MaxInt64.
	c := time.Duration(math.MaxInt64/2 + 1)
	if got := nextCeiling(c, math.MaxInt64); got != math.MaxInt64 {
		t.Errorf("nextCeiling(%v) = %v, want math.MaxInt64", c, got)
	}
}
