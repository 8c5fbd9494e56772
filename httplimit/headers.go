package httplimit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"hash"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/txlimit/txlimit/ratelimit"
)

// Field names and the problem type of draft-ietf-httpapi-ratelimit-headers.
const (
	// HeaderPolicy is the RateLimit-Policy field: the quota policies that applied.
	HeaderPolicy = "RateLimit-Policy"
	// HeaderRateLimit is the RateLimit field: what is left of each policy.
	HeaderRateLimit = "RateLimit"
	// ProblemQuotaExceeded is the problem type of a 429 from the middleware.
	ProblemQuotaExceeded = "https://iana.org/assignments/http-problem-types#quota-exceeded"
)

// pkLen is how many bytes of the HMAC a partition key keeps.
const pkLen = 12

// Problem is the application/problem+json body (RFC 9457) of a response the middleware writes
// itself: a 429 of the quota-exceeded type, or a 400 or 503 of type "about:blank".
type Problem struct {
	// Type is ProblemQuotaExceeded for a 429, "about:blank" otherwise.
	Type string `json:"type"`
	// Title is the type's summary.
	Title string `json:"title"`
	// Status is the response's status code.
	Status int `json:"status"`
	// Detail says what happened for this request; empty for a 429.
	Detail string `json:"detail,omitempty"`
	// ViolatedPolicies names the policies whose quota was exceeded (429 only).
	ViolatedPolicies []string `json:"violated-policies,omitempty"`
}

// WriteHeaders adds the RateLimit-Policy and RateLimit fields for results, and sets Retry-After
// when any of them was denied, on w's header (call it before WriteHeader). Results of limits that
// are not among the middleware's Policies are left out. Handlers that decide inside their own
// transaction call it with their results; behind the middleware their items follow the
// middleware's, as further lines of the same fields (a Structured Field List may be split over
// several lines of one field).
func (m *Middleware) WriteHeaders(w http.ResponseWriter, results ...ratelimit.Result) {
	var pol, lim httpsfv.List
	var usedA [4]*sfItems
	used := usedA[:0]
	for _, r := range results {
		p, ok := m.byName[r.Name]
		if !ok {
			continue
		}
		it := m.items[r.Name].Get().(*sfItems)
		used = append(used, it)
		pk := m.partitionKey(r.Name, r.Key)
		it.pol.Params.Add("pk", pk)
		pol = append(pol, it.pol)

		li := &it.lim
		if t, ok := reset(p.Config, r); ok {
			li = &it.limT
			li.Params.Add("t", t)
		}
		li.Params.Add("r", sfInt(math.Floor(math.Max(r.Value, 0))))
		li.Params.Add("pk", pk)
		lim = append(lim, *li)
	}
	h := w.Header()
	if len(pol) > 0 {
		if s, err := httpsfv.Marshal(pol); err == nil {
			h.Add(HeaderPolicy, s)
		}
		if s, err := httpsfv.Marshal(lim); err == nil {
			h.Add(HeaderRateLimit, s)
		}
	}
	for _, it := range used {
		it.pol.Params.Add("pk", []byte(nil)) // keep no partition key in the pool
		it.lim.Params.Add("pk", []byte(nil))
		it.limT.Params.Add("pk", []byte(nil))
		it.pool.Put(it)
	}
	if v := violated(results); len(v) > 0 {
		h.Set("Retry-After", strconv.FormatInt(m.retryAfter(results), 10))
	}
}

// writable reports whether name can be written in the header fields: as a Structured Field String
// (RFC 9651), which is printable ASCII (0x20 to 0x7E).
func writable(name string) bool {
	_, err := httpsfv.Marshal(httpsfv.NewItem(name))
	return err == nil
}

// initHeaders makes what WriteHeaders takes from pools: the HMACs of the partition keys, keyed with
// m.secret, and each policy's items.
func (m *Middleware) initHeaders() {
	m.macs.New = func() any { return hmac.New(sha256.New, m.secret) }
	m.items = make(map[string]*sync.Pool, len(m.policies))
	for i := range m.policies {
		m.items[m.policies[i].Name] = newItemPool(&m.policies[i])
	}
}

// sfItems are the items of one result in the two fields, kept in a pool per policy so that their
// parameters are set, not built, for each response: a policy's q and w (and txlimit-burst) never
// change, and the RateLimit item's parameters keep their order (r, t, pk) when overwritten.
type sfItems struct {
	pool      *sync.Pool
	pol       httpsfv.Item // RateLimit-Policy: q, [qu,] w, [txlimit-burst,] pk
	lim, limT httpsfv.Item // RateLimit: r, pk; and r, t, pk
}

// newItemPool returns the pool of p's *sfItems.
func newItemPool(p *Policy) *sync.Pool {
	pool := &sync.Pool{}
	pool.New = func() any {
		it := &sfItems{pool: pool, pol: httpsfv.NewItem(p.Name), lim: httpsfv.NewItem(p.Name), limT: httpsfv.NewItem(p.Name)}
		q, win := quota(p.Config)
		it.pol.Params.Add("q", q)
		if p.QuotaUnit != "" {
			it.pol.Params.Add("qu", p.QuotaUnit)
		}
		it.pol.Params.Add("w", win)
		if c := capacity(p.Config); c != p.Config.Rate {
			it.pol.Params.Add("txlimit-burst", sfInt(math.Floor(c)))
		}
		it.pol.Params.Add("pk", []byte(nil))
		it.lim.Params.Add("r", int64(0))
		it.lim.Params.Add("pk", []byte(nil))
		it.limT.Params.Add("r", int64(0))
		it.limT.Params.Add("t", int64(0))
		it.limT.Params.Add("pk", []byte(nil))
		return it
	}
	return pool
}

// WriteDenied answers 429 Too Many Requests for results, some of which were denied: the fields of
// WriteHeaders and a problem body of type ProblemQuotaExceeded listing the denied policies.
func (m *Middleware) WriteDenied(w http.ResponseWriter, results ...ratelimit.Result) {
	m.WriteHeaders(w, results...)
	writeJSONProblem(w, Problem{
		Type:             ProblemQuotaExceeded,
		Title:            "Request cannot be satisfied as assigned quota has been exceeded",
		Status:           http.StatusTooManyRequests,
		ViolatedPolicies: violated(results),
	})
}

// retryAfter is the longest wait of the denied results in whole seconds, rounded up, plus the
// identity's jitter.
func (m *Middleware) retryAfter(results []ratelimit.Result) int64 {
	var secs int64
	for _, r := range results {
		if !r.OK {
			secs = max(secs, waitSeconds(r))
		}
	}
	return secs + m.jitter(results)
}

// jitter is 0..jitterS whole seconds, the same for the same keys (see the package doc).
func (m *Middleware) jitter(results []ratelimit.Result) int64 {
	if m.jitterS <= 0 {
		return 0
	}
	mac := hmac.New(sha256.New, m.secret)
	mac.Write([]byte("retry-after"))
	for _, r := range results {
		mac.Write([]byte{0})
		mac.Write([]byte(r.Key))
	}
	return int64(binary.BigEndian.Uint64(mac.Sum(nil)[:8]) % uint64(m.jitterS+1))
}

// jitterKeys is the jitter of the requests reqs: the same as that of their results.
func (m *Middleware) jitterKeys(reqs []ratelimit.Request) int64 {
	if m.jitterS <= 0 {
		return 0
	}
	results := make([]ratelimit.Result, len(reqs))
	for i, r := range reqs {
		results[i].Key = r.Key
	}
	return m.jitter(results)
}

// partitionKey is the first pkLen bytes of HMAC-SHA256(secret, name 0x00 key).
func (m *Middleware) partitionKey(name, key string) []byte {
	mac := m.macs.Get().(hash.Hash)
	defer m.macs.Put(mac)
	mac.Reset()
	mac.Write([]byte(name))
	mac.Write([]byte{0})
	mac.Write([]byte(key))
	return mac.Sum(nil)[:pkLen]
}

// quota returns the advertised q and w of cfg (see the package doc): never more quota, never a
// shorter window, than the limit grants.
func quota(cfg ratelimit.Config) (q, w int64) {
	rate := cfg.Rate
	if cfg.Kind == ratelimit.FixedWindow {
		rate = min(rate, capacity(cfg)) // a window grants at most Capacity (docs/spec.md §4)
	}
	if rate < 1 {
		return 1, max(1, sfInt(math.Ceil(cfg.Period.Seconds()/rate)))
	}
	return sfInt(math.Floor(rate)), max(1, ceilSeconds(cfg.Period))
}

// maxSFInt is the largest Integer of RFC 9651 (15 digits).
const maxSFInt = 999_999_999_999_999

// sfInt converts a whole, non-negative float to an Integer, capped at maxSFInt.
func sfInt(f float64) int64 {
	if f >= maxSFInt {
		return maxSFInt
	}
	return int64(max(f, 0))
}

// reset returns the t parameter of r, and false when there is none to give.
func reset(cfg ratelimit.Config, r ratelimit.Result) (int64, bool) {
	if !r.OK {
		return waitSeconds(r), true
	}
	// r.Value covers the shards the call looked at: of a sharded limit, two of its N shards, which
	// hold at most 2·Capacity/N (docs/spec.md §8). Each refills at Rate/N while below its capacity,
	// and a full one not at all; which of them is full the Result does not say, so t counts one
	// shard refilling: never too soon, at most twice the wait when both refill.
	rate, full := cfg.Rate, capacity(cfg)
	if n := float64(cfg.Shards); n >= 2 {
		rate, full = rate/n, 2*full/n
	}
	next := math.Max(math.Floor(r.Value)+1, 1) // when r, the remaining whole units, grows by one
	if cfg.Kind != ratelimit.TokenBucket || next > full {
		return 0, false // r cannot grow: the limit is full, or holds less than next when full
	}
	us := math.Ceil((next - r.Value) * float64(cfg.Period.Microseconds()) / rate)
	return sfInt(math.Ceil(us / 1e6)), true
}

func capacity(cfg ratelimit.Config) float64 {
	if cfg.Capacity == 0 {
		return cfg.Rate
	}
	return cfg.Capacity
}

// waitSeconds is r's wait, RetryAt − Time, in whole seconds rounded up (0 for none). It is
// computed from the times, not from r.RetryAfter, a time.Duration that saturates at about 292
// years: a RetryAt may lie up to 2^61 µs (about 73,000 years) after Time, and the wait must never
// be given as shorter than it is.
func waitSeconds(r ratelimit.Result) int64 {
	if r.RetryAt.IsZero() || !r.RetryAt.After(r.Time) {
		return 0
	}
	secs := r.RetryAt.Unix() - r.Time.Unix() // whole seconds apart, and a nanosecond rest in (-1 s, 1 s)
	if r.RetryAt.Nanosecond() > r.Time.Nanosecond() {
		secs++
	}
	return secs
}

// ceilSeconds rounds d up to whole seconds (0 for d <= 0).
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(d/time.Second) + min(1, int64(d%time.Second))
}

func writeProblem(w http.ResponseWriter, status int, detail string) {
	writeJSONProblem(w, Problem{Type: "about:blank", Title: http.StatusText(status), Status: status, Detail: detail})
}

func writeJSONProblem(w http.ResponseWriter, p Problem) {
	body, _ := json.Marshal(p) // a struct of strings and ints always marshals
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)+1))
	w.WriteHeader(p.Status)
	_, _ = w.Write(append(body, '\n'))
}
