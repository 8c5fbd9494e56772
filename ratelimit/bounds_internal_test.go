package ratelimit

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// TxOpts' backoffs are bounded for every value (docs/spec.md §7, "Retries"): MaxBackoff caps the
// ceiling from the first failure on, even when MinBackoff is larger, and no duration, however
// large, panics or overflows the doubling. A MinBackoff of math.MaxInt64 made rand.N(ceiling+1)
// panic on the first retry (in a Batcher's lane goroutine, the whole process), and a MinBackoff
// above MaxBackoff slept up to MinBackoff.
func TestRetryingExtremeBackoffs(t *testing.T) {
	t.Parallel()
	serialization := &pgconn.PgError{Severity: "ERROR", Code: "40001", Message: "could not serialize access"}
	for _, c := range []struct {
		what string
		o    TxOpts
	}{
		{"MinBackoff MaxInt64", TxOpts{MinBackoff: math.MaxInt64}},
		{"MinBackoff MaxInt64, MaxBackoff 1ms", TxOpts{MinBackoff: math.MaxInt64, MaxBackoff: time.Millisecond}},
		{"MinBackoff above MaxBackoff", TxOpts{MinBackoff: time.Hour, MaxBackoff: time.Millisecond}},
		{"MaxBackoff MaxInt64", TxOpts{MinBackoff: time.Nanosecond, MaxBackoff: math.MaxInt64, MaxAttempts: 4}},
	} {
		t.Run(c.what, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			n := 0
			start := time.Now()
			err := func() (err error) {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("panicked: %v", r)
					}
				}()
				return retrying(ctx, retryDefaults(c.o), nil, "serializable transaction", func() error {
					if n++; n < 3 {
						return serialization
					}
					return nil
				}, nil)
			}()
			if err != nil || n != 3 {
				t.Fatalf("after %d attempts and %s: %v, want success at the third", n, time.Since(start), err)
			}
		})
	}
}
