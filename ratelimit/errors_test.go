package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// TestErrorsNameTheCall: an error names the call the user made, not the call it is shorthand for
// (issue 31: Limit reported "ratelimit: LimitN:"). Each call gets a key with a NUL byte, refused
// before any SQL runs.
func TestErrorsNameTheCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, nil)
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"a": {Rate: 10, Period: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	const bad = "k\x00"
	many := []ratelimit.Request{{Name: "a", Key: bad}}
	steps := []struct {
		call string
		err  error
	}{
		{"Limit", second(lim.Limit(ctx, pool, "a", bad, nil))},
		{"LimitN", second(lim.LimitN(ctx, pool, "a", bad, 1, nil))},
		{"Check", second(lim.Check(ctx, pool, "a", bad, nil))},
		{"CheckN", second(lim.CheckN(ctx, pool, "a", bad, 1, nil))},
		{"LimitMany", second(lim.LimitMany(ctx, pool, many, nil))},
		{"CheckMany", second(lim.CheckMany(ctx, pool, many, nil))},
		{"Credit", second(lim.Credit(ctx, pool, "a", bad, 1, nil))},
		{"State", second(lim.State(ctx, pool, "a", bad, nil))},
		{"Reset", lim.Reset(ctx, pool, "a", bad)},
		{"Lookup", second(lim.Lookup("a", bad, nil))},
	}
	for i, s := range steps {
		want := "ratelimit: " + s.call + ": key contains a NUL byte, which Postgres text cannot hold"
		if s.err == nil || s.err.Error() != want {
			t.Errorf("step %d %s: got %v, want %s", i, s.call, s.err, want)
		}
	}
	if n := testdb.CountRows(t, pool); n != 0 {
		t.Errorf("the refused calls wrote %d rows", n)
	}
}

func second[T any](_ T, err error) error { return err }
