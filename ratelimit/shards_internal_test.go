package ratelimit

import (
	"slices"
	"testing"
)

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
