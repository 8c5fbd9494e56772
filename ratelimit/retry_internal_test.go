package ratelimit

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

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
