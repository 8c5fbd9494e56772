package ratelimit_test

// A reference model of txlimit, written from docs/spec.md and the package doc, not from the library's
// code: an in-memory map of (name, key, shard) -> (value, ts). FuzzModel (fuzz_test.go) replays
// random request sequences against it and against Postgres and requires identical answers.
//
// Floats: the model performs the same float8 operations in the same order as the SQL
// (txlimit_level, the decision and credit queries), so its results are bit-identical. Products
// are wrapped in float64(...) conversions, which the Go spec says must round, so the compiler
// cannot fuse a multiply and an add into one FMA.
//
// RetryAt (docs/spec.md §3/§4) is the first microsecond at which the same request would be granted
// (a refusal) or at which the charged rows are out of debt (a reservation), as the rules evaluate
// it in float8; see modelLimit.firstGrant, which searches the way txlimit_retry_at does.

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// modelRowKey identifies one row of txlimit_state.
type modelRowKey struct {
	name, key string
	shard     int
}

// modelRow is one row: the two numbers of docs/spec.md §1, ts in microseconds since the Unix epoch.
type modelRow struct {
	value float64
	ts    int64
}

// model is the whole state: a missing row is a full, untouched limit.
type model struct {
	rows map[modelRowKey]modelRow
}

func newModel() *model { return &model{rows: map[modelRowKey]modelRow{}} }

// modelLimit is a validated config resolved for one (name, key), in per-shard numbers (docs/spec.md §8).
type modelLimit struct {
	name, key string
	fixed     bool    // FixedWindow
	shards    int     // N >= 1
	rate      float64 // Rate/N
	cap       float64 // Capacity/N (Capacity defaults to Rate)
	maxRes    float64 // MaxReserved/N; +Inf for Unbounded
	noReserve bool    // MaxReserved is 0: a request with Reserve is an argument error
	periodUs  int64
	anchorUs  int64            // fixed window grid: windows start at anchorUs + k*periodUs; in (-periodUs, 0]
	inForce   ratelimit.Config // the config with its defaults applied (Result.Config)
}

// Model errors: the classes of typed error the library must return (docs/spec.md §5).
var (
	errModelConfig   = errors.New("model: config error")   // *ratelimit.ConfigError
	errModelArgument = errors.New("model: argument error") // *ratelimit.ArgumentError
	errModelUnknown  = errors.New("model: unknown limit")  // *ratelimit.UnknownLimitError
)

// modelValidate checks a config against docs/spec.md §5 and the documented bounds.
func modelValidate(c ratelimit.Config) error {
	amount := func(v float64, zeroOK bool) bool {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > ratelimit.MaxAmount {
			return false
		}
		return v >= ratelimit.MinAmount || (v == 0 && zeroOK)
	}
	switch {
	case c.Kind != ratelimit.TokenBucket && c.Kind != ratelimit.FixedWindow,
		!amount(c.Rate, false),
		c.Period <= 0, c.Period%time.Microsecond != 0, c.Period > ratelimit.MaxPeriod,
		!amount(c.Capacity, true),
		!amount(c.MaxReserved, true) && !math.IsInf(c.MaxReserved, 1),
		c.Shards < 0, c.Shards > ratelimit.MaxShards,
		!c.Start.IsZero() && c.Kind != ratelimit.FixedWindow:
		return errModelConfig
	}
	return nil
}

// modelCheckText checks a name or key: valid UTF-8, no NUL, at most maxLen bytes.
func modelCheckText(s string, maxLen int, emptyOK bool) error {
	if (s == "" && !emptyOK) || len(s) > maxLen || !utf8.ValidString(s) {
		return errModelArgument
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return errModelArgument
		}
	}
	return nil
}

// modelCheckCount checks a count: finite, at least MinAmount (10^-9), at most MaxAmount (10^15).
func modelCheckCount(n float64) error {
	if math.IsNaN(n) || math.IsInf(n, 0) || n < ratelimit.MinAmount || n > ratelimit.MaxAmount {
		return errModelArgument
	}
	return nil
}

// fnv1a is the 64-bit FNV-1a hash (offset basis 14695981039346656037, prime 1099511628211).
func fnv1a(parts ...[]byte) uint64 {
	h := uint64(14695981039346656037)
	for _, p := range parts {
		for _, c := range p {
			h ^= uint64(c)
			h *= 1099511628211
		}
	}
	return h
}

// modelResolve validates name, key and config and resolves them (doc.go "Fixed window grid").
func modelResolve(name, key string, cfg *ratelimit.Config) (modelLimit, error) {
	if err := modelCheckText(name, ratelimit.MaxNameLen, false); err != nil {
		return modelLimit{}, err
	}
	if err := modelCheckText(key, ratelimit.MaxKeyLen, true); err != nil {
		return modelLimit{}, err
	}
	if cfg == nil {
		return modelLimit{}, errModelUnknown
	}
	if err := modelValidate(*cfg); err != nil {
		return modelLimit{}, err
	}
	n := cfg.Shards
	if n == 0 {
		n = 1
	}
	capacity := cfg.Capacity
	if capacity == 0 {
		capacity = cfg.Rate
	}
	m := modelLimit{
		name: name, key: key,
		fixed:     cfg.Kind == ratelimit.FixedWindow,
		shards:    n,
		rate:      cfg.Rate / float64(n),
		cap:       capacity / float64(n),
		maxRes:    cfg.MaxReserved / float64(n),
		noReserve: cfg.MaxReserved == 0,
		periodUs:  int64(cfg.Period / time.Microsecond),
		inForce:   inForce(*cfg),
	}
	if m.fixed {
		if !cfg.Start.IsZero() {
			m.anchorUs = startMod(cfg.Start, m.periodUs)
		} else {
			m.anchorUs = int64(fnv1a([]byte(name), []byte{0}, []byte(key)) % uint64(m.periodUs))
		}
		if m.anchorUs > 0 {
			m.anchorUs -= m.periodUs // the grid's last start at or before the epoch: a missing row's stamp
		}
	}
	return m, nil
}

// startMod is start's microseconds since the Unix epoch modulo m, in [0, m), counted in a big.Int
// (UnixMicro wraps beyond about 292,000 years, and Config.Start may be any instant).
func startMod(start time.Time, m int64) int64 {
	us := new(big.Int).Mul(big.NewInt(start.Unix()), big.NewInt(1e6))
	us.Add(us, big.NewInt(int64(start.Nanosecond()/1000)))
	return us.Mod(us, big.NewInt(m)).Int64()
}

// maxGrant is the largest count one call could ever be granted (docs/spec.md §5): a shard's capacity, or
// what two shards hold together, plus the bounded debt when reserving; +Inf when reserving
// without a bound; -Inf (every count refused) when reserving on a limit with MaxReserved 0.
func (m modelLimit) maxGrant(reserve bool) float64 {
	per := m.cap
	if reserve {
		if m.noReserve {
			return math.Inf(-1)
		}
		per += m.maxRes
	}
	if m.shards >= 2 {
		return 2 * per
	}
	return per
}

// neverGranted reports whether count (with Reserve when reserve) is more than any call could ever
// be granted: above maxGrant, or refused by the rule even on full rows (float rounding of the
// bound cap + MaxReserved).
func (m modelLimit) neverGranted(count float64, reserve bool) bool {
	if count > m.maxGrant(reserve) {
		return true
	}
	allow := 0.0
	if reserve {
		allow = m.maxRes
	}
	full := m.missingRow(0)
	return !m.grantsAt(count, allow, m.shards >= 2, full, full, full.ts)
}

// level evaluates a stored row at now: the tokens it holds and the ts it moves to (docs/spec.md §2-§4).
// Same float8 operations, in the same order, as txlimit_level and txlimit_next_ts.
func (m modelLimit) level(r modelRow, now int64) (float64, int64) {
	el := now - r.ts
	if el < 0 {
		el = 0 // time never runs backwards for a row (docs/spec.md §2)
	}
	var v float64
	var ts int64
	if m.fixed {
		n := el / m.periodUs
		v = r.value + float64(m.rate*float64(n))
		ts = r.ts + n*m.periodUs
	} else {
		v = r.value + float64(float64(el)*m.rate)/float64(m.periodUs)
		ts = max(r.ts, now)
	}
	if v > m.cap {
		v = m.cap
	}
	return v, ts
}

// missingRow is how a missing row is evaluated at now: full, stamped so that it refills nothing and
// its ts moves to now (token bucket) or to the start of now's window (fixed window): at the
// grid's last start at or before the epoch, or, for a reading before that (docs/spec.md §5 accepts
// readings down to -2^61 µs), at the start of the step holding now.
func (m modelLimit) missingRow(now int64) modelRow {
	stamp, step := int64(0), int64(1)
	if m.fixed {
		stamp, step = m.anchorUs, m.periodUs
	}
	if now < stamp {
		stamp -= (stamp - now + step - 1) / step * step
	}
	return modelRow{m.cap, stamp}
}

// charge is txlimit_charge with a free choice: 1 (row a), 2 (row b) or 3 (both).
func charge(la, lb float64, two bool, c float64) int {
	switch {
	case !two:
		return 1
	case max(la, lb) >= c:
		if la >= lb {
			return 1
		}
		return 2
	case math.Abs(la-lb) <= c:
		return 3
	case la >= lb:
		return 1
	}
	return 2
}

// left is txlimit_left: what row slot 0 (a) or 1 (b) holds after the charge.
func left(slot, ch int, la, lb, c float64) float64 {
	var a, b, k, d float64 = 0, 0, 0, 1
	if slot == 0 || ch == 3 {
		a = la
	}
	if slot == 1 || ch == 3 {
		b = lb
	}
	if ch == 3 || ch == slot+1 {
		k = c
	}
	if ch == 3 {
		d = 2
	}
	return (a + b - k) / d
}

// grantedBy is txlimit_granted: the emptiest charged row is left with at least -allow.
func grantedBy(ch int, ea, eb, allow float64) bool {
	low := eb
	switch ch {
	case 1:
		low = ea
	case 3:
		low = min(ea, eb)
	}
	return low >= -allow
}

// grantsAt is the test txlimit_first_grant makes at each instant it tries: whether count
// (allowance allow) on rows a and, when two, b is granted at t.
func (m modelLimit) grantsAt(count, allow float64, two bool, a, b modelRow, t int64) bool {
	la, _ := m.level(a, t)
	lb := 0.0
	if two {
		lb, _ = m.level(b, t)
	}
	ch := charge(la, lb, two, count)
	return grantedBy(ch, left(0, ch, la, lb, count), left(1, ch, la, lb, count), allow)
}

// modelNoTime stands for the zero time.Time in the model's results (times in µs since the epoch,
// which may be negative: docs/spec.md §5 accepts readings down to -2^61 µs).
const modelNoTime = int64(math.MinInt64)

// modelMaxWait is ratelimit.MaxRetryWaitMicros.
const modelMaxWait = int64(1) << 61

// firstGrant is txlimit_first_grant: the first t >= from at which grantsAt holds, searched the
// same way (the real-arithmetic estimate, then gallop and bisect), at most from + 2^61 µs.
func (m modelLimit) firstGrant(count, allow float64, two bool, a, b modelRow, from int64) int64 {
	if m.grantsAt(count, allow, two, a, b, from) {
		return from
	}
	horizon := from + modelMaxWait
	la, _ := m.level(a, from)
	lb := 0.0
	if two {
		lb, _ = m.level(b, from)
	}
	ch := charge(la, lb, two, count)
	ea, eb := math.Inf(1), math.Inf(1)
	if ch == 1 || ch == 3 {
		ea = left(0, ch, la, lb, count)
	}
	if ch == 2 || ch == 3 {
		eb = left(1, ch, la, lb, count)
	}
	// The estimate: the deficit refilled Rate per Period in whole steps (1µs for a token bucket, a
	// Period for a fixed window) from the start of the step holding from.
	est := -min(ea, eb) - allow
	stepUs := int64(1)
	if m.fixed {
		stepUs = m.periodUs
	}
	ref := a
	if ch == 2 {
		ref = b
	}
	_, ts := m.level(ref, from)
	est = float64(ts-from) + float64(math.Ceil(float64(min(est, 1e36)*float64(m.periodUs/stepUs))/m.rate)*float64(stepUs))
	// From the estimate: gallop (strides 1, 2, 4, …) down while granted or up while refused, then
	// bisect the last stride.
	t := from + int64(min(max(est, 1), float64(modelMaxWait)))
	lo, hi, stride := from, t, int64(1)
	if m.grantsAt(count, allow, two, a, b, t) {
		for hi-lo > 1 && hi-stride > lo {
			if !m.grantsAt(count, allow, two, a, b, hi-stride) {
				lo = hi - stride
				break
			}
			hi -= stride
			stride = min(stride*2, modelMaxWait)
		}
	} else {
		for lo = t; ; stride = min(stride*2, modelMaxWait) {
			if lo >= horizon {
				return horizon
			}
			if hi = min(lo+stride, horizon); m.grantsAt(count, allow, two, a, b, hi) {
				break
			}
			lo = hi
		}
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if m.grantsAt(count, allow, two, a, b, mid) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

// retryAt is firstGrant checked against what docs/spec.md §3 says of its answer, independently of
// how the search found it: granted at the answer and refused one microsecond earlier (unless it
// is from, or the bound from + 2^61 µs), and refused at from and at every instant 2^k µs before
// the answer (a grant there would make the answer not the first; the rule is monotone in time on
// one row, while on two rows the charge can switch between combining and the fuller alone).
func (m modelLimit) retryAt(count, allow float64, two bool, a, b modelRow, from int64) int64 {
	t := m.firstGrant(count, allow, two, a, b, from)
	if t == from || t == from+modelMaxWait {
		return t
	}
	if !m.grantsAt(count, allow, two, a, b, t) {
		panic(fmt.Sprintf("model: RetryAt %d after from is refused (count %v, allow %v, two %v, rows %+v %+v)", t-from, count, allow, two, a, b))
	}
	for d := int64(1); d <= t-from; d *= 2 {
		if m.grantsAt(count, allow, two, a, b, t-d) {
			panic(fmt.Sprintf("model: RetryAt %d after from is not the first grant: %d µs earlier grants too (count %v, allow %v, two %v, rows %+v %+v)",
				t-from, d, count, allow, two, a, b))
		}
	}
	return t
}

// modelReq is one request of a decision; a and b are the candidate shards (b < 0 unsharded).
type modelReq struct {
	lim     modelLimit
	count   float64
	reserve bool
	a, b    int
	// snapshot: a lone sharded Limit or Check under REPEATABLE READ or SERIALIZABLE, which reads
	// its second pick only when the first cannot serve alone (the package doc, "Shards").
	snapshot bool
}

// modelResult mirrors ratelimit.Result. A time of modelNoTime is the zero time.Time.
type modelResult struct {
	Name, Key string
	OK        bool
	Reserved  bool
	RetryAt   int64
	Value     float64
	// TS is the ts the one row a grant charged is left with (Result.TS); modelNoTime when
	// denied, when two shards were charged, or when the call's group was denied.
	TS        int64
	Shards    []int
	Config    ratelimit.Config
	Time      int64
	okNow     bool
	retryStep int64 // 1µs, or the period of a fixed window
}

// modelMany mirrors ratelimit.ManyResult.
type modelMany struct {
	OK      bool
	RetryAt int64 // modelNoTime: the zero time
	Results []modelResult
}

// decide runs one decision over reqs (1 for LimitN/CheckN), all-or-nothing (docs/spec.md §3, §4, §6, §8).
// dry: Check/CheckMany, no write.
func (md *model) decide(now int64, reqs []modelReq, dry bool) modelMany {
	type plan struct {
		ra, rb          modelRow // the rows as they stand (a missing row as missingRow)
		la, lb          float64  // their levels at now
		tsA, tsB        int64    // the ts they move to
		ea, eb          float64  // what they hold after the charge
		two             bool
		ch              int
		okNow, reserved bool
	}
	plans := make([]plan, len(reqs))
	granted := true
	for i, r := range reqs {
		p := &plans[i]
		row := func(shard int) modelRow {
			if row, ok := md.rows[modelRowKey{r.lim.name, r.lim.key, shard}]; ok {
				return row
			}
			return r.lim.missingRow(now)
		}
		p.ra = row(r.a)
		p.la, p.tsA = r.lim.level(p.ra, now)
		p.two = r.b >= 0 && !(r.snapshot && p.la >= r.count)
		if p.two {
			p.rb = row(r.b)
			p.lb, p.tsB = r.lim.level(p.rb, now)
		}
		p.ch = charge(p.la, p.lb, p.two, r.count)
		p.ea, p.eb = left(0, p.ch, p.la, p.lb, r.count), left(1, p.ch, p.la, p.lb, r.count)
		p.okNow = grantedBy(p.ch, p.ea, p.eb, 0)
		p.reserved = !p.okNow && grantedBy(p.ch, p.ea, p.eb, r.allow())
		if !p.okNow && !p.reserved {
			granted = false
		}
	}
	out := modelMany{RetryAt: modelNoTime, Results: make([]modelResult, len(reqs))}
	if dry {
		out.OK = granted
	} else if granted {
		out.OK = true
		for i, r := range reqs {
			p := plans[i]
			if p.ch == 1 || p.ch == 3 {
				md.rows[modelRowKey{r.lim.name, r.lim.key, r.a}] = modelRow{p.ea, p.tsA}
			}
			if p.ch == 2 || p.ch == 3 {
				md.rows[modelRowKey{r.lim.name, r.lim.key, r.b}] = modelRow{p.eb, p.tsB}
			}
		}
	}
	for i, r := range reqs {
		p := plans[i]
		res := modelResult{Name: r.lim.name, Key: r.lim.key, OK: p.okNow || p.reserved, Reserved: p.reserved,
			RetryAt: modelNoTime, TS: modelNoTime, Config: r.lim.inForce, Time: now, okNow: p.okNow, retryStep: 1}
		if r.lim.fixed {
			res.retryStep = r.lim.periodUs
		}
		if res.OK {
			res.Value = p.ea
			if p.two {
				res.Value += p.eb
			}
			if out.OK || dry {
				if p.ch == 1 || p.ch == 3 {
					res.Shards = append(res.Shards, r.a)
				}
				if p.ch == 2 || p.ch == 3 {
					res.Shards = append(res.Shards, r.b)
				}
				slices.Sort(res.Shards) // Result.Shards is ascending
				switch p.ch {
				case 1:
					res.TS = p.tsA
				case 2:
					res.TS = p.tsB
				}
			}
		} else {
			res.Value = p.la
			if p.two {
				res.Value += p.lb
			}
		}
		switch {
		case !res.OK:
			// Refused: when the same request is granted.
			res.RetryAt = r.lim.retryAt(r.count, r.allow(), p.two, p.ra, p.rb, now)
		case p.reserved:
			// Reserved: when every charged row is out of debt.
			at := int64(math.MinInt64)
			if p.ch == 1 || p.ch == 3 {
				at = max(at, r.lim.retryAt(0, 0, false, modelRow{p.ea, p.tsA}, modelRow{}, now))
			}
			if p.ch == 2 || p.ch == 3 {
				at = max(at, r.lim.retryAt(0, 0, false, modelRow{p.eb, p.tsB}, modelRow{}, now))
			}
			res.RetryAt = at
		}
		out.Results[i] = res
		// Granted: when the last reservation is due; denied: when the last denial clears.
		if (out.OK || !res.OK) && res.RetryAt > out.RetryAt {
			out.RetryAt = res.RetryAt
		}
	}
	return out
}

// allow is how far below zero the request may take a charged row: 0 without Reserve.
func (r modelReq) allow() float64 {
	if !r.reserve {
		return 0
	}
	return r.lim.maxRes
}

// modelState mirrors ratelimit.State.
type modelState struct {
	Value  float64
	TS     int64 // modelNoTime: the zero time (no row)
	Shards []float64
	Time   int64
}

// value is Limiter.State: every configured shard evaluated at now, missing ones full, summed in
// shard order (docs/spec.md §6).
func (md *model) value(now int64, m modelLimit) modelState {
	st := modelState{TS: modelNoTime, Time: now, Shards: make([]float64, m.shards)}
	for s := range st.Shards {
		st.Shards[s] = m.cap
		if row, ok := md.rows[modelRowKey{m.name, m.key, s}]; ok {
			st.Shards[s], _ = m.level(row, now)
			st.TS = max(st.TS, row.ts)
		}
	}
	for _, v := range st.Shards {
		st.Value += v
	}
	return st
}

// modelCredit mirrors ratelimit.CreditResult.
type modelCredit struct {
	Credited, Value float64
	Time            int64
}

// credit is Limiter.Credit (docs/spec.md §6): count tokens go back to the existing shard rows, emptiest
// first (ties by shard), each up to the per-shard capacity; missing rows are full, take nothing
// and are not created.
func (md *model) credit(now int64, m modelLimit, count float64) modelCredit {
	type row struct {
		shard         int
		before, after float64
		ts            int64
	}
	var rows []row
	for s := 0; s < m.shards; s++ {
		if r, ok := md.rows[modelRowKey{m.name, m.key, s}]; ok {
			lv, ts := m.level(r, now)
			rows = append(rows, row{shard: s, before: lv, ts: ts})
		}
	}
	order := make([]int, len(rows))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(i, j int) bool {
		ri, rj := rows[order[i]], rows[order[j]]
		if ri.before != rj.before {
			return ri.before < rj.before
		}
		return ri.shard < rj.shard
	})
	// Each row takes what the emptier rows before it could not: count minus their room.
	var room float64
	for k, i := range order {
		r := &rows[i]
		prior := 0.0
		if k > 0 {
			prior = room
		}
		r.after = min(r.before+max(count-prior, 0), m.cap)
		if k == 0 {
			room = m.cap - r.before
		} else {
			room += m.cap - r.before
		}
	}
	res := modelCredit{Value: float64(m.shards-len(rows)) * m.cap, Time: now}
	for _, r := range rows {
		res.Credited += r.after - r.before
		res.Value += r.after
		if r.after > r.before {
			md.rows[modelRowKey{m.name, m.key, r.shard}] = modelRow{r.after, r.ts}
		}
	}
	return res
}

// reset is Limiter.Reset: every shard row of (name, key) goes.
func (md *model) reset(name, key string) {
	for k := range md.rows {
		if k.name == name && k.key == key {
			delete(md.rows, k)
		}
	}
}

// TestModelSpecNumbers pins the model to the exact numbers the algebra of docs/spec.md gives, so that the
// fuzz target compares the library with something that is itself right.
func TestModelSpecNumbers(t *testing.T) {
	const s = int64(time.Second / time.Microsecond)
	base := int64(1_767_225_600) * s // 2026-01-01T00:00:00Z
	lim := func(cfg ratelimit.Config, key string) modelLimit {
		t.Helper()
		m, err := modelResolve("m", key, &cfg)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	one := func(md *model, now int64, m modelLimit, count float64, reserve bool, dry bool) modelResult {
		return md.decide(now, []modelReq{{lim: m, count: count, reserve: reserve, a: 0, b: -1}}, dry).Results[0]
	}
	expect := func(what string, r modelResult, ok, reserved bool, retryAt int64, value float64) {
		t.Helper()
		if r.OK != ok || r.Reserved != reserved || r.RetryAt != retryAt || r.Value != value {
			t.Errorf("%s: got ok=%v reserved=%v retryAt=%d value=%v; want ok=%v reserved=%v retryAt=%d value=%v",
				what, r.OK, r.Reserved, r.RetryAt-base, r.Value, ok, reserved, retryAt-base, value)
		}
	}

	// docs/spec.md §3: 10/min, cap 10, holding 0.5 after 9.5 taken: a call for 1 waits (1-0.5)/(10/60s) = 3s.
	tb := lim(ratelimit.Config{Rate: 10, Period: time.Minute, MaxReserved: ratelimit.Unbounded}, "k")
	md := newModel()
	expect("take 9.5", one(md, base, tb, 9.5, false, false), true, false, modelNoTime, 0.5)
	expect("deny 1", one(md, base, tb, 1, false, false), false, false, base+3*s, 0.5)
	// Refill with cap (docs/spec.md §3 min(.., cap)): an hour later the bucket holds 10, not 600.5.
	expect("capped", one(md, base+3600*s, tb, 1, true, true), true, false, modelNoTime, 9)
	// Reservation with MaxReserved Unbounded: 10 + 5 leaves -5, paid after 5/(10/60s) = 30s.
	expect("reserve", one(md, base+3600*s, tb, 15, true, false), true, true, base+3630*s, -5)
	// Time going backwards (docs/spec.md §2): evaluated at ts, so no refill: still -5.
	expect("backwards", one(md, base+3000*s, tb, 1, false, true), false, false, base+3636*s, -5)
	// Credit after the reservation (docs/spec.md §6): -5 + 20 is capped at 10.
	if c := md.credit(base+3600*s, tb, 20); c.Credited != 15 || c.Value != 10 {
		t.Errorf("credit: got %+v, want credited 15 value 10", c)
	}

	// docs/spec.md §4: fixed window 5 per 10s, cap 5, grid at base: 5 taken, the 6th waits for the next
	// window; three windows later the value is min(0 + 3·5, 5) = 5.
	fw := lim(ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: 10 * time.Second, Start: time.UnixMicro(base)}, "k")
	md = newModel()
	expect("fw take 5", one(md, base+4*s, fw, 5, false, false), true, false, modelNoTime, 0)
	expect("fw deny", one(md, base+9*s, fw, 1, false, false), false, false, base+10*s, 0)
	expect("fw rollover", one(md, base+30*s, fw, 1, false, false), true, false, modelNoTime, 4)
	// MaxReserved 3: a debt of 3 is granted, RetryAt = ts' + 10s·ceil(3/5); a debt of 4 is not.
	fwr := lim(ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: 10 * time.Second, MaxReserved: 3, Start: time.UnixMicro(base)}, "r")
	md = newModel()
	expect("fw reserve 8", one(md, base+1*s, fwr, 8, true, false), true, true, base+10*s, -3)
	expect("fw deny reserve 1", one(md, base+2*s, fwr, 1, true, false), false, false, base+10*s, -3)

	// docs/spec.md §8: 2 shards of 10/s cap 10 are 5/s cap 5 each. Shard 0 at 4, shard 1 at 1; a call for
	// 5: neither alone, difference 3 <= 5, so both end at (4+1-5)/2 = 0.
	sh := lim(ratelimit.Config{Rate: 10, Period: time.Second, Shards: 2}, "s")
	md = newModel()
	md.rows[modelRowKey{"m", "s", 0}] = modelRow{4, base}
	md.rows[modelRowKey{"m", "s", 1}] = modelRow{1, base}
	r := md.decide(base, []modelReq{{lim: sh, count: 5, a: 1, b: 0}}, false).Results[0]
	if !r.OK || r.Value != 0 || len(r.Shards) != 2 || md.rows[modelRowKey{"m", "s", 0}].value != 0 {
		t.Errorf("sharded combine: got %+v", r)
	}
	if st := md.value(base+100_000, sh); st.Value != 1 || st.Shards[0] != 0.5 {
		t.Errorf("sharded value: got %+v, want 0.5+0.5", st)
	}

	// Multi-limit denial (docs/spec.md §6): nothing written, the denial named, the latest RetryAt.
	md = newModel()
	m1 := lim(ratelimit.Config{Rate: 1, Period: time.Second}, "a")
	m2 := lim(ratelimit.Config{Rate: 2, Period: time.Second}, "b")
	many := md.decide(base, []modelReq{{lim: m1, count: 1, a: 0, b: -1}, {lim: m2, count: 1, a: 0, b: -1}}, false)
	if !many.OK || len(md.rows) != 2 {
		t.Fatalf("many: %+v", many)
	}
	// m1 holds 0 and denies 0.5 until 0.5s later; m2 holds 1 and would grant 0.5.
	many = md.decide(base, []modelReq{{lim: m1, count: 0.5, a: 0, b: -1}, {lim: m2, count: 0.5, a: 0, b: -1}}, false)
	if many.OK || many.Results[0].OK || !many.Results[1].OK || many.RetryAt != base+s/2 ||
		md.rows[modelRowKey{"m", "a", 0}].value != 0 || md.rows[modelRowKey{"m", "b", 0}].value != 1 {
		t.Errorf("many denial: %+v", many)
	}

	// Fixed window phase from FNV-1a of "m\x00k" (doc.go): the known vector of FNV-1a("a") pins
	// the hash itself.
	if h := fnv1a([]byte("a")); h != 0xaf63dc4c8601ec8c {
		t.Errorf("fnv1a(a) = %#x", h)
	}
}

// specStep is one call of a docs/spec.md worked example and what the spec says it returns.
type specStep struct {
	at       time.Duration // after shardT0
	op       shardOp       // LimitN (default), CheckN or Credit
	pick     [2]int        // candidate shards of a sharded limit
	count    float64
	reserve  bool
	ok       bool
	reserved bool
	retryUs  int64   // RetryAt - shardT0 in µs; 0: no wait
	value    float64 // Result.Value, or CreditResult.Value
	credited float64
	shards   []int // Result.Shards
}

// specExample is one worked example: a config, the rows it starts from (shard -> value, stamped
// at shardT0) and its calls, then the State the spec gives.
type specExample struct {
	name   string
	cfg    ratelimit.Config
	rows   map[int]float64
	steps  []specStep
	state  []float64         // State().Shards after the steps
	stTS   time.Duration     // State().TS - shardT0
	readAs *ratelimit.Config // State read with this config (a config change); nil: cfg
}

// TestSpecWorkedNumbers runs every worked number of docs/spec.md §2-§8 on the engine and on the
// reference model, so that neither can drift from the spec in the same way: the fuzz target only
// compares the two with each other.
func TestSpecWorkedNumbers(t *testing.T) {
	t.Parallel()
	const ms = int64(1000)
	s := int64(1_000_000)
	reserve5 := ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 5}
	twoShards := ratelimit.Config{Rate: 10, Period: time.Second, Shards: 2}
	twoShardsRes := ratelimit.Config{Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 2}
	grow2 := ratelimit.Config{Rate: 4, Period: time.Second, Capacity: 4, Shards: 2}
	grow4 := grow2
	grow4.Shards = 4
	less := -3.0 // float64 operations as the rule performs them, not constant arithmetic
	at99999 := less + float64(99_999*10)/1e6
	for _, ex := range []specExample{
		// §2: a row whose ts is later than the reading is evaluated at its ts: (−5, t0 + 500 ms)
		// read at t0 holds −5 (here the row is at shardT0, read 500 ms before).
		{name: "§2 row ahead of the clock", cfg: ratelimit.Config{Rate: 10, Period: time.Second}, rows: map[int]float64{0: -5}, steps: []specStep{
			{at: -500 * time.Millisecond, op: shardCheck, count: 1, value: -5, retryUs: 600 * ms},
		}, state: []float64{-5}},
		{name: "§3 table", cfg: reserve5, rows: map[int]float64{0: 0}, steps: []specStep{
			{count: 3, retryUs: 300 * ms},
			{count: 3, reserve: true, ok: true, reserved: true, value: -3, retryUs: 300 * ms, shards: []int{0}},
			{count: 3, reserve: true, value: -3, retryUs: 100 * ms},
			{count: 3, value: -3, retryUs: 600 * ms},
			{at: 99_999 * time.Microsecond, count: 3, reserve: true, value: at99999, retryUs: 100 * ms},
			{at: 100 * time.Millisecond, count: 3, reserve: true, ok: true, reserved: true, value: -5, retryUs: 600 * ms, shards: []int{0}},
		}, state: []float64{-5}, stTS: 100 * time.Millisecond},
		{name: "§3 10/min holding 0.5", cfg: ratelimit.Config{Rate: 10, Period: time.Minute}, rows: map[int]float64{0: 0.5}, steps: []specStep{
			{count: 1, value: 0.5, retryUs: 3 * s},
		}, state: []float64{0.5}},
		{name: "§4 fixed window", cfg: ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: 10 * time.Second, Start: shardT0}, steps: []specStep{
			{count: 5, ok: true, value: 0, shards: []int{0}},
			{at: 3 * time.Second, count: 1, value: 0, retryUs: 10 * s},
			{at: 10 * time.Second, count: 1, ok: true, value: 4, shards: []int{0}},
		}, state: []float64{4}, stTS: 10 * time.Second},
		// §4: a count that needs several windows waits for ceil(count/Rate) of them.
		{name: "§4 several windows", cfg: ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 2, Period: 10 * time.Second, Capacity: 5, Start: shardT0}, steps: []specStep{
			{at: 4 * time.Second, count: 5, ok: true, value: 0, shards: []int{0}},
			{at: 4 * time.Second, count: 5, value: 0, retryUs: 30 * s},
			{at: 29 * time.Second, count: 5, value: 4, retryUs: 30 * s},
			{at: 30 * time.Second, count: 5, ok: true, value: 0, shards: []int{0}},
		}, state: []float64{0}, stTS: 30 * time.Second},
		{name: "§6 credit", cfg: ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded}, rows: map[int]float64{0: -5}, steps: []specStep{
			{op: shardCredit, count: 20, credited: 15, value: 10},
		}, state: []float64{10}},
		{name: "§8 4 and 3", cfg: twoShards, rows: map[int]float64{0: 4, 1: 3}, steps: []specStep{
			{pick: [2]int{0, 1}, count: 5, ok: true, value: 2, shards: []int{0, 1}},
		}, state: []float64{1, 1}},
		{name: "§8 0.2 and 0.2", cfg: twoShards, rows: map[int]float64{0: 0.2, 1: 0.2}, steps: []specStep{
			{pick: [2]int{1, 0}, count: 1, value: 0.4, retryUs: 60 * ms},
		}, state: []float64{0.2, 0.2}},
		{name: "§8 0.5 and -3", cfg: twoShardsRes, rows: map[int]float64{0: 0.5, 1: -3}, steps: []specStep{
			{pick: [2]int{1, 0}, count: 1, reserve: true, ok: true, reserved: true, value: -3.5, retryUs: 100 * ms, shards: []int{0}},
		}, state: []float64{-0.5, -3}},
		{name: "§8 grow 2 to 4", cfg: grow2, rows: map[int]float64{0: 0, 1: 1.5}, readAs: &grow4, state: []float64{0, 1, 1, 1}},
	} {
		t.Run(ex.name, func(t *testing.T) {
			t.Parallel()
			e := newShardEnv(t, nil)
			md := newModel()
			key := ex.name
			lim, err := modelResolve("spec", key, &ex.cfg)
			if err != nil {
				t.Fatal(err)
			}
			base := shardT0.UnixMicro()
			for sh, v := range ex.rows {
				if _, err := e.pool.Exec(e.ctx, `INSERT INTO txlimit_state (name, key, shard, value, ts) VALUES ('spec', $1, $2, $3, $4)`,
					key, sh, v, base); err != nil {
					t.Fatal(err)
				}
				md.rows[modelRowKey{"spec", key, sh}] = modelRow{v, base}
			}
			for i, st := range ex.steps {
				e.set(shardT0.Add(st.at), st.pick)
				now := base + st.at.Microseconds()
				wantRetry := modelNoTime
				if st.retryUs != 0 {
					wantRetry = base + st.retryUs
				}
				opts := &ratelimit.LimitOpts{Config: &ex.cfg, Reserve: st.reserve}
				if st.op == shardCredit {
					got, err := e.lim.Credit(e.ctx, e.pool, "spec", key, st.count, opts)
					require.NoError(t, err)
					mc := md.credit(now, lim, st.count)
					for who, g := range map[string][2]float64{"engine": {got.Credited, got.Value}, "model": {mc.Credited, mc.Value}} {
						if g != [2]float64{st.credited, st.value} {
							t.Errorf("step %d: %s: Credit(%g) credited %g value %g; the spec says credited %g value %g",
								i, who, st.count, g[0], g[1], st.credited, st.value)
						}
					}
					continue
				}
				var got ratelimit.Result
				if st.op == shardCheck {
					got, err = e.lim.CheckN(e.ctx, e.pool, "spec", key, st.count, opts)
				} else {
					got, err = e.lim.LimitN(e.ctx, e.pool, "spec", key, st.count, opts)
				}
				require.NoError(t, err, "step %d", i)
				req := modelReq{lim: lim, count: st.count, reserve: st.reserve, a: 0, b: -1}
				if lim.shards >= 2 {
					req.a, req.b = st.pick[0], st.pick[1]
				}
				m := md.decide(now, []modelReq{req}, st.op == shardCheck).Results[0]
				mAt := time.Time{}
				if m.RetryAt != modelNoTime {
					mAt = time.UnixMicro(m.RetryAt)
				}
				wantAt := time.Time{}
				if wantRetry != modelNoTime {
					wantAt = time.UnixMicro(wantRetry)
				}
				for who, g := range map[string]ratelimit.Result{"engine": got,
					"model": {OK: m.OK, Reserved: m.Reserved, RetryAt: mAt, Value: m.Value, Shards: m.Shards}} {
					if g.OK != st.ok || g.Reserved != st.reserved || !g.RetryAt.Equal(wantAt) || g.Value != st.value ||
						!slices.Equal(g.Shards, st.shards) {
						t.Errorf("step %d at t0+%v: %s: %s(%g, reserve=%v) = ok %v reserved %v retryAt %s value %v shards %v; "+
							"the spec says ok %v reserved %v retryAt %s value %v shards %v", i, st.at, who, st.op, st.count, st.reserve,
							g.OK, g.Reserved, fmtRetry(g.RetryAt), g.Value, g.Shards, st.ok, st.reserved, fmtRetry(wantAt), st.value, st.shards)
					}
				}
			}
			read := ex.cfg
			if ex.readAs != nil {
				read = *ex.readAs
				if lim, err = modelResolve("spec", key, &read); err != nil {
					t.Fatal(err)
				}
			}
			now := base
			if n := len(ex.steps); n > 0 {
				now += ex.steps[n-1].at.Microseconds()
			}
			st, err := e.lim.State(e.ctx, e.pool, "spec", key, &ratelimit.LimitOpts{Config: &read})
			require.NoError(t, err)
			mst := md.value(now, lim)
			wantTS := base + ex.stTS.Microseconds()
			if !slices.Equal(st.Shards, ex.state) || !st.TS.Equal(time.UnixMicro(wantTS)) {
				t.Errorf("engine: State shards %v ts %s; the spec says %v ts %s", st.Shards, fmtRetry(st.TS), ex.state, fmtRetry(time.UnixMicro(wantTS)))
			}
			if !slices.Equal(mst.Shards, ex.state) || mst.TS != wantTS {
				t.Errorf("model: State shards %v ts %d; the spec says %v ts %d", mst.Shards, mst.TS-base, ex.state, wantTS-base)
			}
		})
	}
}

// TestModelExtremes compares the engine with the model where FuzzModel's tables do not reach: the
// bounds of docs/spec.md §5 (rates, capacities, counts and MaxReserved from 10^-9 to 10^15,
// periods from 1 µs to 100 years, 1024 shards, any Start), clock readings around the epoch, before
// it down to -2^61 µs (before year 1, the zero time.Time) and far ahead, and jumps of up to a
// year. A fixed seed: each run decides the same calls.
func TestModelExtremes(t *testing.T) {
	t.Parallel()
	b := setupDB(t, &testdb.Options{MaxConns: 2}, nil)
	rng := rand.New(rand.NewPCG(7, 11))
	pick := func(xs ...float64) float64 { return xs[rng.IntN(len(xs))] }
	var now int64
	var pa, pb int
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Now: func() time.Time { return time.UnixMicro(now).UTC() }})
	require.NoError(t, err)
	ratelimit.SetShardPicker(lim, func(int) (int, int) { return pa, pb })
	periods := []time.Duration{time.Microsecond, 3 * time.Microsecond, time.Second, 7919 * time.Millisecond, 24 * time.Hour,
		365 * 24 * time.Hour, ratelimit.MaxPeriod}
	for c := 0; c < 250; c++ {
		cfg := ratelimit.Config{
			Rate: pick(1e-9, 1e-3, 0.1, 1, 3, 1e6, 1e15), Period: periods[rng.IntN(len(periods))],
			Capacity: pick(0, 1e-9, 0.3, 1, 7, 1e15), MaxReserved: pick(0, 1e-9, 0.2, 1, 1e15, ratelimit.Unbounded),
			Shards: []int{0, 1, 2, 3, ratelimit.MaxShards}[rng.IntN(5)],
		}
		if rng.IntN(2) == 0 {
			cfg.Kind = ratelimit.FixedWindow
			if rng.IntN(2) == 0 {
				cfg.Start = time.UnixMicro(rng.Int64N(1<<60) - 1<<59).UTC()
			}
		}
		key := fmt.Sprint("k", c)
		m, err := modelResolve("x", key, &cfg)
		require.NoError(t, err)
		md := newModel()
		now = []int64{0, -1, 1 << 52, -(1 << 40), -(1 << 56), -(1 << 61) + 1<<50, 1767225600000000, 1<<61 - 1<<52}[rng.IntN(8)]
		var trace []string
		for op := 0; op < 20; op++ {
			now += []int64{0, 1, 1000, 1e6, 1 << 30, -1, -1e6, 365 * 86400e6}[rng.IntN(8)]
			count := pick(1e-9, 0.3, 1, 2, 1e6, 1e15) * pick(1, 1, m.cap, 2*m.cap)
			reserve, dry := rng.IntN(2) == 0, rng.IntN(4) == 0
			if m.shards >= 2 {
				pa = rng.IntN(m.shards)
				pb = (pa + 1 + rng.IntN(m.shards-1)) % m.shards
			}
			trace = append(trace, fmt.Sprintf("at %dµs: count %v reserve %v dry %v picks %d/%d", now, count, reserve, dry, pa, pb))
			opts := &ratelimit.LimitOpts{Config: &cfg, Reserve: reserve}
			var got ratelimit.Result
			if dry {
				got, err = lim.CheckN(b.ctx, b.pool, "x", key, count, opts)
			} else {
				got, err = lim.LimitN(b.ctx, b.pool, "x", key, count, opts)
			}
			wantErr := modelCheckCount(count) != nil || m.neverGranted(count, reserve) || (reserve && m.noReserve)
			require.Equal(t, wantErr, err != nil, "config %v: error %v\n%s", cfg, err, strings.Join(trace, "\n"))
			if err != nil {
				continue
			}
			req := modelReq{lim: m, count: count, reserve: reserve, a: 0, b: -1}
			if m.shards >= 2 {
				req.a, req.b = pa, pb
			}
			w := md.decide(now, []modelReq{req}, dry).Results[0]
			if got.OK != w.OK || got.Reserved != w.Reserved || !sameTime(got.RetryAt, w.RetryAt) || !sameFloat(got.Value, w.Value) ||
				!sameTime(got.TS, w.TS) || !slices.Equal(got.Shards, w.Shards) {
				t.Fatalf("config %v:\n got  ok %v reserved %v retryAt %v value %v ts %v shards %v\n want ok %v reserved %v retryAt %d value %v ts %d shards %v\n%s",
					cfg, got.OK, got.Reserved, got.RetryAt.UnixMicro(), got.Value, got.TS.UnixMicro(), got.Shards,
					w.OK, w.Reserved, w.RetryAt, w.Value, w.TS, w.Shards, strings.Join(trace, "\n"))
			}
			if rng.IntN(4) == 0 {
				cr, err := lim.Credit(b.ctx, b.pool, "x", key, count, &ratelimit.LimitOpts{Config: &cfg})
				require.NoError(t, err)
				wc := md.credit(now, m, count)
				require.True(t, sameFloat(cr.Credited, wc.Credited) && sameFloat(cr.Value, wc.Value),
					"config %v: Credit(%v) got %v/%v, want %v/%v\n%s", cfg, count, cr.Credited, cr.Value, wc.Credited, wc.Value, strings.Join(trace, "\n"))
			}
		}
		st, err := lim.State(b.ctx, b.pool, "x", key, &ratelimit.LimitOpts{Config: &cfg})
		require.NoError(t, err)
		ws := md.value(now, m)
		require.True(t, sameFloat(st.Value, ws.Value) && sameTime(st.TS, ws.TS), "config %v: State %v/%v, want %v/%v", cfg, st.Value, st.TS, ws.Value, ws.TS)
	}
}
