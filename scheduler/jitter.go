package scheduler

import (
	"hash/fnv"
	"math/rand/v2"
	"time"
)

// JitterFor returns a delay in [0, max) that depends only on identity: a 64-bit FNV-1a hash of
// identity, mixed with MurmurHash3's finaliser so that short identities spread too, scaled to max
// and truncated to the microsecond (Postgres's precision). The same identity always gets the same
// delay and different identities spread evenly over [0, max), so clients that were limited
// together do not all come back together, yet each one's schedule is reproducible (the same idea
// as the deterministic per-identity Retry-After jitter of docs/spec.md §11). max <= 0 returns 0.
func JitterFor(identity string, max time.Duration) time.Duration {
	if max <= 0 {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(identity))
	x := h.Sum64()
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	frac := float64(x>>11) / (1 << 53) // in [0, 1)
	return time.Duration(frac * float64(max)).Truncate(time.Microsecond)
}

// jitter returns JitterFor(identity, max) when identity is set, else a uniformly random delay in
// [0, max), truncated to the microsecond.
func jitter(identity string, max time.Duration) time.Duration {
	if max <= 0 {
		return 0
	}
	if identity != "" {
		return JitterFor(identity, max)
	}
	return rand.N(max).Truncate(time.Microsecond)
}
