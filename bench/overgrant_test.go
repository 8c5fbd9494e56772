package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"
)

// TestOverGrant runs the over-grant test (docs/spec.md §7) briefly against every txlimit contender: burst 10,
// rate 10/s, 64 goroutines on one key. It fails if any grants more than a bucket that starts full
// could: 10 + 10·span, span being the first to the last decision on Postgres's clock.
func TestOverGrant(t *testing.T) {
	const window = 2 * time.Second
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	env, closeEnv, err := OpenEnv(ctx, EnvOpts{Schema: "txlimit_bench_test_" + hex.EncodeToString(b[:]), NoRedis: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeEnv)

	ran := 0
	for _, def := range Defs() {
		if def.Family != FamilyTxlimit || def.SweepOnly { // the sweep's 64 shards cannot hold the over-grant test's count
			continue
		}
		ran++
		t.Run(def.ID, func(t *testing.T) {
			c, err := def.New(ctx, env)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			o := RunOverGrant(ctx, c, def, limitOverGrant, "overgrant-test/"+def.ID, overGrantCallers, window)
			t.Logf("decisions %d allowed %d max %d (nominal %d, span %s) retries %d errors %d abandoned %d",
				o.Decisions, o.Allowed, o.Max, o.Nominal, o.Span, o.Retries, o.Errors, o.Abandoned)
			if o.Allowed == 0 {
				t.Fatalf("nothing was allowed in %s (errors: %d, first: %v)", window, o.Errors, o.FirstErr)
			}
			if o.Allowed > o.Max {
				t.Errorf("over-grant: allowed %d, at most %d could be (burst 10 + 10/s over %s)", o.Allowed, o.Max, o.Span)
			}
		})
	}
	if ran == 0 {
		t.Fatal("no txlimit contender is registered")
	}
}
