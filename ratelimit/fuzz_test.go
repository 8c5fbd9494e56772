package ratelimit_test

// FuzzModel replays random request sequences against Postgres (through the library) and against
// the reference model (model_test.go), requiring identical answers, bit for bit.
//
//	go test ./ratelimit -run FuzzModel                             # the committed seed corpus
//	go test ./ratelimit -run '^$' -fuzz FuzzModel -fuzztime 30000x # explore (a count: docs/reliability.md)
//
// An input is a header of three limit configs and a base time, then operations of five bytes each
// (see fzDecode). One database schema serves a whole FuzzModel run (one per fuzz worker process);
// each input starts by resetting every (name, key) the previous input touched, so inputs are
// isolated and a failing input replays the same way.
//
// TestFuzzSeedsCoverEveryShape runs the committed seed corpus with fzShapes naming the branch of
// the engine's road (the top of migrations/00003_txlimit_decide.sql) each decision takes, and fails naming every shape of
// fzShapeList that no seed reaches: a new branch or a seed removed shows there.
//
//	go test ./ratelimit -count=1 -p 1 -run TestFuzzSeedsCoverEveryShape -v  # -v: each shape's count

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Tables the input bytes index into. Values are chosen to hit the interesting algebra: capacity
// above and below rate, fractional counts that are not exact in binary, periods from 1µs to a
// day, unbounded and bounded reservations.
var (
	inf       = math.Inf(1)
	fzRates   = []float64{1, 2, 3, 10, 0.5, 7, 100, 2.5}
	fzPeriods = []time.Duration{time.Second, time.Millisecond, time.Minute, time.Hour, 1500 * time.Millisecond,
		7 * time.Microsecond, 10 * time.Second, 250 * time.Millisecond, 3 * time.Second, 100 * time.Millisecond,
		time.Microsecond, 24 * time.Hour, 2 * time.Second, 45 * time.Second, 333 * time.Microsecond, 5 * time.Second}
	fzCaps   = []float64{0, 1, 2, 5, 20, 0.5, 100, 3.3, 10, 1.5, 7, 0, 4, 12, 0.75, 50}       // 0: unset (Rate)
	fzMaxRes = []float64{inf, inf, inf, inf, 1, 5, 0.5, 100, 2, 10, 0, 3, 0.25, 20, 1.5, 1e6} // inf: Unbounded; 0: no reservations
	fzCounts = []float64{1, 1, 2, 0.5, 3, 0.1, 0.3, 5, 10, 2.5, 1.5, 7, 0.25, 4, 20, 0,
		-1, math.NaN(), math.Inf(1), 1e16, 1e-7, 0.7, 33, 100, 6, 8, 9, 12, 1.0 / 3, 2.0 / 3, 15, 50}
	// Time steps in µs, applied before each operation: forward and backward.
	fzSteps = []int64{0, 0, 1, 2, 7, 10, 999, 1000, 1001, 33333, 100000, 250000, 333333, 499999, 500000, 500001,
		999999, 1000000, 1000001, 1500000, 2000000, 3000000, 5000000, 10000000, 30000000, 45000000, 60000000,
		3600000000, 86400000000, 123456, 654321, 100,
		-1, -2, -999, -1000, -100000, -250000, -500000, -1000000, -1500000, -3000000, -60000000, -3600000000,
		200, 300, 1234, 20000, 50000, 75000, 400000, 600000, 700000, 800000, 900000, 1200000, 2500000,
		4000000, 7000000, 20000000, 0, 1,
		-1 << 51, 1 << 51} // about 71 years: before the epoch (docs/spec.md §5 accepts readings down to -2^61 µs) and back
	fzNames = []string{"a", "b", "c", "x"} // "x" is not registered: it needs an inline config
	fzKeys  = []string{"", "k1", "ü-key"}
	// Keys that must be rejected (docs/spec.md §5): too long, a NUL byte, not UTF-8.
	fzBadKeys = []string{strings.Repeat("k", ratelimit.MaxKeyLen+1), "a\x00b", "\xff\xfe"}
	// Configs that must be rejected, each for one field (docs/spec.md §5).
	fzBadConfigs = []ratelimit.Config{
		{Rate: 0, Period: time.Second},
		{Rate: math.NaN(), Period: time.Second},
		{Rate: 1, Period: 0},
		{Rate: 1, Period: 1500 * time.Nanosecond},
		{Rate: 1, Period: time.Second, Capacity: -1},
		{Rate: 1, Period: time.Second, MaxReserved: math.Inf(-1)},
		{Rate: 1, Period: time.Second, Shards: ratelimit.MaxShards + 1},
		{Rate: 1, Period: time.Second, Start: time.Unix(5, 0)}, // Start on a token bucket
	}
	// fzBase is the time of the first operation before the header's offset.
	fzBase = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()
)

// Known library deviations from the documented contract, found by this fuzz target and reported.
// Each is tolerated only while its flag is true, narrowly; set it to false once fixed.
const (
	// CreditResult.Time is documented as "the instant the credit was evaluated at", but Credit
	// leaves it zero when (name, key) has no rows in its configured shards (the Credit query
	// returns no row to carry the clock).
	fzBugCreditTimeZeroWithoutRows = false

	// Result.RetryAt can be one microsecond (token bucket) or one window (fixed window) later
	// than the earliest instant at which the debt is paid: the library rounds
	// float64(debt*Period/Rate) up and only corrects upwards (when the refill falls one ulp
	// short), never downwards when the float product lands just above the integer that already
	// pays the debt. Seed retryat_overshoot: a 1/24h bucket at -19 asked for 1 token 200µs later
	// must wait until exactly 20 days after the reservation (-19 + 20 - 1 = 0, as the database
	// computes it too), the library says one microsecond later.
	fzBugRetryAtOvershoot = false

	// LimitedError.RetryAt is documented (errors.go) as "when the call could succeed: the latest
	// RetryAt of all denied limits", but LimitMany with AsError sets it to ManyResult.RetryAt, the
	// latest RetryAt of all results, including a request that alone would be granted as a
	// reservation. Seed throw_many_with_reservation: a (1/s) would reserve 5 with RetryAt +4s,
	// b (3/s, empty) is denied with RetryAt +1/3s; the call could succeed at +333334µs, the error
	// says +4s.
	fzBugLimitedRetryAtIncludesReservations = false
)

// Operation codes (low four bits of an operation's first byte).
const (
	fzOpLimit        = 0 // LimitN (also 1, 2); Reserve from the request byte
	fzOpReserve      = 3 // LimitN with Reserve
	fzOpCheck        = 4 // CheckN
	fzOpCheckReserve = 5 // CheckN with Reserve
	fzOpCredit       = 6 // Credit
	fzOpValue        = 7 // Value (also 15)
	fzOpResetCredit  = 8 // Reset when bit 4 is set, else Credit
	fzOpMany         = 9 // LimitMany of 2 requests, 3 when bit 4 is set (also 10)
	fzOpCheckMany    = 11
	fzOpLimit1       = 12 // Limit (count 1)
	fzOpThrow        = 13 // LimitN with AsError
	// fzOpList decides 2 calls (3 when bit 4 is set) as one list in one statement, the way the
	// engine decides a batch: each request is a LimitN of its own, except that with bit 6 the
	// first two form one LimitMany group, and with bit 5 the last is a CheckN.
	fzOpList = 14
	fzBit4   = 16
	fzBit5   = 32
	fzBit6   = 64
	// fzBitTx runs a single or LimitMany/CheckMany decision inside a SERIALIZABLE transaction of its
	// own (committed after it), the engine's other shape: there a lone request's one-row UPDATE
	// runs in txlimit_decide_one_v1, and a lone sharded Limit reads its second pick only when the
	// first cannot serve alone (the package doc, "Shards").
	fzBitTx = 128
)

const (
	fzHeaderLen = 3*4 + 2
	fzOpLen     = 5
	fzReqLen    = 3
	fzMaxOps    = 48
)

// fzReq is one request as decoded: indexes into the tables plus flags.
type fzReq struct {
	name, key int // key 3: a bad key (fzBadKeys[pickB%3]) when bad is 7, else "k1"
	bad       int // 0..7, selects the bad config
	inline    bool
	badConfig bool // with inline: fzBadConfigs[bad]
	// swap, with inline: the config of the next name instead ("a" gets b's, "b" c's, "c" a's, "x"
	// b's), so that one (name, key) is decided under another config: a changed Capacity, Period,
	// Start, Kind, MaxReserved or Shards (docs/spec.md §1, §4, §8).
	swap    bool
	throw   bool
	reserve bool
	count   float64
	pickA   int
	pickB   int
}

type fzOp struct {
	code byte
	dt   int64
	reqs []fzReq
}

type fzScenario struct {
	cfgs [3]ratelimit.Config
	base int64
	ops  []fzOp
}

// fzDecodeConfig reads one limit config from four bytes:
// b0: bit 0 kind, bits 1-3 rate, bits 4-7 period; b1: low nibble capacity, high nibble
// MaxReserved; b2: bits 0-1 shards-1, bits 2-3 Start mode (2: Start at the base plus b3 seconds,
// 3: Start b3·7 µs after the epoch; else the hashed phase); b3: Start offset.
func fzDecodeConfig(b []byte) ratelimit.Config {
	c := ratelimit.Config{
		Kind:        ratelimit.Kind(b[0] & 1),
		Rate:        fzRates[(b[0]>>1)&7],
		Period:      fzPeriods[b[0]>>4],
		Capacity:    fzCaps[b[1]&15],
		MaxReserved: fzMaxRes[b[1]>>4],
		Shards:      int(b[2]&3) + 1,
	}
	if c.Kind == ratelimit.FixedWindow {
		switch (b[2] >> 2) & 3 {
		case 2:
			c.Start = time.UnixMicro(fzBase).Add(time.Duration(b[3]) * time.Second).UTC()
		case 3:
			c.Start = time.UnixMicro(int64(b[3]) * 7).UTC()
		}
	}
	if c.Shards == 1 && b[2]&16 != 0 {
		c.Shards = 0 // the default, 1
	}
	return c
}

func fzDecodeReq(b []byte) fzReq {
	return fzReq{
		name:      int(b[0] & 3),
		key:       int((b[0] >> 2) & 3),
		inline:    b[0]&16 != 0,
		badConfig: b[0]&0x30 == 0x30 && b[2]&15 == 15, // rare: inline, bit 5 and pick nibble 15
		swap:      b[0]&0x30 == 0x30 && b[2]&15 != 15, // inline and bit 5
		throw:     b[0]&64 != 0,
		reserve:   b[0]&128 != 0,
		count:     fzCounts[b[1]&31],
		bad:       int(b[1] >> 5),
		pickA:     int(b[2] & 15),
		pickB:     int(b[2] >> 4),
	}
}

// fzDecode turns fuzz bytes into a scenario. Short inputs give fewer operations, never an error.
func fzDecode(data []byte) fzScenario {
	var s fzScenario
	var h [fzHeaderLen]byte
	copy(h[:], data)
	for i := range s.cfgs {
		s.cfgs[i] = fzDecodeConfig(h[4*i : 4*i+4])
	}
	s.base = fzBase + int64(uint16(h[12])|uint16(h[13])<<8)*12_345_677
	rest := data[min(len(data), fzHeaderLen):]
	for len(rest) >= fzOpLen && len(s.ops) < fzMaxOps {
		op := fzOp{code: rest[0], dt: fzSteps[int(rest[1])%len(fzSteps)]}
		op.reqs = append(op.reqs, fzDecodeReq(rest[2:5]))
		rest = rest[fzOpLen:]
		if c := op.code & 15; c == fzOpMany || c == fzOpMany+1 || c == fzOpCheckMany || c == fzOpList {
			n := 2
			if op.code&fzBit4 != 0 {
				n = 3
			}
			for len(op.reqs) < n && len(rest) >= fzReqLen {
				op.reqs = append(op.reqs, fzDecodeReq(rest[:fzReqLen]))
				rest = rest[fzReqLen:]
			}
		}
		s.ops = append(s.ops, op)
	}
	return s
}

// fzRunner executes one scenario against the library and the model.
type fzRunner struct {
	t       *testing.T
	ctx     context.Context
	pool    *pgxpool.Pool
	db      ratelimit.Executor // the pool, or the operation's SERIALIZABLE transaction (fzBitTx)
	sc      fzScenario
	lim     *ratelimit.Limiter
	md      *model
	now     int64
	picks   [][2]int
	picked  int
	touched map[[2]string]bool
	trace   []string
	// strict disables the known-bug tolerances; skip, when set, turns a disagreement into a skip.
	strict bool
	skip   string
	// overshoots counts RetryAts accepted only through fzBugRetryAtOvershoot.
	overshoots int
	// shapes, when set, counts the shape of every decision (fzShapes); wrote is the config each
	// (name, key) was last charged under, to name a config change.
	shapes map[string]int
	wrote  map[[2]string]ratelimit.Config
}

func (r *fzRunner) fail(format string, args ...any) {
	r.t.Helper()
	if r.skip != "" {
		r.t.Skipf("%s: %s", r.skip, fmt.Sprintf(format, args...))
	}
	r.t.Fatalf("model and library disagree at operation %d: %s\nconfigs: a=%+v\n b=%+v\n c=%+v\ntrace:\n%s",
		len(r.trace), fmt.Sprintf(format, args...), r.sc.cfgs[0], r.sc.cfgs[1], r.sc.cfgs[2], strings.Join(r.trace, "\n"))
}

func (r *fzRunner) logf(format string, args ...any) {
	r.trace = append(r.trace, fmt.Sprintf("  %3d t=%+dµs ", len(r.trace)+1, r.now-r.sc.base)+fmt.Sprintf(format, args...))
}

// target resolves a request's name, key and config as the caller passes them.
func (r *fzRunner) target(q fzReq) (name, key string, inline *ratelimit.Config, modelCfg *ratelimit.Config) {
	name = fzNames[q.name]
	switch {
	case q.key < len(fzKeys):
		key = fzKeys[q.key]
	case q.bad == 7:
		key = fzBadKeys[q.pickB%len(fzBadKeys)]
	default:
		key = fzKeys[1]
	}
	var registered *ratelimit.Config
	if q.name < 3 {
		c := r.sc.cfgs[q.name]
		registered = &c
	}
	if q.inline {
		var c ratelimit.Config
		switch {
		case q.badConfig:
			c = fzBadConfigs[q.bad]
		case q.swap:
			c = r.sc.cfgs[(q.name+1)%3] // "x" (3) gets b's
		case q.name < 3:
			c = r.sc.cfgs[q.name]
		default:
			c = r.sc.cfgs[0] // "x" always uses the first config
		}
		return name, key, &c, &c
	}
	return name, key, nil, registered
}

// pick turns a request's pick bytes into two distinct shards of n, as the test's shard picker.
func fzPick(q fzReq, n int) (int, int) {
	a := q.pickA % n
	b := (a + 1 + q.pickB%(n-1)) % n
	return a, b
}

func (r *fzRunner) picker(n int) (int, int) {
	if r.picked >= len(r.picks) {
		r.t.Errorf("shard picker called more often than expected (n=%d)", n)
		return 0, 1
	}
	p := r.picks[r.picked]
	r.picked++
	if p[0] >= n || p[1] >= n {
		r.t.Errorf("shard picker: picks %v do not fit n=%d", p, n)
		return 0, 1
	}
	return p[0], p[1]
}

// errClass names the class of an error: one of the model's errors, "limited", "nil" or "other".
func errClass(err error) string {
	var ce *ratelimit.ConfigError
	var ae *ratelimit.ArgumentError
	var ue *ratelimit.UnknownLimitError
	var le *ratelimit.LimitedError
	switch {
	case err == nil:
		return "nil"
	case errors.As(err, &ce), errors.Is(err, errModelConfig):
		return "config"
	case errors.As(err, &ae), errors.Is(err, errModelArgument):
		return "argument"
	case errors.As(err, &ue), errors.Is(err, errModelUnknown):
		return "unknown"
	case errors.As(err, &le):
		return "limited"
	}
	return "other: " + err.Error()
}

func sameFloat(a, b float64) bool { return math.Float64bits(a) == math.Float64bits(b) }

// sameTime compares a library time with a model time in µs (modelNoTime: the zero time).
func sameTime(got time.Time, want int64) bool {
	if want == modelNoTime {
		return got.IsZero()
	}
	return !got.IsZero() && got.Equal(time.UnixMicro(want))
}

func fmtTime(base int64, got time.Time) string {
	if got.IsZero() {
		return "zero"
	}
	return fmt.Sprintf("%+dµs", got.Sub(time.UnixMicro(base)).Microseconds())
}

func fmtModelTime(base, want int64) string {
	if want == modelNoTime {
		return "zero"
	}
	return fmt.Sprintf("%+dµs", want-base)
}

// sameRetry compares a RetryAt, tolerating only the known overshoot (fzBugRetryAtOvershoot).
func (r *fzRunner) sameRetry(got time.Time, want modelResult) bool {
	if sameTime(got, want.RetryAt) {
		return true
	}
	if fzBugRetryAtOvershoot && !r.strict && want.RetryAt != modelNoTime && sameTime(got, want.RetryAt+want.retryStep) {
		r.overshoots++
		return true
	}
	return false
}

func (r *fzRunner) compareResult(what string, got ratelimit.Result, want modelResult) {
	r.t.Helper()
	sameShards := len(got.Shards) == len(want.Shards)
	for i := 0; sameShards && i < len(got.Shards); i++ {
		sameShards = got.Shards[i] == want.Shards[i]
	}
	if got.Name != want.Name || got.Key != want.Key || got.OK != want.OK || got.Reserved != want.Reserved ||
		!r.sameRetry(got.RetryAt, want) || !sameFloat(got.Value, want.Value) || !sameShards ||
		!sameTime(got.Time, want.Time) || !sameTime(got.TS, want.TS) || got.Config != want.Config {
		b := r.sc.base
		r.fail("%s:\n got  ok=%v reserved=%v retryAt=%s value=%v (%#x) ts=%s shards=%v time=%s config=%v\n want ok=%v reserved=%v retryAt=%s value=%v (%#x) ts=%s shards=%v time=%s config=%v",
			what, got.OK, got.Reserved, fmtTime(b, got.RetryAt), got.Value, math.Float64bits(got.Value), fmtTime(b, got.TS), got.Shards, fmtTime(b, got.Time), got.Config,
			want.OK, want.Reserved, fmtModelTime(b, want.RetryAt), want.Value, math.Float64bits(want.Value), fmtModelTime(b, want.TS), want.Shards, fmtModelTime(b, want.Time), want.Config)
	}
}

// compareLimited checks a *LimitedError against the denied model results: it names the first
// denial and carries the latest RetryAt of the denied limits (errors.go).
// all are the library's results of the call (validated against the model by the caller).
func (r *fzRunner) compareLimited(err error, results []modelResult, all []ratelimit.Result) {
	r.t.Helper()
	var le *ratelimit.LimitedError
	if !errors.As(err, &le) {
		r.fail("want a *LimitedError, got %v", err)
		return
	}
	var denied []modelResult
	for _, m := range results {
		if !m.OK {
			denied = append(denied, m)
		}
	}
	if len(le.Denied) != len(denied) {
		r.fail("LimitedError: got %d denied, want %d", len(le.Denied), len(denied))
	}
	for i := range le.Denied {
		r.compareResult(fmt.Sprintf("LimitedError.Denied[%d]", i), le.Denied[i], denied[i])
	}
	// The denied RetryAts are checked against the model above; the error carries their latest.
	at := modelNoTime
	for _, d := range le.Denied {
		at = max(at, d.RetryAt.UnixMicro())
	}
	if fzBugLimitedRetryAtIncludesReservations && !r.strict && !sameTime(le.RetryAt, at) {
		for _, g := range all {
			if !g.RetryAt.IsZero() {
				at = max(at, g.RetryAt.UnixMicro())
			}
		}
	}
	if le.Name != denied[0].Name || le.Key != denied[0].Key || !sameTime(le.RetryAt, at) {
		r.fail("LimitedError: got %q/%q retryAt=%s denied=%d; want %q/%q retryAt=%s denied=%d",
			le.Name, le.Key, fmtTime(r.sc.base, le.RetryAt), len(le.Denied), denied[0].Name, denied[0].Key,
			fmtModelTime(r.sc.base, at), len(denied))
	}
}

func (r *fzRunner) expectErr(what string, got error, want error) bool {
	r.t.Helper()
	if g, w := errClass(got), errClass(want); g != w {
		r.fail("%s: got error %s (%v), want %s", what, g, got, w)
	}
	return want != nil
}

// single runs LimitN/CheckN/Limit.
func (r *fzRunner) single(op string, q fzReq, dry, forceReserve, forceThrow, countOne bool) {
	name, key, inline, cfg := r.target(q)
	count := q.count
	if countOne {
		count = 1
	}
	opts := &ratelimit.LimitOpts{Config: inline, Reserve: q.reserve || forceReserve, AsError: q.throw || forceThrow}
	r.logf("%s(%q, %q, %v, reserve=%v throw=%v inline=%v) picks=%d/%d", op, name, key, count, opts.Reserve, opts.AsError, inline != nil, q.pickA, q.pickB)

	// The model's verdict on the arguments, in the library's order: count, then name, key, config,
	// then count against what the limit could ever grant.
	wantErr := modelCheckCount(count)
	var m modelLimit
	if wantErr == nil {
		m, wantErr = modelResolve(name, key, cfg)
	}
	if wantErr == nil && m.neverGranted(count, opts.Reserve) {
		wantErr = errModelArgument
	}
	r.picks, r.picked = nil, 0
	req := modelReq{count: count, reserve: opts.Reserve, a: 0, b: -1, snapshot: r.db != ratelimit.Executor(r.pool)}
	if wantErr == nil {
		req.lim = m
		if m.shards >= 2 {
			req.a, req.b = fzPick(q, m.shards)
			r.picks = append(r.picks, [2]int{req.a, req.b})
		}
		if !dry {
			r.touched[[2]string{name, key}] = true
		}
	}

	var got ratelimit.Result
	var err error
	switch {
	case countOne && dry:
		got, err = r.lim.Check(r.ctx, r.db, name, key, opts)
	case countOne:
		got, err = r.lim.Limit(r.ctx, r.db, name, key, opts)
	case dry:
		got, err = r.lim.CheckN(r.ctx, r.db, name, key, count, opts)
	default:
		got, err = r.lim.LimitN(r.ctx, r.db, name, key, count, opts)
	}
	if wantErr != nil {
		r.record(fzDecision{call: "lone", err: wantErr})
		r.expectErr(op, err, wantErr)
		return
	}
	d := r.decision("lone", req, dry)
	want := r.md.decide(r.now, []modelReq{req}, dry).Results[0]
	d.res, d.groupOK = want, want.OK
	r.record(d)
	r.trace[len(r.trace)-1] += fmt.Sprintf(" -> ok=%v reserved=%v value=%v retryAt=%s shards=%v",
		want.OK, want.Reserved, want.Value, fmtModelTime(r.sc.base, want.RetryAt), want.Shards)
	if r.picked != len(r.picks) {
		r.fail("%s: shard picker called %d times, want %d", op, r.picked, len(r.picks))
	}
	if opts.AsError && !want.OK {
		r.compareLimited(err, []modelResult{want}, []ratelimit.Result{got})
	} else if err != nil {
		r.fail("%s: unexpected error %v", op, err)
	}
	r.compareResult(op, got, want)
}

// modelRequest is the model of the validation of one request of a call (prepareCall) and the
// request it gives: a lone call (single) checks its count before its name, as LimitN does, a
// group its name first, as LimitMany does, and a (name, key) may appear only once in a group
// (seen records it).
func modelRequest(q fzReq, name, key string, cfg *ratelimit.Config, count float64, single bool, seen map[[2]string]bool) (modelReq, error) {
	m, err := modelResolve(name, key, cfg)
	switch {
	case single && modelCheckCount(count) != nil:
		err = errModelArgument
	case err != nil:
	case seen[[2]string{name, key}]:
		err = errModelArgument
	case modelCheckCount(count) != nil, m.neverGranted(count, q.reserve):
		err = errModelArgument
	}
	seen[[2]string{name, key}] = true
	mr := modelReq{lim: m, count: count, reserve: q.reserve, a: 0, b: -1}
	if m.shards >= 2 {
		mr.a, mr.b = fzPick(q, m.shards)
	}
	return mr, err
}

// many runs LimitMany/CheckMany.
func (r *fzRunner) many(op string, qs []fzReq, dry bool) {
	var reqs []ratelimit.Request
	var mreqs []modelReq
	var wantErr error
	seen := map[[2]string]bool{}
	r.picks, r.picked = nil, 0
	var desc []string
	for _, q := range qs {
		name, key, inline, cfg := r.target(q)
		reqs = append(reqs, ratelimit.Request{Name: name, Key: key, Count: q.count, Config: inline, Reserve: q.reserve})
		desc = append(desc, fmt.Sprintf("{%q %q %v reserve=%v inline=%v picks=%d/%d}", name, key, q.count, q.reserve, inline != nil, q.pickA, q.pickB))
		if wantErr != nil {
			continue
		}
		count := q.count
		if count == 0 {
			count = 1 // Request.Count defaults to 1
		}
		mr, err := modelRequest(q, name, key, cfg, count, false, seen)
		wantErr = err
		mreqs = append(mreqs, mr)
	}
	throw := qs[0].throw
	r.logf("%s(%s, throw=%v)", op, strings.Join(desc, ", "), throw)
	if wantErr == nil {
		for _, mr := range mreqs {
			if mr.b >= 0 {
				r.picks = append(r.picks, [2]int{mr.a, mr.b})
			}
			if !dry {
				r.touched[[2]string{mr.lim.name, mr.lim.key}] = true
			}
		}
	}
	var got ratelimit.ManyResult
	var err error
	if dry {
		got, err = r.lim.CheckMany(r.ctx, r.db, reqs, &ratelimit.LimitOpts{AsError: throw})
	} else {
		got, err = r.lim.LimitMany(r.ctx, r.db, reqs, &ratelimit.LimitOpts{AsError: throw})
	}
	if wantErr != nil {
		r.record(fzDecision{call: "many", err: wantErr})
		r.expectErr(op, err, wantErr)
		return
	}
	call := "many"
	if len(mreqs) == 1 { // a list of one request is decided as a lone call
		mreqs[0].snapshot = r.db != ratelimit.Executor(r.pool)
		call = "lone"
	}
	ds := make([]fzDecision, len(mreqs))
	for i, mr := range mreqs {
		ds[i] = r.decision(call, mr, dry)
	}
	want := r.md.decide(r.now, mreqs, dry)
	for i := range ds {
		ds[i].res, ds[i].groupOK = want.Results[i], want.OK
		r.record(ds[i])
	}
	r.trace[len(r.trace)-1] += fmt.Sprintf(" -> ok=%v retryAt=%s", want.OK, fmtModelTime(r.sc.base, want.RetryAt))
	if r.picked != len(r.picks) {
		r.fail("%s: shard picker called %d times, want %d", op, r.picked, len(r.picks))
	}
	if throw && !want.OK {
		r.compareLimited(err, want.Results, got.Results)
	} else if err != nil {
		r.fail("%s: unexpected error %v", op, err)
	}
	if got.OK != want.OK || len(got.Results) != len(want.Results) {
		r.fail("%s: got ok=%v results=%d; want ok=%v results=%d", op, got.OK, len(got.Results), want.OK, len(want.Results))
	}
	for i := range want.Results {
		r.compareResult(fmt.Sprintf("%s result %d", op, i), got.Results[i], want.Results[i])
	}
	// ManyResult.RetryAt is the latest RetryAt of the results (each checked against the model).
	wantAt := want.RetryAt
	if r.overshoots > 0 {
		wantAt = modelNoTime
		for _, g := range got.Results {
			if !g.RetryAt.IsZero() {
				wantAt = max(wantAt, g.RetryAt.UnixMicro())
			}
		}
	}
	if !sameTime(got.RetryAt, wantAt) || !sameTime(got.Time, r.now) {
		r.fail("%s: got retryAt=%s time=%s, want %s time=%s", op, fmtTime(r.sc.base, got.RetryAt), fmtTime(r.sc.base, got.Time),
			fmtModelTime(r.sc.base, wantAt), fmtModelTime(r.sc.base, r.now))
	}
}

// inForce is a config with its defaults applied, as State, Lookup and Result report it.
func inForce(c ratelimit.Config) ratelimit.Config {
	if c.Capacity == 0 {
		c.Capacity = c.Rate
	}
	if c.Shards == 0 {
		c.Shards = 1
	}
	return c
}

// list runs fzOpList: calls decided as one list, each as if the calls before it had run one by one.
func (r *fzRunner) list(op fzOp) {
	var calls []ratelimit.ListCall
	var mcalls []fzCall
	var wantErr error
	r.picks, r.picked = nil, 0
	groups := [][]fzReq{}
	if op.code&fzBit6 != 0 && len(op.reqs) >= 2 {
		groups = append(groups, op.reqs[:2])
		for _, q := range op.reqs[2:] {
			groups = append(groups, []fzReq{q})
		}
	} else {
		for _, q := range op.reqs {
			groups = append(groups, []fzReq{q})
		}
	}
	var desc []string
	for gi, g := range groups {
		dry := op.code&fzBit5 != 0 && gi == len(groups)-1
		lc := ratelimit.ListCall{Dry: dry, Single: len(g) == 1}
		mc := fzCall{dry: dry}
		seen := map[[2]string]bool{}
		for _, q := range g {
			name, key, inline, cfg := r.target(q)
			count := q.count
			if count == 0 {
				count = 1 // Request.Count defaults to 1
			}
			lc.Reqs = append(lc.Reqs, ratelimit.Request{Name: name, Key: key, Count: count, Config: inline, Reserve: q.reserve})
			desc = append(desc, fmt.Sprintf("%d:{%q %q %v reserve=%v dry=%v picks=%d/%d}", gi, name, key, count, q.reserve, dry, q.pickA, q.pickB))
			if wantErr != nil {
				continue
			}
			mr, err := modelRequest(q, name, key, cfg, count, len(g) == 1, seen)
			wantErr = err
			mc.reqs = append(mc.reqs, mr)
		}
		calls = append(calls, lc)
		mcalls = append(mcalls, mc)
	}
	r.logf("List(%s)", strings.Join(desc, ", "))
	if wantErr == nil {
		for _, mc := range mcalls {
			for _, mr := range mc.reqs {
				if mr.b >= 0 {
					r.picks = append(r.picks, [2]int{mr.a, mr.b})
				}
				if !mc.dry {
					r.touched[[2]string{mr.lim.name, mr.lim.key}] = true
				}
			}
		}
	}
	got, errs, err := ratelimit.DecideList(r.ctx, r.lim, r.pool, calls)
	if wantErr != nil {
		r.record(fzDecision{call: "list", err: wantErr})
	}
	if r.expectErr("List", err, wantErr) {
		return
	}
	if r.picked != len(r.picks) {
		r.fail("List: shard picker called %d times, want %d", r.picked, len(r.picks))
	}
	call := "list"
	if len(mcalls) == 1 && len(mcalls[0].reqs) == 1 { // a list of one request is decided as a lone call
		call = "lone"
	}
	fast := fzFast(mcalls)
	// e: the last row of a fast request that exists (txlimit_alone's e, found by its UPDATE or
	// read); a fast request's missing row before it is only tried (txlimit_lock_row's p_try).
	var e *modelRowKey
	for i, mc := range mcalls {
		for j, mr := range mc.reqs {
			k := modelRowKey{mr.lim.name, mr.lim.key, mr.a}
			if _, ok := r.md.rows[k]; ok && fast[i][j] && (e == nil || fzRowLess(*e, k)) {
				e = &k
			}
		}
	}
	charged := map[modelRowKey]bool{} // by the calls granted before, in this list
	alone, written, missing := call == "list", true, false
	for i, mc := range mcalls {
		ds := make([]fzDecision, len(mc.reqs))
		for j, mr := range mc.reqs {
			ds[j] = r.decision(call, mr, mc.dry)
			ds[j].fast = fast[i][j] && call == "list"
			ds[j].tried = ds[j].fast && !ds[j].existA && e != nil && fzRowLess(modelRowKey{mr.lim.name, mr.lim.key, mr.a}, *e)
			ds[j].after = charged[modelRowKey{mr.lim.name, mr.lim.key, mr.a}] || mr.b >= 0 && charged[modelRowKey{mr.lim.name, mr.lim.key, mr.b}]
		}
		want := r.md.decide(r.now, mc.reqs, mc.dry)
		for j := range ds {
			ds[j].res, ds[j].groupOK = want.Results[j], want.OK
			r.record(ds[j])
			alone = alone && ds[j].fast
			written = written && ds[j].existA && want.Results[j].OK
			missing = missing || !ds[j].existA
			for _, sh := range want.Results[j].Shards {
				if want.OK && !mc.dry {
					charged[modelRowKey{mc.reqs[j].lim.name, mc.reqs[j].lim.key, sh}] = true
				}
			}
		}
		r.trace[len(r.trace)-1] += fmt.Sprintf(" -> %d: ok=%v", i, want.OK)
		if errs[i] != nil {
			r.fail("List call %d: unexpected error %v", i, errs[i])
		}
		if got[i].OK != want.OK || len(got[i].Results) != len(want.Results) {
			r.fail("List call %d: got ok=%v results=%d; want ok=%v results=%d", i, got[i].OK, len(got[i].Results), want.OK, len(want.Results))
		}
		for j := range want.Results {
			r.compareResult(fmt.Sprintf("List call %d result %d", i, j), got[i].Results[j], want.Results[j])
		}
		if !sameTime(got[i].RetryAt, want.RetryAt) || !sameTime(got[i].Time, r.now) {
			r.fail("List call %d: got retryAt=%s time=%s, want %s time=%s", i, fmtTime(r.sc.base, got[i].RetryAt),
				fmtTime(r.sc.base, got[i].Time), fmtModelTime(r.sc.base, want.RetryAt), fmtModelTime(r.sc.base, r.now))
		}
	}
	switch {
	case r.shapes == nil || !alone:
	case written: // every request alone on its row and written: answered from the writes
		r.shapes["list/all-alone-written"]++
	case !missing: // every request alone, decided by the UPDATE or on its row as read: no plan
		r.shapes["list/alone-no-plan"]++
	}
}

func (r *fzRunner) credit(q fzReq) {
	name, key, inline, cfg := r.target(q)
	r.logf("Credit(%q, %q, %v, inline=%v)", name, key, q.count, inline != nil)
	m, wantErr := modelResolve(name, key, cfg)
	if wantErr == nil {
		wantErr = modelCheckCount(q.count)
	}
	if wantErr == nil {
		r.touched[[2]string{name, key}] = true
	}
	got, err := r.lim.Credit(r.ctx, r.pool, name, key, q.count, &ratelimit.LimitOpts{Config: inline})
	if r.expectErr("Credit", err, wantErr) {
		return
	}
	hasRows := false
	for sh := 0; sh < m.shards; sh++ {
		_, ok := r.md.rows[modelRowKey{name, key, sh}]
		hasRows = hasRows || ok
	}
	want := r.md.credit(r.now, m, q.count)
	if fzBugCreditTimeZeroWithoutRows && !r.strict && !hasRows && got.Time.IsZero() {
		want.Time = modelNoTime
	}
	r.trace[len(r.trace)-1] += fmt.Sprintf(" -> credited=%v value=%v", want.Credited, want.Value)
	if got.Name != name || got.Key != key || !sameFloat(got.Credited, want.Credited) || !sameFloat(got.Value, want.Value) ||
		!sameTime(got.Time, want.Time) {
		r.fail("Credit: got credited=%v value=%v time=%s; want credited=%v value=%v time=%s",
			got.Credited, got.Value, fmtTime(r.sc.base, got.Time), want.Credited, want.Value, fmtModelTime(r.sc.base, want.Time))
	}
}

func (r *fzRunner) value(what string, name, key string, inline, cfg *ratelimit.Config) {
	r.t.Helper()
	m, wantErr := modelResolve(name, key, cfg)
	got, err := r.lim.State(r.ctx, r.pool, name, key, &ratelimit.LimitOpts{Config: inline})
	if r.expectErr(what, err, wantErr) {
		return
	}
	want := r.md.value(r.now, m)
	same := sameFloat(got.Value, want.Value) && len(got.Shards) == len(want.Shards) && sameTime(got.TS, want.TS) &&
		sameTime(got.Time, want.Time) && got.Name == name && got.Key == key && got.Config == inForce(*cfg)
	for i := 0; same && i < len(got.Shards); i++ {
		same = sameFloat(got.Shards[i], want.Shards[i])
	}
	if !same {
		r.fail("%s(%q, %q): got value=%v shards=%v ts=%s time=%s; want value=%v shards=%v ts=%s time=%s", what, name, key,
			got.Value, got.Shards, fmtTime(r.sc.base, got.TS), fmtTime(r.sc.base, got.Time),
			want.Value, want.Shards, fmtModelTime(r.sc.base, want.TS), fmtModelTime(r.sc.base, want.Time))
	}
}

func (r *fzRunner) run() {
	for _, op := range r.sc.ops {
		r.now += op.dt
		q := op.reqs[0]
		c := op.code & 15
		r.db = r.pool
		var tx pgx.Tx
		if op.code&fzBitTx != 0 && c != fzOpList && c != fzOpCredit && c != fzOpResetCredit && c != fzOpValue && c != 15 {
			var err error
			if tx, err = r.pool.BeginTx(r.ctx, pgx.TxOptions{IsoLevel: pgx.Serializable}); err != nil {
				r.fail("begin a SERIALIZABLE transaction: %v", err)
			}
			r.db = tx
			r.logf("in a SERIALIZABLE transaction:")
		}
		switch {
		case c == fzOpReserve:
			r.single("LimitN", q, false, true, false, false)
		case c == fzOpCheck:
			r.single("CheckN", q, true, false, false, false)
		case c == fzOpCheckReserve:
			r.single("CheckN", q, true, true, false, false)
		case c == fzOpCredit, c == fzOpResetCredit && op.code&fzBit4 == 0:
			r.credit(q)
		case c == fzOpResetCredit:
			name, key, _, _ := r.target(q)
			r.logf("Reset(%q, %q)", name, key)
			var wantErr error
			if err := modelCheckText(name, ratelimit.MaxNameLen, false); err != nil {
				wantErr = err
			} else if err := modelCheckText(key, ratelimit.MaxKeyLen, true); err != nil {
				wantErr = err
			}
			if !r.expectErr("Reset", r.lim.Reset(r.ctx, r.pool, name, key), wantErr) {
				r.md.reset(name, key)
				delete(r.wrote, [2]string{name, key})
			}
		case c == fzOpValue, c == 15:
			name, key, inline, cfg := r.target(q)
			r.logf("Value(%q, %q, inline=%v)", name, key, inline != nil)
			r.value("Value", name, key, inline, cfg)
		case c == fzOpMany, c == fzOpMany+1:
			r.many("LimitMany", op.reqs, false)
		case c == fzOpCheckMany:
			r.many("CheckMany", op.reqs, true)
		case c == fzOpLimit1:
			r.single("Limit", q, false, false, false, true)
		case c == fzOpThrow:
			r.single("LimitN", q, false, false, true, false)
		case c == fzOpList:
			r.list(op)
		default:
			r.single("LimitN", q, false, false, false, false)
		}
		if tx != nil {
			if err := tx.Commit(r.ctx); err != nil {
				r.fail("commit the SERIALIZABLE transaction: %v", err)
			}
			r.db = r.pool
		}
		if r.t.Failed() {
			r.fail("stopping after the first failure")
		}
	}
	// Every stored state must agree, evaluated at the final time.
	for nk := range r.touched {
		name, key := nk[0], nk[1]
		cfg := r.sc.cfgs[0]
		for i := 0; i < 3; i++ {
			if fzNames[i] == name {
				cfg = r.sc.cfgs[i]
			}
		}
		r.value("final Value", name, key, &cfg, &cfg)
	}
}

// fzRun runs one input on a fresh limiter.
// strictSkip, when set, turns the known-bug tolerances off and a disagreement into a skip.
// shapes, when set, counts the shape of every decision (fzShapes).
func fzRun(t *testing.T, pool *pgxpool.Pool, data []byte, touched map[[2]string]bool, strictSkip string, shapes map[string]int) *fzRunner {
	r := &fzRunner{t: t, ctx: context.Background(), pool: pool, sc: fzDecode(data), md: newModel(), touched: touched,
		strict: strictSkip != "", skip: strictSkip, shapes: shapes, wrote: map[[2]string]ratelimit.Config{}}
	r.now = r.sc.base
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"a": r.sc.cfgs[0], "b": r.sc.cfgs[1], "c": r.sc.cfgs[2]},
		Now:    func() time.Time { return time.UnixMicro(r.now).UTC() },
	})
	if err != nil {
		t.Fatalf("New: %v (the decoder must only produce valid registered configs)", err)
	}
	ratelimit.SetShardPicker(lim, r.picker)
	r.lim = lim
	r.run()
	return r
}

// TestFuzzModelKnownBugs runs the seeds of the known library deviations with no tolerance. While
// a deviation is present its test is skipped, naming the bug; once the library is fixed the test
// fails, asking for the flag to be set to false (which turns the tolerance in FuzzModel off).
func TestFuzzModelKnownBugs(t *testing.T) {
	for _, tc := range []struct {
		seed string
		bug  bool
		flag string
	}{
		{"retryat_overshoot", fzBugRetryAtOvershoot, "fzBugRetryAtOvershoot"},
		{"credit_without_rows", fzBugCreditTimeZeroWithoutRows, "fzBugCreditTimeZeroWithoutRows"},
		{"throw_many_with_reservation", fzBugLimitedRetryAtIncludesReservations, "fzBugLimitedRetryAtIncludesReservations"},
	} {
		t.Run(tc.seed, func(t *testing.T) {
			var data []byte
			for _, s := range fzSeeds() {
				if s.name == tc.seed {
					data = s.data
				}
			}
			skip := ""
			if tc.bug {
				skip = "known library bug " + tc.flag + " (see its comment in fuzz_test.go)"
			}
			fzRun(t, testdb.Pool(t, &testdb.Options{MaxConns: 2}), data, map[[2]string]bool{}, skip, nil)
			if tc.bug {
				t.Errorf("%s no longer reproduces: the library is fixed, set %s to false", tc.seed, tc.flag)
			}
		})
	}
}

func FuzzModel(f *testing.F) {
	for _, s := range fzSeeds() {
		f.Add(s.data)
	}
	pool := testdb.Pool(f, &testdb.Options{MaxConns: 2})
	resetter, err := ratelimit.New(nil)
	if err != nil {
		f.Fatal(err)
	}
	touched := map[[2]string]bool{} // by the previous input, in this process
	f.Fuzz(func(t *testing.T, data []byte) {
		ctx := context.Background()
		for nk := range touched {
			if err := resetter.Reset(ctx, pool, nk[0], nk[1]); err != nil {
				t.Fatalf("reset %q/%q: %v", nk[0], nk[1], err)
			}
			delete(touched, nk)
		}
		fzRun(t, pool, data, touched, "", nil)
	})
}

// The shapes of the road. Every decision takes one branch of the engine's one road (the top of
// migrations/00003_txlimit_decide.sql): the statement engine.go chooses (DecideOneRow, DecideOne, Decide), then a branch of it.
// fzShapes names the branch of each decision FuzzModel makes from what the harness knows: the
// call, the isolation, the model's rows before it, and the model's answer (checked equal to the
// library's). TestFuzzSeedsCoverEveryShape requires the committed seed corpus to reach every
// shape of fzShapeList.

// fzCall is one call of a list (fzOpList) as the model decides it.
type fzCall struct {
	reqs []modelReq
	dry  bool
}

// fzDecision is what the harness knows of one request's decision.
type fzDecision struct {
	call           string // "lone" (a list of one request), "many" (LimitMany/CheckMany of 2+), "list" (fzOpList)
	err            error  // the model's validation error: invalid input, nothing decided
	tx, dry        bool   // in a SERIALIZABLE transaction; a Check
	reserve        bool
	req            modelReq
	existA, existB bool // the picks' rows existed before the call
	fast           bool // list: engine.go's fast flag (fzFast)
	tried          bool // list: fast, its row missing and sorting before one a fast request found
	after          bool // list: a row that a call before it in the list charged
	changed        []string
	res            modelResult
	groupOK        bool // its call was granted (all or nothing)
}

// decision starts the decision of q, from the model's rows before it.
func (r *fzRunner) decision(call string, q modelReq, dry bool) fzDecision {
	exists := func(sh int) bool { _, ok := r.md.rows[modelRowKey{q.lim.name, q.lim.key, sh}]; return ok }
	d := fzDecision{call: call, tx: r.db != ratelimit.Executor(r.pool), dry: dry, reserve: q.reserve, req: q,
		existA: exists(q.a), existB: q.b >= 0 && exists(q.b)}
	if w, ok := r.wrote[[2]string{q.lim.name, q.lim.key}]; ok {
		c := q.lim.inForce
		for _, f := range []struct {
			name string
			diff bool
		}{{"capacity", w.Capacity != c.Capacity}, {"period", w.Period != c.Period}, {"shards", w.Shards != c.Shards},
			{"start", !w.Start.Equal(c.Start)}, {"kind", w.Kind != c.Kind}} {
			if f.diff {
				d.changed = append(d.changed, f.name)
			}
		}
	}
	return d
}

// record counts d's shapes and remembers the config a granted call charged its key under.
func (r *fzRunner) record(d fzDecision) {
	if r.shapes == nil {
		return
	}
	for _, s := range fzShapes(d) {
		r.shapes[s]++
	}
	if d.err == nil && !d.dry && d.groupOK {
		r.wrote[[2]string{d.req.lim.name, d.req.lim.key}] = d.req.lim.inForce
	}
}

// fzFast is engine.go's decideList fast flag of each request of a list: a call of one request on
// an unsharded limit, not a Check, the only request on its row, which sorts before every row that
// a request neither fast nor a Check may lock.
func fzFast(calls []fzCall) [][]bool {
	uses := map[modelRowKey]int{}
	rows := func(q modelReq) []modelRowKey {
		ks := []modelRowKey{{q.lim.name, q.lim.key, q.a}}
		if q.b >= 0 {
			ks = append(ks, modelRowKey{q.lim.name, q.lim.key, q.b})
		}
		return ks
	}
	for _, c := range calls {
		for _, q := range c.reqs {
			for _, k := range rows(q) {
				uses[k]++
			}
		}
	}
	fast := make([][]bool, len(calls))
	var first *modelRowKey // the first row a request neither fast nor a Check may lock
	for i, c := range calls {
		fast[i] = make([]bool, len(c.reqs))
		for j, q := range c.reqs {
			fast[i][j] = len(c.reqs) == 1 && !c.dry && q.b < 0 && uses[rows(q)[0]] == 1
			for _, k := range rows(q) {
				if !fast[i][j] && !c.dry && (first == nil || fzRowLess(k, *first)) {
					first = &k
				}
			}
		}
	}
	for i, c := range calls {
		for j, q := range c.reqs {
			fast[i][j] = fast[i][j] && (first == nil || fzRowLess(rows(q)[0], *first))
		}
	}
	return fast
}

// fzRowLess is the global lock order of rows (name, key, shard, as bytes).
func fzRowLess(x, y modelRowKey) bool {
	return x.name < y.name || x.name == y.name && (x.key < y.key || x.key == y.key && x.shard < y.shard)
}

// fzShapes names the shapes of one decision: its branch of the road, and, beside it, its kind of
// limit and any config change since its key was last charged. See fzShapeList.
func fzShapes(d fzDecision) []string {
	if d.err != nil {
		return []string{"invalid/" + d.call + "/" + errClass(d.err)}
	}
	iso := "rc"
	if d.tx {
		iso = "tx"
	}
	out := "granted"
	switch {
	case !d.res.OK:
		out = "refused"
	case d.res.Reserved:
		out = "reserved"
	}
	kind := "kind/token-bucket/" + out
	if d.req.lim.fixed {
		kind = "kind/fixed-window/" + out
	}
	pick, created := "", !d.existA
	switch {
	case len(d.res.Shards) == 2:
		pick, created = "both", !d.existA || !d.existB
	case len(d.res.Shards) == 1 && d.res.Shards[0] == d.req.a:
		pick = "first"
	case len(d.res.Shards) == 1:
		pick, created = "second", !d.existB
	}
	if out != "refused" && !d.dry && !d.groupOK {
		out = "denied"
	}
	if created && (out == "granted" || out == "reserved") && !d.dry {
		out = "created-" + out
	}
	var s string
	switch {
	case d.call == "lone" && d.req.b < 0 && !d.dry:
		s = "one-row/" + iso + "/" + out
		if iso == "rc" && out == "refused" && d.reserve {
			s += "-reserve"
		}
	case d.call == "lone" && d.req.b < 0:
		s = "check/" + out
	case d.call == "lone" && !d.dry && out != "refused":
		s = "sharded/" + iso + "/" + pick + "/" + out
	case d.call == "lone" && !d.dry:
		s = "sharded/" + iso + "/refused"
	case d.call == "lone" && out == "granted":
		s = "sharded-check/" + iso + "/" + pick
	case d.call == "lone":
		s = "sharded-check/" + iso + "/" + out
	case d.tried:
		s = "list/alone/missing-row-tried"
	case d.fast && !d.existA:
		s = "list/alone/missing-row"
	case d.fast && out == "refused":
		s = "list/alone/refused"
	case d.fast:
		s = "list/alone/written-" + out
	case d.dry:
		s = "list/plan/check-" + out
	default:
		s = "list/plan/" + out
	}
	shapes := []string{s}
	if d.call != "lone" && !d.fast && !d.dry && d.req.b >= 0 && pick != "" {
		shapes = append(shapes, "list/plan/sharded-"+pick)
	}
	if d.after {
		shapes = append(shapes, "list/plan/after-an-earlier-call")
	}
	if out != "denied" {
		shapes = append(shapes, kind)
	}
	for _, f := range d.changed {
		shapes = append(shapes, "config-change/"+f)
	}
	return shapes
}

// fzShapeList is every shape a single-goroutine FuzzModel run can take, each with the branch it
// stands for. D1 is migrations/00003_txlimit_decide.sql:txlimit_decide_one_v1, DV
// migrations/00003_txlimit_decide.sql:txlimit_decide_v1 (its steps 1-4: plan, lock or create,
// decide, write; txlimit_answers answers), ALONE migrations/00003_txlimit_decide.sql:txlimit_alone.
// "created-": a row it charges was missing (txlimit_lock_row inserts it); rc: READ COMMITTED on
// the pool, tx: a SERIALIZABLE transaction (fzBitTx), named only where the road branches on it.
//
// Not listed, impossible by construction: a refusal on missing rows only (they are full: a count
// no full row grants is an argument error, ratelimit/config.go:checkRequest); under a snapshot, a
// sharded grant of the first pick alone at zero or above after reading the second (read only when
// the first cannot serve); a Check that creates a row.
//
// Not reachable by one goroutine (each needs a row, a shard or a slot held by another
// transaction), covered where named:
//   - DecideOneRow queueing on the row's advisory lock: TestHeldRowQueuesOnAdvisoryLock; a refusal
//     answered while the row is held: TestFastDenialTakesNoLock (concurrency_test.go); D1 after
//     DecideOneRow's UPDATE finding an existing row that grants (changed meanwhile), decided by DV:
//     only in the contention tests, e.g. TestOverGrantPool (concurrency_test.go)
//   - steering past a taken candidate (txlimit_steer): TestModelSteersPastATakenCandidate
//     (model_contention_test.go), TestShardSteersClearOfBusyShards (shard_test.go)
//   - every candidate taken, READ COMMITTED: txlimit_await_shard, then plan again:
//     TestShardWaitsForATakenShardsSteeringLock, TestShardSteeringWaitIsBounded (shard_test.go),
//     TestModelSteeringWaitTimesOutThenDecidesOnThePicks (model_contention_test.go)
//   - every candidate taken or stale under a snapshot: *BusyError: TestModelEveryCandidateTakenUnderSnapshotIsBusy
//     (model_contention_test.go); a stale shard passed over: TestShardPassesOverStaleShards (shard_test.go)
//   - the charged pick row-locked: the other pick alone, or a wait when both are held:
//     TestModelHeldPickChargesTheOther (model_contention_test.go), TestShardSkipsALockedPick (shard_test.go)
//   - a shard changed between plan and lock, decided again by DV; a waited pick refusing, held:
//     TestShardWaitedRowChangedIsDecidedAgain, TestShardRedecidesOnLatestLevels, TestShardWaitedPickIsHeldInOrder (shard_test.go)
//   - a list's rows changed between plan and lock (DV decides again; refused to retry at once),
//     rows created by two lists at once: TestListsConcurrentLedger, TestListsConcurrentWithCreditsAndNewRows,
//     TestListsOppositeOrdersOnNewRows (lists_concurrency_test.go)
//   - a list's row only tried (txlimit_lock_row's p_try) while another transaction creates or holds
//     it, refused to retry at once: TestListOnlyTriesAMissingRowSortingBeforeOneFound (engine_test.go);
//     such rows waited for instead of tried: TestBatcherWaitsForARowSortingBeforeAKeyAlone,
//     TestBatcherWaitsForARowBeingCreated (batcher_test.go)
//   - admission's queue in the process (ratelimit/admission.go): TestShardPoolCallsWaitInTheProcess,
//     TestShardRefusalsPassAdmission (shard_test.go); a Batcher's queue: TestBatcherBatchesWhileBusy (batcher_test.go)
var fzShapeList = []string{
	// Invalid input: a typed error from ratelimit/calls.go:prepareCall, nothing decided.
	"invalid/lone/argument", // a count, name or key refused, or a count no call could be granted
	"invalid/lone/config",   // an inline config refused (ratelimit/config.go:validate)
	"invalid/lone/unknown",  // a name neither registered nor given a config
	"invalid/many/argument", // LimitMany/CheckMany: the same, and a (name, key) twice
	"invalid/many/config",
	"invalid/many/unknown",
	"invalid/list/argument", // a list (ratelimit/export_test.go:DecideList): any call's error leaves the list undecided
	"invalid/list/config",
	"invalid/list/unknown",

	// A lone unsharded Limit/LimitN: engine.go:decideOne sends DecideOneRow (internal/dbsqlc/queries/engine.sql).
	"one-row/rc/granted",          // DecideOneRow's UPDATE writes the grant (left at zero or above)
	"one-row/rc/refused",          // D1, p_tried, no allowance: the refusal answered from the row as read
	"one-row/rc/refused-reserve",  // D1, p_tried with an allowance: its own UPDATE writes nothing, then the read refuses
	"one-row/rc/reserved",         // D1, p_tried with an allowance: its own UPDATE writes below zero
	"one-row/rc/created-granted",  // D1: the row missing, the read grants: DV creates it
	"one-row/rc/created-reserved", // the same, below zero
	"one-row/tx/granted",          // DecideOneRow's UPDATE reads nothing under a snapshot: D1's UPDATE writes
	"one-row/tx/reserved",         // D1's UPDATE writes below zero
	"one-row/tx/refused",          // D1's UPDATE writes nothing: the refusal from the read
	"one-row/tx/created-granted",  // D1's UPDATE finds no row, the read grants: DV creates it
	"one-row/tx/created-reserved",

	// A lone unsharded Check/CheckN: DecideOne, D1 answers from the row as read (txlimit_written_v1 or a refusal).
	"check/granted",
	"check/reserved",
	"check/refused",

	// A lone sharded Limit/LimitN (or LimitMany of one): DecideOne, D1 after txlimit_steer took the
	// first candidate. rc: both picks read; tx: the second read only when the first cannot serve alone.
	"sharded/rc/refused",                 // D1's plan refuses: answered from it, nothing locked
	"sharded/rc/first/granted",           // D1: the first pick charged alone, locked (SKIP LOCKED) and written
	"sharded/rc/first/reserved",          // the same, below zero
	"sharded/rc/first/created-granted",   // D1: the first pick to charge is missing: DV on both picks creates it
	"sharded/rc/first/created-reserved",  //
	"sharded/rc/second/granted",          // D1: the second pick charged alone, locked and written
	"sharded/rc/second/reserved",         //
	"sharded/rc/second/created-granted",  // D1: the second pick missing: DV creates it
	"sharded/rc/second/created-reserved", //
	"sharded/rc/both/granted",            // D1: a charge of both picks goes to DV
	"sharded/rc/both/reserved",           //
	"sharded/rc/both/created-granted",    // DV creates a missing pick
	"sharded/rc/both/created-reserved",   //
	"sharded/tx/refused",                 // D1's plan, both picks read, refuses
	"sharded/tx/first/granted",           // D1: the first pick serves alone, the second never read; locked and written
	"sharded/tx/first/reserved",          // D1: the first cannot serve, both read, the fuller (first) charged below zero
	"sharded/tx/first/created-granted",   // D1: the first serves alone but is missing: DV on it alone creates it
	"sharded/tx/first/created-reserved",  // D1: both read, the first (missing) charged below zero: DV on both
	"sharded/tx/second/granted",          // D1: the first cannot serve, the second read and charged alone
	"sharded/tx/second/reserved",         //
	"sharded/tx/second/created-granted",  // the second missing: DV creates it
	"sharded/tx/second/created-reserved", //
	"sharded/tx/both/granted",            // D1: both read, combined: DV
	"sharded/tx/both/reserved",           //
	"sharded/tx/both/created-granted",    //
	"sharded/tx/both/created-reserved",   //

	// A lone sharded Check/CheckN: DecideOne, D1 (no steering, nothing locked).
	"sharded-check/rc/first",    // D1 hands both picks to DV (dry): the first charged alone
	"sharded-check/rc/second",   //
	"sharded-check/rc/both",     //
	"sharded-check/rc/reserved", // DV: granted below zero
	"sharded-check/rc/refused",  //
	"sharded-check/tx/first",    // D1: the first pick serves alone, answered from its read, the second never read
	"sharded-check/tx/second",   // D1: the first cannot serve: DV on both picks
	"sharded-check/tx/both",     //
	"sharded-check/tx/reserved", //
	"sharded-check/tx/refused",  //

	// Lists (LimitMany/CheckMany of 2+, a Batcher's batch, fzOpList): engine.go:decideList sends Decide, DV.
	"list/alone/written-granted",      // ALONE: a fast request (engine.go:decideList) written by its one UPDATE
	"list/alone/written-reserved",     // ALONE's UPDATE writes below zero (it takes the allowance)
	"list/alone/refused",              // ALONE: not written, refused on its row as read
	"list/alone/missing-row",          // ALONE: its row missing: planned by DV, which creates it
	"list/alone/missing-row-tried",    // the same, its row sorting before one ALONE found: DV only tries it (txlimit_lock_row's p_try), creates it
	"list/all-alone-written",          // DV: every request fast and written: answered from ALONE's writes
	"list/alone-no-plan",              // DV: every request fast and decided by ALONE (some refused): txlimit_answers, no plan
	"list/plan/granted",               // DV: planned, locked, decided, written
	"list/plan/reserved",              //
	"list/plan/created-granted",       // DV: txlimit_lock_row creates a missing row
	"list/plan/created-reserved",      //
	"list/plan/refused",               // DV: the rules refuse it: its group takes no lock
	"list/plan/denied",                // DV: the rules grant it but its group is refused: nothing written
	"list/plan/check-granted",         // DV: a Check (dry), planned only
	"list/plan/check-reserved",        //
	"list/plan/check-refused",         //
	"list/plan/sharded-first",         // DV: txlimit_charge charges a sharded request's first pick alone
	"list/plan/sharded-second",        //
	"list/plan/sharded-both",          //
	"list/plan/after-an-earlier-call", // DV: its row as a call granted before it in the list left it (w_val)

	// Beside the branch: the kind (txlimit_level, txlimit_retry_at step by 1 µs or by windows) ...
	"kind/token-bucket/granted",
	"kind/token-bucket/reserved",
	"kind/token-bucket/refused",
	"kind/fixed-window/granted",
	"kind/fixed-window/reserved",
	"kind/fixed-window/refused",
	// ... and a key decided under a config other than the one it was last charged under
	// (docs/spec.md §1, §4, §8: rows read with the call's config).
	"config-change/capacity",
	"config-change/period",
	"config-change/shards",
	"config-change/start",
	"config-change/kind",
}

// TestFuzzSeedsCoverEveryShape runs the committed seed corpus (every file of
// testdata/fuzz/FuzzModel) as FuzzModel does, with fzShapes naming each decision, and fails
// naming every shape of fzShapeList no seed reaches (and any shape the list lacks).
//
//	go test ./ratelimit -count=1 -p 1 -run TestFuzzSeedsCoverEveryShape -v   # -v: each shape's count
func TestFuzzSeedsCoverEveryShape(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "fuzz", "FuzzModel", "*"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no seed corpus: %v", err)
	}
	pool := testdb.Pool(t, &testdb.Options{MaxConns: 2})
	resetter, err := ratelimit.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	shapes := map[string]int{}
	touched := map[[2]string]bool{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		lit, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "go test fuzz v1\n[]byte(")
		data, err := strconv.Unquote(strings.TrimSuffix(lit, ")"))
		if !ok || err != nil {
			t.Fatalf("%s: not one []byte: %v", f, err)
		}
		t.Run(filepath.Base(f), func(t *testing.T) {
			for nk := range touched {
				if err := resetter.Reset(context.Background(), pool, nk[0], nk[1]); err != nil {
					t.Fatalf("reset %q/%q: %v", nk[0], nk[1], err)
				}
				delete(touched, nk)
			}
			fzRun(t, pool, []byte(data), touched, "", shapes)
		})
	}
	var missing []string
	for _, s := range fzShapeList {
		t.Logf("%5d %s", shapes[s], s)
		if shapes[s] == 0 {
			missing = append(missing, s)
		}
		delete(shapes, s)
	}
	for s := range shapes {
		t.Errorf("shape %q is not in fzShapeList", s)
	}
	if len(missing) > 0 {
		t.Errorf("no seed reaches %d of %d shapes:\n  %s", len(missing), len(fzShapeList), strings.Join(missing, "\n  "))
	}
}

// A list of one request (an input may end inside an fzOpList) is decided as a lone call
// (engine.go:decideCalls sends it to decideOne), not by the road for lists: fzShapes names
// DecideOneRow's branch.
func TestFuzzShapesListOfOneIsLone(t *testing.T) {
	data := fzNewSeed(0, fzC(ratelimit.TokenBucket, 2, time.Second, 5, inf, 1, 0, 0)).op(fzOpList, 0, fzQ("a", 0, 1)).b
	shapes := map[string]int{}
	fzRun(t, testdb.Pool(t, &testdb.Options{MaxConns: 2}), data, map[[2]string]bool{}, "", shapes)
	if shapes["one-row/rc/created-granted"] != 1 {
		t.Errorf("a list of one request on a missing row: shapes %v, want one-row/rc/created-granted", shapes)
	}
	for s := range shapes {
		if strings.HasPrefix(s, "list/") {
			t.Errorf("a list of one request named %q: it is not decided by the road for lists", s)
		}
	}
}

// The seed corpus: each seed is a scenario written with the encoder below, so that it reads as
// what it tests. The same seeds are committed under testdata/fuzz/FuzzModel (TestFuzzModelCorpus
// keeps the files in step; run it with TXLIMIT_WRITE_FUZZ_CORPUS=1 to rewrite them).

type fzSeed struct {
	name string
	data []byte
}

func fzIndex[T comparable](table []T, v T) int {
	for i, x := range table {
		if x == v {
			return i
		}
	}
	panic(fmt.Sprintf("fuzz seed: %v is not in the table", v))
}

// fzC encodes a config. start: 0 hashed phase, 2 Start at the base plus param seconds, 3 Start
// param·7µs after the epoch (fixed window only).
func fzC(kind ratelimit.Kind, rate float64, period time.Duration, capacity, maxRes float64, shards int, start, param byte) [4]byte {
	return [4]byte{
		byte(kind) | byte(fzIndex(fzRates, rate))<<1 | byte(fzIndex(fzPeriods, period))<<4,
		byte(fzIndex(fzCaps, capacity)) | byte(fzIndex(fzMaxRes, maxRes))<<4,
		byte(shards-1) | start<<2,
		param,
	}
}

type fzQOpt func(q *[3]byte)

func fzReserve(q *[3]byte) { q[0] |= 128 }
func fzThrow(q *[3]byte)   { q[0] |= 64 }
func fzInline(q *[3]byte)  { q[0] |= 16 }

// fzSwap passes the next name's config inline (fzReq.swap); its picks must not be 15.
func fzSwap(q *[3]byte) { q[0] |= 0x30 }

// fzPicks makes the shard picker choose a then b of n shards.
func fzPicks(n, a, b int) fzQOpt {
	return func(q *[3]byte) { q[2] = byte(a) | byte((b-a-1+n)%n)<<4 }
}

// fzBadConfig passes fzBadConfigs[i] inline.
func fzBadConfig(i int) fzQOpt {
	return func(q *[3]byte) { q[0] |= 0x30; q[1] = q[1]&31 | byte(i)<<5; q[2] |= 15 }
}

// fzBadKey uses fzBadKeys[i] as the key.
func fzBadKey(i int) fzQOpt {
	return func(q *[3]byte) { q[0] |= 3 << 2; q[1] |= 7 << 5; q[2] = q[2]&15 | byte(i)<<4 }
}

// fzQ encodes a request on limit name ("a", "b", "c", "x") and key index.
func fzQ(name string, key int, count float64, opts ...fzQOpt) [3]byte {
	q := [3]byte{byte(fzIndex(fzNames, name)) | byte(key)<<2, 17} // 17: NaN, which equals nothing
	if !math.IsNaN(count) {
		q[1] = byte(fzIndex(fzCounts, count))
	}
	for _, o := range opts {
		o(&q)
	}
	return q
}

type fzSeedBuilder struct{ b []byte }

func fzNewSeed(base uint16, cfgs ...[4]byte) *fzSeedBuilder {
	s := &fzSeedBuilder{}
	for i := 0; i < 3; i++ {
		c := fzC(ratelimit.TokenBucket, 1, time.Second, 0, inf, 1, 0, 0)
		if i < len(cfgs) {
			c = cfgs[i]
		}
		s.b = append(s.b, c[:]...)
	}
	s.b = append(s.b, byte(base), byte(base>>8))
	return s
}

// op appends an operation after a time step of dt µs.
func (s *fzSeedBuilder) op(code byte, dt int64, reqs ...[3]byte) *fzSeedBuilder {
	s.b = append(s.b, code, byte(fzIndex(fzSteps, dt)))
	for _, q := range reqs {
		s.b = append(s.b, q[:]...)
	}
	return s
}

func fzSeeds() []fzSeed {
	const (
		tb = ratelimit.TokenBucket
		fw = ratelimit.FixedWindow
		s  = 1000000
	)
	sec, minute := time.Second, time.Minute
	return []fzSeed{
		{"refill_with_cap", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 5)).          // docs/spec.md §3: 5 of cap 5
			op(fzOpLimit, 0, fzQ("a", 0, 1)).          // denied, RetryAt +0.5s
			op(fzOpLimit, 500000, fzQ("a", 0, 1)).     // exactly refilled
			op(fzOpValue, 3600000000, fzQ("a", 0, 1)). // capped at 5, not 7200
			op(fzOpLimit, 0, fzQ("a", 0, 5)).          // all of it again
			op(fzOpCheck, 999999, fzQ("a", 0, 2)).     // 1.999998: denied
			op(fzOpCheck, 1, fzQ("a", 0, 2)).          // 2: granted
			op(fzOpLimit, 10000000, fzQ("a", 0, 6)).   // above capacity: argument error
			op(fzOpValue, 0, fzQ("a", 0, 1)).b},
		{"partial_consumption", fzNewSeed(7, fzC(tb, 3, minute, 2, inf, 1, 0, 0), fzC(tb, 0.5, 1500*time.Millisecond, 0.75, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 1, 0.1)).
			op(fzOpLimit, 1, fzQ("a", 1, 0.3)).
			op(fzOpLimit, 7, fzQ("a", 1, 1.0/3)).
			op(fzOpLimit, 999, fzQ("a", 1, 2.0/3)).
			op(fzOpLimit, 1000, fzQ("a", 1, 0.7)).
			op(fzOpCheck, 0, fzQ("a", 1, 0.25)).
			op(fzOpLimit, 333333, fzQ("b", 2, 0.25)).
			op(fzOpLimit, 0, fzQ("b", 2, 0.5)).
			op(fzOpLimit, 100000, fzQ("b", 2, 1e-7)).
			op(fzOpValue, 123456, fzQ("a", 1, 1)).
			op(fzOpValue, 0, fzQ("b", 2, 1)).b},
		{"fixed_window_rollover", fzNewSeed(3, fzC(fw, 3, 10*sec, 5, inf, 1, 0, 0), fzC(fw, 2, sec, 0, inf, 1, 2, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 5)). // docs/spec.md §4: at most cap per window
			op(fzOpLimit, 1000000, fzQ("a", 0, 1)).
			op(fzOpLimit, 10000000, fzQ("a", 0, 3)). // one window later: min(0+3, 5)
			op(fzOpLimit, 0, fzQ("a", 0, 0.5)).
			op(fzOpValue, 30000000, fzQ("a", 0, 1)). // three more: capped at 5
			op(fzOpLimit, 0, fzQ("b", 1, 2)).        // grid anchored at Start
			op(fzOpLimit, 999999, fzQ("b", 1, 1)).
			op(fzOpLimit, 1, fzQ("b", 1, 1)).
			op(fzOpLimit, 1000000, fzQ("b", 1, 2)).
			op(fzOpCheck, 999999, fzQ("b", 1, 1)).b},
		{"reservations", fzNewSeed(11, fzC(tb, 1, sec, 0, inf, 1, 0, 0), fzC(tb, 2, sec, 0, 3, 1, 0, 0), fzC(fw, 10, minute, 0, 5, 1, 0, 0)).
			op(fzOpReserve, 0, fzQ("a", 0, 3)).     // unbounded: -2, RetryAt +2s
			op(fzOpReserve, 0, fzQ("a", 0, 20)).    // -22, RetryAt +22s
			op(fzOpCheck, 1000000, fzQ("a", 0, 1)). // still in debt
			op(fzOpReserve, 0, fzQ("b", 0, 5)).     // bounded by 3: -3 granted
			op(fzOpReserve, 0, fzQ("b", 0, 0.5)).   // -3.5: denied
			op(fzOpReserve, 0, fzQ("b", 0, 6)).     // above cap+MaxReserved: argument error
			op(fzOpReserve, 250000, fzQ("b", 0, 0.5)).
			op(fzOpReserve, 0, fzQ("c", 2, 12)).  // fixed window: RetryAt one window on
			op(fzOpReserve, 0, fzQ("c", 2, 3)).   // debt 5: RetryAt one window on
			op(fzOpReserve, 0, fzQ("c", 2, 0.1)). // debt 5.1: denied
			op(fzOpValue, 60000000, fzQ("c", 2, 1)).b},
		{"time_backwards", fzNewSeed(5, fzC(tb, 10, sec, 0, inf, 1, 0, 0), fzC(fw, 2, sec, 0, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 10)).
			op(fzOpLimit, -500000, fzQ("a", 0, 1)). // docs/spec.md §2: evaluated at ts, no refill
			op(fzOpReserve, -1000000, fzQ("a", 0, 2)).
			op(fzOpLimit, 3000000, fzQ("a", 0, 1)).
			op(fzOpLimit, 0, fzQ("b", 1, 2)).
			op(fzOpLimit, -3600000000, fzQ("b", 1, 1)). // the window does not move back
			op(fzOpCredit, -1, fzQ("b", 1, 0.5)).
			op(fzOpValue, 0, fzQ("b", 1, 1)).
			op(fzOpValue, 3600000000, fzQ("a", 0, 1)).b},
		{"sharded_combine", fzNewSeed(9, fzC(tb, 10, sec, 0, inf, 2, 0, 0), fzC(tb, 10, sec, 20, inf, 4, 0, 0), fzC(fw, 100, sec, 0, inf, 3, 3, 5)).
			op(fzOpLimit, 0, fzQ("a", 0, 4, fzPicks(2, 0, 1))). // shard 0 to 1
			op(fzOpLimit, 0, fzQ("a", 0, 7, fzPicks(2, 1, 0))). // docs/spec.md §8: both, ending at (5+1-7)/2
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzPicks(2, 0, 1))).
			op(fzOpReserve, 100000, fzQ("a", 0, 3, fzPicks(2, 1, 0))).
			op(fzOpValue, 0, fzQ("a", 0, 1)).
			op(fzOpLimit, 0, fzQ("b", 1, 5, fzPicks(4, 3, 1))).
			op(fzOpLimit, 0, fzQ("b", 1, 5, fzPicks(4, 2, 3))).
			op(fzOpLimit, 0, fzQ("b", 1, 8, fzPicks(4, 3, 2))).
			op(fzOpCheck, 0, fzQ("b", 1, 10, fzPicks(4, 3, 0))). // denied, |5-0| > ... one shard alone
			op(fzOpLimit, 0, fzQ("c", 2, 50, fzPicks(3, 2, 0))).
			op(fzOpLimit, 0, fzQ("c", 2, 50, fzPicks(3, 2, 1))).
			op(fzOpLimit, 500000, fzQ("c", 2, 20, fzPicks(3, 0, 2))).
			op(fzOpCredit, 0, fzQ("b", 1, 7)).
			op(fzOpValue, 1000000, fzQ("b", 1, 1)).b},
		{"multi_limit_denial", fzNewSeed(13, fzC(tb, 1, sec, 0, inf, 1, 0, 0), fzC(fw, 2, 10*sec, 0, inf, 2, 0, 0), fzC(tb, 3, sec, 0, inf, 1, 0, 0)).
			op(fzOpMany, 0, fzQ("a", 0, 1), fzQ("b", 0, 1, fzPicks(2, 0, 1))).
			op(fzOpMany, 0, fzQ("a", 0, 0.5), fzQ("b", 0, 1, fzPicks(2, 1, 0))). // a denied: nothing written
			op(fzOpMany|fzBit4, 250000, fzQ("c", 1, 1), fzQ("b", 0, 0.5, fzPicks(2, 1, 0)), fzQ("a", 0, 0.5)).
			op(fzOpCheckMany, 0, fzQ("a", 0, 0.5), fzQ("c", 1, 1)).
			op(fzOpMany, 0, fzQ("a", 0, 1, fzThrow), fzQ("c", 1, 3)). // throws, names both
			op(fzOpMany, 0, fzQ("a", 0, 1), fzQ("a", 0, 1)).          // duplicate: argument error
			op(fzOpMany, 1000000, fzQ("c", 1, 2, fzReserve), fzQ("a", 0, 2, fzReserve)).
			op(fzOpValue, 0, fzQ("a", 0, 1)).
			op(fzOpValue, 0, fzQ("c", 1, 1)).b},
		{"credit_after_reservation", fzNewSeed(17, fzC(tb, 2, sec, 5, 10, 1, 0, 0), fzC(tb, 10, minute, 0, inf, 3, 0, 0), fzC(fw, 7, 3*sec, 0, inf, 1, 0, 0)).
			op(fzOpReserve, 0, fzQ("a", 0, 12)). // -7
			op(fzOpCredit, 0, fzQ("a", 0, 3)).   // LLM settle: -4
			op(fzOpCredit, 0, fzQ("a", 0, 20)).  // never above cap: 5
			op(fzOpReserve, 250000, fzQ("a", 0, 15)).
			op(fzOpCredit, 0, fzQ("a", 0, 0.1)).
			op(fzOpReserve, 0, fzQ("b", 1, 5, fzPicks(3, 0, 1))).
			op(fzOpReserve, 0, fzQ("b", 1, 5, fzPicks(3, 0, 2))).
			op(fzOpCredit, 0, fzQ("b", 1, 4)). // emptiest shard first; shard 1 is missing: full
			op(fzOpCredit, 0, fzQ("b", 1, 2)).
			op(fzOpReserve, 0, fzQ("c", 2, 10)).
			op(fzOpCredit, 1000000, fzQ("c", 2, 2.5)).
			op(fzOpValue, 0, fzQ("c", 2, 1)).
			op(fzOpCredit, 0, fzQ("x", 0, 1)). // unknown name without config
			op(fzOpValue, 0, fzQ("b", 1, 1)).b},
		{"invalid_inputs", fzNewSeed(19, fzC(tb, 1, sec, 0, inf, 1, 0, 0), fzC(tb, 1, sec, 0, inf, 2, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, -1)).
			op(fzOpLimit, 0, fzQ("a", 0, math.NaN())).
			op(fzOpLimit, 0, fzQ("a", 0, math.Inf(1))).
			op(fzOpLimit, 0, fzQ("a", 0, 1e16)).
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzBadKey(0))).
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzBadKey(1))).
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzBadKey(2))).
			op(fzOpLimit, 0, fzQ("x", 0, 1)).
			op(fzOpLimit, 0, fzQ("x", 0, 1, fzInline)).
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzBadConfig(0))).
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzBadConfig(3))).
			op(fzOpLimit, 0, fzQ("a", 0, 1, fzBadConfig(7))).
			op(fzOpCredit, 0, fzQ("a", 0, 0)).
			op(fzOpLimit, 0, fzQ("b", 0, 1.5, fzPicks(2, 0, 1))). // two shards hold 1 together: 1.5 is an error
			op(fzOpResetCredit|fzBit4, 0, fzQ("x", 0, 1)).
			op(fzOpLimit1, 0, fzQ("a", 0, 1)).
			op(fzOpThrow, 0, fzQ("a", 0, 1)).
			op(fzOpValue, 0, fzQ("a", 0, 1)).b},
		{"retryat_overshoot", fzNewSeed(0, fzC(tb, 1, 24*time.Hour, 0, inf, 1, 0, 0)).
			op(fzOpReserve, 50000, fzQ("a", 0, 20)). // -19
			op(fzOpLimit, 200, fzQ("a", 0, 1)).b},   // paid when -19 + 20 days·(1/day) - 1 = 0
		{"throw_many_with_reservation", fzNewSeed(0, fzC(tb, 1, time.Second, 0, inf, 1, 0, 0), fzC(tb, 3, time.Second, 0, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("b", 0, 3)).                                       // b empty
			op(fzOpMany, 0, fzQ("a", 0, 5, fzReserve, fzThrow), fzQ("b", 0, 1)).b}, // a alone: reserved, RetryAt +4s; b denied, RetryAt +1/3s
		// Lists, as a batch decides them: several calls on one key in list order (a later small
		// request granted after a larger one is denied), sharded and unsharded limits mixed,
		// reservations, an all-or-nothing group and a Check in the same statement.
		{"list_one_key_in_order", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 4), fzQ("a", 0, 3), fzQ("a", 0, 1)).
			op(fzOpList|fzBit4|fzBit5, 500000, fzQ("a", 0, 1), fzQ("a", 0, 1), fzQ("a", 0, 2)).b},
		{"list_mixed_shards", fzNewSeed(3, fzC(tb, 10, sec, 20, inf, 4, 0, 0), fzC(tb, 2, sec, 5, 3, 1, 0, 0), fzC(fw, 3, 10*sec, 5, 2, 3, 0, 0)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 7, fzPicks(4, 0, 1)), fzQ("b", 0, 4), fzQ("a", 0, 5, fzPicks(4, 1, 0))).
			op(fzOpList|fzBit4|fzBit6, 1000, fzQ("a", 0, 6, fzPicks(4, 0, 1)), fzQ("b", 0, 2), fzQ("c", 1, 2, fzPicks(3, 2, 0))).
			op(fzOpList|fzBit4|fzBit5, 0, fzQ("c", 1, 3, fzPicks(3, 2, 1)), fzQ("c", 1, 2, fzPicks(3, 0, 1)), fzQ("a", 0, 1, fzPicks(4, 2, 3))).b},
		{"list_reservations", fzNewSeed(5, fzC(tb, 2, sec, 5, 3, 1, 0, 0), fzC(fw, 3, 10*sec, 5, 2, 2, 0, 0)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 5), fzQ("a", 0, 3, fzReserve), fzQ("a", 0, 1, fzReserve)).
			op(fzOpList|fzBit4|fzBit6, 0, fzQ("b", 1, 5, fzReserve, fzPicks(2, 0, 1)), fzQ("a", 0, 0.5, fzReserve), fzQ("b", 1, 1, fzReserve, fzPicks(2, 1, 0))).
			op(fzOpList, 250000, fzQ("a", 0, 1, fzReserve), fzQ("a", 0, 0.5)).b},
		// A list of lone unsharded calls (the lean loop): a run of identical refusals (each searches its RetryAt),
		// then a smaller call granted; a reservation, then identical refused ones.
		{"list_lean_refusal_runs", fzNewSeed(0, fzC(fw, 2, sec, 0, 5, 1, 0, 0), fzC(tb, 3, sec, 0, inf, 1, 0, 0)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 3), fzQ("a", 0, 3), fzQ("a", 0, 1)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 3, fzReserve), fzQ("a", 0, 3, fzReserve), fzQ("a", 0, 3, fzReserve)).
			op(fzOpList|fzBit4|fzBit5, 333333, fzQ("b", 0, 2), fzQ("a", 0, 1), fzQ("b", 0, 2)).b},
		// A list of calls alone on their rows: created (missing rows go the whole road), then all
		// written by the one UPDATE and answered from it, then one refused on its row as read while
		// the others are written.
		{"list_alone_written", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 1), fzQ("a", 1, 2), fzQ("a", 2, 3)).
			op(fzOpList|fzBit4, 1000, fzQ("a", 0, 1), fzQ("a", 1, 2), fzQ("a", 2, 1)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 1), fzQ("a", 1, 5), fzQ("a", 2, 0.5)).b},
		// Decisions in SERIALIZABLE transactions: an unsharded row missing, then written by
		// txlimit_decide_one_v1's UPDATE, refused, reserved, checked; a sharded Limit whose first
		// pick serves alone (missing, then existing: the second pick is never read), then one only
		// the second pick serves; LimitMany of one request (a lone call) and of two.
		{"serializable", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0), fzC(tb, 10, sec, 20, inf, 4, 0, 0)).
			op(fzOpLimit|fzBitTx, 0, fzQ("a", 0, 2)).
			op(fzOpLimit|fzBitTx, 1000, fzQ("a", 0, 2)).
			op(fzOpLimit|fzBitTx, 0, fzQ("a", 0, 3)).
			op(fzOpReserve|fzBitTx, 0, fzQ("a", 0, 3)).
			op(fzOpCheck|fzBitTx, 0, fzQ("a", 0, 1)).
			op(fzOpLimit|fzBitTx, 0, fzQ("b", 0, 2, fzPicks(4, 0, 1))).
			op(fzOpLimit|fzBitTx, 0, fzQ("b", 0, 3, fzPicks(4, 0, 1))).
			op(fzOpLimit|fzBitTx, 0, fzQ("b", 0, 5, fzPicks(4, 0, 1))).
			op(fzOpMany|fzBitTx, 0, fzQ("a", 1, 1), fzQ("b", 1, 4, fzPicks(4, 2, 3))).
			op(fzOpMany|fzBitTx, 0, fzQ("b", 2, 4, fzPicks(4, 2, 3))).b}, // last: a list of one request
		{"credit_without_rows", fzNewSeed(0, fzC(tb, 1, time.Hour, 0, inf, 2, 0, 0)).
			op(fzOpCredit, 50000, fzQ("a", 0, 100)).b},
		// Config changes (fzSwap: the next name's config inline): a row is read with the config of
		// each call (docs/spec.md §1), capped at the new capacity, with the new MaxReserved.
		{"config_change_capacity", fzNewSeed(0, fzC(tb, 10, sec, 20, inf, 1, 0, 0), fzC(tb, 10, sec, 2, 0, 1, 0, 0), fzC(tb, 10, sec, 0, 1, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 5)).                    // 15 of 20
			op(fzOpValue, 0, fzQ("a", 0, 1, fzSwap)).            // read with capacity 2: 2
			op(fzOpLimit, 0, fzQ("a", 0, 2, fzSwap)).            // 0
			op(fzOpLimit, 100000, fzQ("a", 0, 1)).               // back to 20: refilled from 0
			op(fzOpReserve, 0, fzQ("a", 0, 3, fzSwap)).          // MaxReserved 0 there: argument error
			op(fzOpReserve, 0, fzQ("a", 0, 5)).                  // Unbounded: -5
			op(fzOpCheck, 0, fzQ("a", 0, 1, fzSwap)).            // in debt under capacity 2 too
			op(fzOpReserve, 0, fzQ("c", 2, 33, fzSwap)).         // capacity 20, Unbounded: -13
			op(fzOpReserve, 0, fzQ("c", 2, 1)).                  // MaxReserved 1: refused until the debt fits
			op(fzOpLimit, 1500000, fzQ("c", 2, 1)).              // -13 + 15 = 2
			op(fzOpCredit, 0, fzQ("c", 2, 50, fzSwap)).          // up to 20
			op(fzOpValue, 0, fzQ("c", 2, 1)).                    // read with capacity 10
			op(fzOpLimit, 0, fzQ("b", 1, 2)).                    // b's 2: 0
			op(fzOpCheckReserve, 0, fzQ("b", 1, 10, fzSwap)).b}, // c's: 0 + 1 bounded debt
		// docs/spec.md §4: a row written under another Period or Start, or by a token bucket,
		// keeps counting windows from its own ts.
		{"config_change_window_grid", fzNewSeed(29, fzC(fw, 2, 10*sec, 0, inf, 1, 0, 0), fzC(fw, 2, 3*sec, 5, inf, 1, 2, 1), fzC(tb, 2, sec, 0, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 2)).               // 0 at the start of a's hashed window
			op(fzOpLimit, 2000000, fzQ("a", 0, 1, fzSwap)). // 3 s windows from that ts
			op(fzOpCheck, 1000000, fzQ("a", 0, 2, fzSwap)).
			op(fzOpLimit, 3000000, fzQ("a", 0, 1)). // 10 s windows from the row's ts
			op(fzOpReserve, 0, fzQ("a", 0, 4, fzSwap)).
			op(fzOpValue, 10000000, fzQ("a", 0, 1)).
			op(fzOpValue, 0, fzQ("a", 0, 1, fzSwap)).
			op(fzOpLimit, 0, fzQ("c", 1, 2)).                // a token bucket row at now
			op(fzOpLimit, 7000000, fzQ("c", 1, 1, fzSwap)).  // read as a 10 s window from its ts: denied
			op(fzOpLimit, 3000000, fzQ("c", 1, 1, fzSwap)).  // one window later
			op(fzOpLimit, 1000, fzQ("c", 1, 2)).             // a token bucket again, from the window's start
			op(fzOpLimit, -1500000, fzQ("c", 1, 1, fzSwap)). // time backwards under the other kind
			op(fzOpResetCredit|fzBit4, 0, fzQ("c", 1, 1)).
			op(fzOpLimit, 0, fzQ("c", 1, 2, fzSwap)). // missing: full at the start of a's grid for c
			op(fzOpValue, 0, fzQ("c", 1, 1)).b},
		// docs/spec.md §8: changing Shards reads every row with the new per-shard numbers, missing
		// shards full, rows of shards >= N ignored until Reset.
		{"config_change_shards", fzNewSeed(31, fzC(tb, 10, sec, 20, inf, 4, 0, 0), fzC(tb, 10, sec, 20, inf, 2, 0, 0), fzC(tb, 10, sec, 20, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 0, 5, fzPicks(4, 3, 2))).          // shard 3 to 0
			op(fzOpLimit, 0, fzQ("a", 0, 4, fzPicks(4, 2, 1))).          // shard 2 to 1
			op(fzOpLimit, 0, fzQ("a", 0, 8, fzPicks(4, 1, 0))).          // both to 1
			op(fzOpValue, 0, fzQ("a", 0, 1, fzSwap)).                    // 2 shards of 10: 1 + 1
			op(fzOpLimit, 0, fzQ("a", 0, 15, fzSwap, fzPicks(2, 0, 1))). // denied
			op(fzOpLimit, 1000000, fzQ("a", 0, 12, fzSwap, fzPicks(2, 1, 0))).
			op(fzOpCredit, 0, fzQ("a", 0, 20, fzSwap)). // shards 0 and 1 only
			op(fzOpValue, 0, fzQ("a", 0, 1)).           // 4 shards: capped at 5 each
			op(fzOpReserve, 0, fzQ("a", 0, 10, fzPicks(4, 2, 3))).
			op(fzOpLimit, 0, fzQ("b", 1, 15, fzPicks(2, 0, 1))). // 2.5 each
			op(fzOpLimit, 0, fzQ("b", 1, 3, fzSwap)).            // 1 shard: shard 1 ignored
			op(fzOpValue, 0, fzQ("b", 1, 1, fzSwap)).
			op(fzOpCredit, 0, fzQ("b", 1, 20, fzSwap)).
			op(fzOpValue, 0, fzQ("b", 1, 1)).
			op(fzOpResetCredit|fzBit4, 0, fzQ("a", 0, 1)).
			op(fzOpValue, 0, fzQ("a", 0, 1, fzSwap)).b},
		// Sharded Checks with Reserve, and sharded calls in SERIALIZABLE transactions: a Check
		// whose first pick serves alone, one that reads the second, a lone Limit (count 1), a
		// denial as an error; fixed windows too, and time going back.
		{"sharded_checks_in_tx", fzNewSeed(37, fzC(tb, 10, sec, 20, 10, 4, 0, 0), fzC(fw, 3, 10*sec, 5, 2, 3, 0, 0)).
			op(fzOpCheckReserve, 0, fzQ("a", 0, 12, fzPicks(4, 0, 1))). // both fresh: -1 each
			op(fzOpReserve, 0, fzQ("a", 0, 12, fzPicks(4, 0, 1))).
			op(fzOpCheckReserve, 0, fzQ("a", 0, 4, fzPicks(4, 0, 2))).         // shard 2 alone
			op(fzOpCheck|fzBitTx, 1000, fzQ("a", 0, 3, fzPicks(4, 2, 0))).     // the first pick alone
			op(fzOpCheck|fzBitTx, 0, fzQ("a", 0, 6, fzPicks(4, 2, 0))).        // reads the second: denied
			op(fzOpCheckReserve|fzBitTx, 0, fzQ("a", 0, 6, fzPicks(4, 2, 0))). // reserved
			op(fzOpThrow, 0, fzQ("a", 0, 9, fzPicks(4, 1, 0))).
			op(fzOpLimit1|fzBitTx, 0, fzQ("a", 0, 1, fzPicks(4, 3, 1))).
			op(fzOpReserve|fzBitTx, -1000, fzQ("a", 0, 7, fzPicks(4, 0, 3))).
			op(fzOpReserve, 0, fzQ("b", 1, 4, fzPicks(3, 2, 0))).
			op(fzOpCheckReserve, 0, fzQ("b", 1, 4, fzPicks(3, 0, 2))).
			op(fzOpLimit|fzBitTx, 5000000, fzQ("b", 1, 3, fzPicks(3, 1, 2))).
			op(fzOpCheck|fzBitTx, -3000000, fzQ("b", 1, 2, fzPicks(3, 2, 0))).
			op(fzOpValue, 10000000, fzQ("b", 1, 1)).
			op(fzOpMany|fzBitTx, 0, fzQ("a", 1, 7, fzPicks(4, 1, 2))).b}, // a LimitMany of one sharded request
		// A list deciding one key under two configs, call after call (docs/spec.md §7): a fixed
		// window and a token bucket, then 4 shards and 1.
		{"list_config_change", fzNewSeed(41, fzC(fw, 3, 10*sec, 5, 2, 1, 2, 0), fzC(tb, 2, sec, 0, inf, 1, 0, 0), fzC(tb, 10, sec, 20, inf, 4, 0, 0)).
			op(fzOpList|fzBit4, 0, fzQ("a", 0, 4), fzQ("a", 0, 1, fzSwap), fzQ("a", 0, 1)).
			op(fzOpList|fzBit4|fzBit5, 500000, fzQ("a", 0, 2, fzReserve, fzSwap), fzQ("a", 0, 2, fzReserve), fzQ("a", 0, 1, fzSwap)).
			op(fzOpList|fzBit4, 0, fzQ("c", 1, 8, fzPicks(4, 3, 2)), fzQ("c", 1, 5, fzSwap, fzPicks(4, 0, 1)), fzQ("c", 1, 5, fzPicks(4, 1, 2))).
			op(fzOpList|fzBit4|fzBit6, 250000, fzQ("c", 1, 3, fzSwap, fzPicks(4, 1, 0)), fzQ("b", 1, 1), fzQ("c", 1, 4, fzPicks(4, 0, 3))).
			op(fzOpValue, 0, fzQ("c", 1, 1)).
			op(fzOpValue, 0, fzQ("c", 1, 1, fzSwap)).b},
		// Readings before the epoch: a fresh row refills from its first call on (its ts at the
		// reading, or its window's start), not from 1970; rows written in 2026 are decided at their
		// ts (docs/spec.md §2).
		{"before_the_epoch", fzNewSeed(43, fzC(tb, 10, sec, 0, 2, 1, 0, 0), fzC(fw, 2, 10*sec, 0, inf, 1, 0, 0), fzC(fw, 3, 250*time.Millisecond, 0, inf, 3, 3, 9)).
			op(fzOpLimit, 0, fzQ("a", 0, 10)).
			op(fzOpLimit, -1<<51, fzQ("a", 1, 10)).
			op(fzOpLimit, 100000, fzQ("a", 1, 1)).
			op(fzOpReserve, 0, fzQ("a", 1, 2)).
			op(fzOpLimit, 0, fzQ("a", 0, 1)). // written in 2026: no refill
			op(fzOpLimit, 0, fzQ("b", 1, 2)).
			op(fzOpLimit, 10000000, fzQ("b", 1, 1)).
			op(fzOpCheck, 0, fzQ("b", 1, 2)).
			op(fzOpLimit, 0, fzQ("c", 2, 2, fzPicks(3, 0, 1))).
			op(fzOpLimit, 250000, fzQ("c", 2, 1.5, fzPicks(3, 1, 2))).
			op(fzOpMany, 1, fzQ("c", 1, 1, fzPicks(3, 2, 0)), fzQ("b", 2, 2)).
			op(fzOpCredit, 0, fzQ("a", 1, 1)).
			op(fzOpValue, 0, fzQ("b", 1, 1)).
			op(fzOpLimit, 1<<51, fzQ("a", 1, 3)).
			op(fzOpValue, 0, fzQ("c", 2, 1)).b},
		// Seeds for shapes of the road no other seed reached (TestFuzzSeedsCoverEveryShape).
		// A bad inline config in a LimitMany group and in a list: a config error, nothing decided.
		{"invalid_config_in_groups", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0)).
			op(fzOpMany, 0, fzQ("a", 0, 1), fzQ("b", 0, 1, fzBadConfig(2))).
			op(fzOpList, 0, fzQ("a", 0, 1), fzQ("a", 1, 1, fzBadConfig(4))).
			op(fzOpValue, 0, fzQ("a", 0, 1)).b},
		// Reservations on each statement of an unsharded limit: a missing row reserved in a
		// SERIALIZABLE transaction (created by txlimit_decide_v1), a Check reserving, a list's request
		// alone on its row reserved by txlimit_alone's UPDATE, a CheckMany reserving.
		{"unsharded_reservations_each_statement", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0)).
			op(fzOpReserve|fzBitTx, 0, fzQ("a", 0, 7)).                 // -2
			op(fzOpCheckReserve, 0, fzQ("a", 1, 7)).                    // missing: would be -2
			op(fzOpList, 0, fzQ("a", 0, 1, fzReserve), fzQ("a", 1, 1)). // -3; created at 4
			op(fzOpCheckMany, 0, fzQ("a", 0, 1, fzReserve), fzQ("a", 1, 1)).b},
		// A list's request alone on its missing row, which sorts before a row another request alone
		// on it has (written by txlimit_alone's UPDATE, then refused on it as read): txlimit_decide_v1
		// only tries the missing row (txlimit_lock_row's p_try) and creates it.
		{"list_missing_row_tried", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0)).
			op(fzOpLimit, 0, fzQ("a", 1, 1)).                   // "k1" created at 4
			op(fzOpList, 0, fzQ("a", 0, 1), fzQ("a", 1, 1)).    // "" tried and created; "k1" written, 3
			op(fzOpResetCredit|fzBit4, 0, fzQ("a", 0, 1)).      // "" missing again
			op(fzOpList, 0, fzQ("a", 0, 2), fzQ("a", 1, 4)).b}, // "" tried and created; "k1" refused
		// One pick of a sharded limit charged alone below zero (the other too deep in debt to
		// combine with), first or second, existing or missing, under READ COMMITTED and in
		// SERIALIZABLE transactions; both combined there at zero or above; Checks there reading the
		// second pick. 4 shards of 2.5/s, cap 5.
		{"sharded_one_pick_reserved", fzNewSeed(0, fzC(tb, 2, sec, 5, inf, 1, 0, 0), fzC(tb, 10, sec, 20, inf, 4, 0, 0)).
			op(fzOpReserve, 0, fzQ("b", 1, 20, fzPicks(4, 0, 1))).               // -5, -5
			op(fzOpReserve, 0, fzQ("b", 1, 20, fzPicks(4, 2, 3))).               // -5, -5
			op(fzOpReserve, 4000000, fzQ("b", 1, 20, fzPicks(4, 0, 1))).         // all 5 again: 0 and 1 to -5
			op(fzOpLimit, 0, fzQ("b", 1, 2, fzPicks(4, 0, 2))).                  // -5 and 5: shard 2 alone, 3
			op(fzOpReserve, 0, fzQ("b", 1, 7, fzPicks(4, 2, 0))).                // 3 and -5: shard 2 alone, -4
			op(fzOpReserve, 0, fzQ("b", 1, 6, fzPicks(4, 1, 3))).                // -5 and 5: shard 3 alone, -1
			op(fzOpReserve, 0, fzQ("b", 2, 20, fzPicks(4, 0, 1))).               // a new key: -5, -5
			op(fzOpReserve, 0, fzQ("b", 2, 7, fzPicks(4, 2, 0))).                // shard 2 missing: alone, -2
			op(fzOpReserve, 0, fzQ("b", 2, 6, fzPicks(4, 1, 3))).                // shard 3 missing: alone, -1
			op(fzOpReserve|fzBitTx, 4000000, fzQ("b", 1, 20, fzPicks(4, 0, 1))). // all 5: -5, -5
			op(fzOpReserve|fzBitTx, 0, fzQ("b", 1, 7, fzPicks(4, 2, 0))).
			op(fzOpReserve|fzBitTx, 0, fzQ("b", 1, 6, fzPicks(4, 1, 3))).
			op(fzOpLimit|fzBitTx, 2000000, fzQ("b", 1, 6, fzPicks(4, 2, 3))). // 3 and 4: both, 0.5 each
			op(fzOpReserve|fzBitTx, 0, fzQ("b", 0, 20, fzPicks(4, 0, 1))).    // a new key
			op(fzOpReserve|fzBitTx, 0, fzQ("b", 0, 7, fzPicks(4, 2, 0))).
			op(fzOpReserve|fzBitTx, 0, fzQ("b", 0, 6, fzPicks(4, 1, 3))).
			op(fzOpCheck|fzBitTx, 2000000, fzQ("b", 0, 4, fzPicks(4, 0, 3))). // 0 and 4: the second alone
			op(fzOpCheck|fzBitTx, 0, fzQ("b", 0, 6, fzPicks(4, 2, 3))).b},    // 3 and 4: both
		{"reset_and_rows_appear", fzNewSeed(23, fzC(fw, 3, 250*time.Millisecond, 0, inf, 4, 0, 0), fzC(tb, 7, 7*time.Microsecond, 0, inf, 1, 0, 0)).
			op(fzOpMany|fzBit4, 0, fzQ("a", 0, 3, fzPicks(4, 0, 1)), fzQ("a", 1, 1.5, fzPicks(4, 2, 3)), fzQ("b", 0, 7)).
			op(fzOpResetCredit|fzBit4, 1, fzQ("a", 0, 1)).
			op(fzOpValue, 1, fzQ("a", 0, 1)).
			op(fzOpLimit, 2, fzQ("b", 0, 7)).
			op(fzOpLimit, 7, fzQ("b", 0, 2.5)).
			op(fzOpReserve, 1, fzQ("b", 0, 100)).
			op(fzOpLimit, 250000, fzQ("a", 1, 1.5, fzPicks(4, 3, 2))).b},
	}
}

// TestFuzzModelCorpus keeps testdata/fuzz/FuzzModel in step with fzSeeds.
func TestFuzzModelCorpus(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzModel")
	write := os.Getenv("TXLIMIT_WRITE_FUZZ_CORPUS") != ""
	if write {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range fzSeeds() {
		want := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", s.data)
		path := filepath.Join(dir, s.name)
		if write {
			if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil || string(got) != want {
			t.Errorf("%s is missing or stale (err %v): run TXLIMIT_WRITE_FUZZ_CORPUS=1 go test ./ratelimit -run TestFuzzModelCorpus", path, err)
		}
	}
}
