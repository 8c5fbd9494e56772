package ratelimit

import (
	"hash/fnv"
	"math/rand/v2"
	"slices"
)

// maxCandidates bounds how many shards a sharded decision considers when its first picks are
// taken by other transactions (see shardCandidates).
const maxCandidates = 16

// pickTwo picks two distinct shards of n (n >= 2) uniformly at random.
func pickTwo(n int) (int, int) {
	a := rand.IntN(n)
	b := rand.IntN(n - 1)
	if b >= a {
		b++
	}
	return a, b
}

// shardCandidates returns the shards a single sharded decision may use, in the order it tries
// them: the two picks a and b first, then up to maxCandidates-2 other distinct shards in random
// order (all of them when n <= maxCandidates). The decision takes the first candidate that no
// other transaction is deciding on, and the one after it as its second pick, so with no
// concurrent caller the picks are exactly a and b.
func shardCandidates(n, a, b int) []int32 {
	m := min(n, maxCandidates)
	c := make([]int32, 2, m)
	c[0], c[1] = int32(a), int32(b)
	if n <= maxCandidates {
		for i := range n {
			if i != a && i != b {
				c = append(c, int32(i))
			}
		}
		rest := c[2:]
		rand.Shuffle(len(rest), func(i, j int) { rest[i], rest[j] = rest[j], rest[i] })
		return c
	}
	for len(c) < m {
		if x := int32(rand.IntN(n)); !slices.Contains(c, x) {
			c = append(c, x)
		}
	}
	return c
}

// shardLockBase is the base of the advisory lock keys of (name, key)'s shards: shard s's steering
// lock is base XOR the table's OID shifted left 20 bits XOR s (txlimit_steer). It is the FNV-1a
// hash of "txlimit", a NUL byte, name, a NUL byte and key: the same in every process, so that
// callers of one hot key anywhere steer clear of each other's shards.
func shardLockBase(name, key string) int64 {
	h := fnv.New64a()
	h.Write([]byte("txlimit\x00"))
	h.Write([]byte(name))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return int64(h.Sum64())
}
