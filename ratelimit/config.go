package ratelimit

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/bits"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txlimit/txlimit/internal/countbound"
)

// Kind selects the algorithm of a limit.
type Kind int

const (
	// TokenBucket refills continuously: Rate tokens per Period, up to Capacity. In any interval of
	// length Period it grants at most Capacity + Rate tokens. It is the zero Kind, so the default.
	TokenBucket Kind = iota

	// FixedWindow adds Rate tokens at the start of each window of length Period, up to Capacity.
	// Without reservations it grants at most Capacity tokens within one window. Windows lie on a
	// grid anchored at Config.Start, or at a phase derived from the limit's name and key.
	FixedWindow
)

// String returns "token bucket" or "fixed window".
func (k Kind) String() string {
	switch k {
	case TokenBucket:
		return "token bucket"
	case FixedWindow:
		return "fixed window"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// MaxKeyLen is the longest key accepted, in bytes of UTF-8: 1024, so that every key is indexable.
// A longer key (a header, say) is an *ArgumentError; hash it first.
const MaxKeyLen = 1024

// Bounds on arguments, stated on the fields and calls they bound. They keep every value exact in
// float8 arithmetic.
const (
	// maxAmount bounds Rate, Capacity, MaxReserved and every count (countbound.Max: 10^15).
	maxAmount = countbound.Max

	// minAmount is the smallest Rate, Capacity, MaxReserved or count accepted, when set
	// (countbound.Min: 10^-9).
	minAmount = countbound.Min

	// maxNameLen is the longest limit name accepted, in bytes of UTF-8.
	maxNameLen = 256

	// maxShards is the largest Config.Shards accepted.
	maxShards = 1024

	// maxPeriod is the longest Config.Period accepted: 100 years of 365 days.
	maxPeriod = 100 * 365 * 24 * time.Hour
)

// Unbounded is the value of Config.MaxReserved that puts no bound on reservations.
var Unbounded = math.Inf(1)

// Config is the configuration of one limit. It is not stored: every call carries it, so changing it
// takes effect on the next call (see Shards for what a change of shard count does). The zero value
// is not valid: Rate and Period are required.
type Config struct {
	// Capacity is the most tokens the limit holds at once, its burst. Must be between 10^-9 and
	// 10^15 when set. Defaults to Rate.
	Capacity float64

	// Kind is the algorithm. Defaults to TokenBucket.
	Kind Kind

	// MaxReserved bounds how far below zero a reservation (LimitOpts.Reserve) may take the limit:
	// a reservation that would leave more than MaxReserved tokens owed is refused, with the RetryAt
	// at which it would fit. Must be 0, between 10^-9 and 10^15, or Unbounded for no bound (every
	// reservation is granted and only its RetryAt grows). Defaults to 0: no reservations; a call
	// with Reserve on such a limit is an *ArgumentError. Calls without Reserve never go below zero,
	// whatever this is.
	MaxReserved float64

	// Period is the time over which Rate tokens are added. Must be > 0 and a whole number of
	// microseconds (Postgres's timestamp precision), at most 100 years of 365 days. Required.
	Period time.Duration

	// Rate is the number of tokens added per Period. Must be between 10^-9 and 10^15. Required.
	Rate float64

	// Shards splits the limit over this many rows so that a hot key does not serialise every
	// caller on one row lock. Rate, Capacity and MaxReserved are divided evenly between shards; a
	// call looks at two distinct shards chosen at random and charges the one with more tokens, or
	// both when neither alone suffices but both together do. Changing Shards while rows exist never
	// grants more than the new config allows: each shard row is capped at the new per-shard
	// capacity, missing shards count as full, and rows of shards >= the new count are ignored
	// (their debt forgiven) until Reset removes them. Must be between 1 and 1024.
	// Defaults to 1.
	Shards int

	// Start anchors the window grid of a FixedWindow limit: windows begin at Start + k*Period for
	// every integer k (any instant works; a midnight aligns daily windows to it). Only valid with
	// FixedWindow. Defaults to the zero time, which means a phase derived from a hash of the
	// limit's name and key: spread across keys, stable across resets, the same for every shard.
	Start time.Time
}

// String describes the config, e.g. "token bucket 10/1m0s cap 20".
func (c Config) String() string {
	s := fmt.Sprintf("%s %g/%s", c.Kind, c.Rate, c.Period)
	if c.Capacity != 0 && c.Capacity != c.Rate {
		s += fmt.Sprintf(" cap %g", c.Capacity)
	}
	if math.IsInf(c.MaxReserved, 1) {
		s += " maxReserved unbounded"
	} else if c.MaxReserved != 0 {
		s += fmt.Sprintf(" maxReserved %g", c.MaxReserved)
	}
	if c.Shards > 1 {
		s += fmt.Sprintf(" shards %d", c.Shards)
	}
	return s
}

// capacity returns Capacity with its default applied.
func (c Config) capacity() float64 {
	if c.Capacity == 0 {
		return c.Rate
	}
	return c.Capacity
}

// shards returns Shards with its default applied.
func (c Config) shards() int {
	if c.Shards == 0 {
		return 1
	}
	return c.Shards
}

// effective returns the config with its defaults applied: the config in force.
func (c Config) effective() Config {
	c.Capacity = c.capacity()
	c.Shards = c.shards()
	return c
}

// validate checks every field and names the first that is wrong.
func (c Config) validate(name string) error {
	bad := func(field string, value any, reason string) error {
		return &ConfigError{Limit: name, Field: field, Value: value, Reason: reason}
	}
	amount := func(field string, v float64, zeroOK bool) error {
		switch {
		case math.IsNaN(v) || math.IsInf(v, 0):
			return bad(field, v, "must be finite")
		case v < 0:
			return bad(field, v, "must not be negative")
		case v == 0 && !zeroOK:
			return bad(field, v, "must be > 0")
		case v != 0 && v < minAmount:
			return bad(field, v, fmt.Sprintf("must be at least %g when set", float64(minAmount)))
		case v > maxAmount:
			return bad(field, v, fmt.Sprintf("must be at most %g", float64(maxAmount)))
		}
		return nil
	}
	if c.Kind != TokenBucket && c.Kind != FixedWindow {
		return bad("Kind", c.Kind, "must be TokenBucket or FixedWindow")
	}
	if err := amount("Rate", c.Rate, false); err != nil {
		return err
	}
	switch {
	case c.Period <= 0:
		return bad("Period", c.Period, "must be > 0 (e.g. time.Second)")
	case c.Period%time.Microsecond != 0:
		return bad("Period", c.Period, "must be a whole number of microseconds")
	case c.Period > maxPeriod:
		return bad("Period", c.Period, "must be at most 100 years of 365 days")
	}
	if err := amount("Capacity", c.Capacity, true); err != nil {
		return err
	}
	if !math.IsInf(c.MaxReserved, 1) {
		if err := amount("MaxReserved", c.MaxReserved, true); err != nil {
			return err
		}
	}
	if c.Shards < 0 || c.Shards > maxShards {
		return bad("Shards", c.Shards, fmt.Sprintf("must be between 1 and %d; 0 means 1", maxShards))
	}
	if !c.Start.IsZero() && c.Kind != FixedWindow {
		return bad("Start", c.Start, "is only used by FixedWindow; leave it zero for a token bucket")
	}
	return nil
}

// checkName validates a limit name.
func checkName(op, name string) error {
	switch {
	case name == "":
		return &ArgumentError{Op: op, Arg: "name", Reason: "must not be empty"}
	case len(name) > maxNameLen:
		return &ArgumentError{Op: op, Arg: "name", Reason: fmt.Sprintf("is %d bytes, more than %d", len(name), maxNameLen)}
	}
	return checkText(op, "name", name)
}

// checkKey validates a key. The empty key is valid: it names the limit's single global instance.
func checkKey(op, key string) error {
	if len(key) > MaxKeyLen {
		return &ArgumentError{Op: op, Arg: "key", Reason: fmt.Sprintf("is %d bytes, more than MaxKeyLen (%d)", len(key), MaxKeyLen)}
	}
	return checkText(op, "key", key)
}

func checkText(op, arg, s string) error {
	if !utf8.ValidString(s) {
		return &ArgumentError{Op: op, Arg: arg, Reason: "is not valid UTF-8"}
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return &ArgumentError{Op: op, Arg: arg, Reason: "contains a NUL byte, which Postgres text cannot hold"}
		}
	}
	return nil
}

// checkCount validates a count of tokens.
func checkCount(op string, n float64) error {
	switch {
	case math.IsNaN(n) || math.IsInf(n, 0):
		return &ArgumentError{Op: op, Arg: "count", Reason: fmt.Sprintf("must be finite, got %g", n)}
	case n <= 0:
		return &ArgumentError{Op: op, Arg: "count", Reason: fmt.Sprintf("must be > 0, got %g", n)}
	case n > maxAmount:
		return &ArgumentError{Op: op, Arg: "count", Reason: fmt.Sprintf("must be at most %g, got %g", float64(maxAmount), n)}
	case n < minAmount:
		return &ArgumentError{Op: op, Arg: "count", Reason: fmt.Sprintf("must be at least %g, got %g", float64(minAmount), n)}
	}
	return nil
}

// spec is a validated limit resolved for one (name, key): the per-shard numbers the SQL works with.
type spec struct {
	name, key string
	cfg       Config
	shards    int
	rate      float64 // per shard
	capacity  float64 // per shard
	maxRes    float64 // per shard; +Inf means unbounded
	periodUs  int64
	stepUs    int64 // the refill step: 1 for a token bucket, periodUs for a fixed window
	anchorUs  int64 // fixed window: the last start of the key's grid at or before the epoch, in (-periodUs, 0]; 0 for a token bucket
}

func newSpec(name, key string, cfg Config) spec {
	n := cfg.shards()
	s := spec{
		name:     name,
		key:      key,
		cfg:      cfg,
		shards:   n,
		rate:     cfg.Rate / float64(n),
		capacity: cfg.capacity() / float64(n),
		maxRes:   allowance(cfg.MaxReserved, n),
		periodUs: cfg.Period.Microseconds(),
		stepUs:   1,
	}
	if cfg.Kind == FixedWindow {
		s.stepUs = s.periodUs
		// A missing row is stamped at this anchor, so it must not lie after the clock reading: the
		// grid start at or before the epoch, not the phase after it (a period of 80 years with a
		// phase in 2040 would stamp a row in the future, and its first window would last two); a
		// reading before the epoch gets the window holding it instead (missingTS).
		if s.anchorUs = windowPhase(name, key, cfg.Start, s.periodUs); s.anchorUs > 0 {
			s.anchorUs -= s.periodUs
		}
	}
	return s
}

// missingTS is the ts a missing row of this spec is evaluated (and, to lock it, stamped) with
// at the reading now (NULL: the database's clock): the anchor, so that it evaluates as a missing
// row at every later reading; for a reading before the anchor (an injected clock before 1970),
// the start of the step holding the reading (the reading itself for a token bucket, its
// window's start for a fixed window), so that a fresh row refills from its first call on, not
// from the epoch (docs/spec.md §1, §4).
func (s spec) missingTS(now pgtype.Int8) int64 {
	if !now.Valid || now.Int64 >= s.anchorUs {
		return s.anchorUs
	}
	d := now.Int64 - s.anchorUs // < 0, and at least -2^61 - 100 years
	return s.anchorUs + (d-(s.stepUs-1))/s.stepUs*s.stepUs
}

// windowPhase returns where in [0, periodUs) microseconds after the Unix epoch the window grid of
// a fixed window starts: from start when set, else from an FNV-1a hash of name and key.
func windowPhase(name, key string, start time.Time, periodUs int64) int64 {
	if !start.IsZero() {
		return startPhase(start, periodUs)
	}
	h := fnv.New64a()
	h.Write([]byte(name))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return int64(h.Sum64() % uint64(periodUs))
}

// startPhase returns start's microseconds since the Unix epoch modulo periodUs, in [0, periodUs),
// for any time.Time: UnixMicro wraps beyond about 292,000 years, so the seconds and the
// microseconds within the second are reduced apart. The remainder of a time before the epoch is
// negative: adding periodUs (at most 100 years, so no overflow) makes it the phase.
func startPhase(start time.Time, periodUs int64) int64 {
	sec := (start.Unix()%periodUs + periodUs) % periodUs // < 2^52
	hi, lo := bits.Mul64(uint64(sec), 1e6)
	us := bits.Rem64(hi, lo, uint64(periodUs)) + uint64(start.Nanosecond()/1000)
	return int64(us % uint64(periodUs))
}

// effective is the config in force for this spec: defaults applied.
func (s spec) effective() Config { return s.cfg.effective() }

// checkRequest validates a count against the spec.
func (s spec) checkRequest(op string, count float64, reserve bool) error {
	if err := checkCount(op, count); err != nil {
		return err
	}
	if reserve && s.cfg.MaxReserved == 0 {
		return &ArgumentError{Op: op, Arg: "Reserve", Reason: fmt.Sprintf(
			"limit %q has MaxReserved 0, which allows no reservation: set MaxReserved (or Unbounded)", s.name)}
	}
	allow := 0.0
	if reserve {
		allow = s.maxRes // +Inf when unbounded: any count can be granted
	}
	if m, ok := countbound.Check(s.capacity, allow, s.shards >= 2, count); !ok {
		what := "the capacity"
		if s.shards >= 2 {
			what = "what two shards hold together"
		}
		if reserve {
			what += " plus MaxReserved"
		}
		return &ArgumentError{Op: op, Arg: "count", Reason: fmt.Sprintf(
			"%g exceeds %s (%g) of limit %q, so it could never be granted", count, what, m, s.name)}
	}
	return nil
}
