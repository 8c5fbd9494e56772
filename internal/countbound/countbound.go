// Package countbound holds the one rule, shared by packages ratelimit and httplimit, of how large
// a count a limit can ever grant, so that a count no row could ever grant is refused as bad input
// instead of being denied forever.
package countbound

// Bounds on every amount of tokens package ratelimit accepts (Rate, Capacity, MaxReserved, a count)
// and so on what package scheduler books and settles. They keep every value exact in float8
// arithmetic.
const (
	// Max is the largest amount: 10^15 tokens, so that sums of tokens stay exact to well below one
	// token in float8.
	Max = 1e15

	// Min is the smallest amount accepted (when set): 10^-9 tokens. Smaller values would underflow
	// float8 arithmetic in the database.
	Min = 1e-9
)

// Check returns the largest count a single call could ever be granted by a limit whose rows (its
// shards, when sharded) each hold at most per tokens and may owe allow below zero (0 without a
// reservation): what one row holds, or two together when sharded; and whether count can be
// granted, by that bound and by the grant rule's own float operations on full rows
// (txlimit_left and txlimit_granted in migrations/00002_txlimit_rules.sql: a bound per + allow
// rounded up in float64 would let through a count that no row could ever grant, 0.1 + 0.2 of a
// capacity of 0.1 with allow 0.2).
func Check(per, allow float64, sharded bool, count float64) (most float64, ok bool) {
	most, fits := per+allow, false
	if sharded {
		most = 2 * most
	}
	if sharded && count > per {
		fits = (per+per-count)/2 >= -allow // both shards charged, left equal
	} else {
		fits = per-count >= -allow
	}
	return most, count <= most && fits
}
