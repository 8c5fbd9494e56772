package scheduler

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// ReservedKey is the key of job metadata under which ReserveTx and ReserveManyTx record what the
// job reserved, for CancelTx, SettleTx and the pull-forward of waiting jobs. River UI shows it
// with the job's other metadata; do not edit it.
const ReservedKey = "txlimit_reserved"

// SettledKey is the key of job metadata under which SettleTx records the job's settlement, so that
// a second settlement of the job changes nothing.
const SettledKey = "txlimit_settled"

// reservation is the value stored under ReservedKey.
type reservation struct {
	// Limits are the reserved limits, in request order.
	Limits []reservedLimit `json:"limits"`
	// Jitter is the jitter added to the latest RetryAt.
	Jitter time.Duration `json:"jitter,omitempty"`
	// NotBefore is the caller's InsertOpts.ScheduledAt, if any: the job never moves before it.
	NotBefore time.Time `json:"not_before,omitzero"`
}

// reservedLimit is one limit of a reservation, and where the job stands in its queue.
type reservedLimit struct {
	Name  string  `json:"name"`
	Key   string  `json:"key"` // no omitempty: the pull-forward query matches {"name", "key"}
	Count float64 `json:"count"`
	// Config is the inline config of the reservation, nil for the registered one.
	Config *ratelimit.Config `json:"config,omitempty"`
	// RetryAt is when the job's tokens of this limit accrue; zero when they were there at once.
	RetryAt time.Time `json:"retry_at,omitzero"`
	// Owed and At (fixed windows only): Owed tokens still to accrue from the window starting at At.
	Owed float64   `json:"owed,omitempty"`
	At   time.Time `json:"at,omitzero"`
	// Fixed marks a limit whose credits do not move the job (a sharded limit: a credit goes to
	// the emptiest shards, which need not be the ones the job charged).
	Fixed bool `json:"fixed,omitempty"`
}

// due returns when every limit of r has accrued: the latest RetryAt (zero when none waits).
func (r *reservation) due() time.Time {
	var at time.Time
	for _, l := range r.Limits {
		if l.RetryAt.After(at) {
			at = l.RetryAt
		}
	}
	return at
}

// scheduledAt returns when a job with reservation r is due: its latest RetryAt plus its jitter,
// or NotBefore when that is later. Zero when it runs now.
func (r *reservation) scheduledAt() time.Time {
	at := r.due()
	if !at.IsZero() {
		at = at.Add(r.Jitter)
	}
	if r.NotBefore.After(at) {
		at = r.NotBefore
	}
	return at
}

// newReservedLimit records a granted decision of count tokens of (name, key) under cfg (the
// config in force, inline when inline is set).
func newReservedLimit(res ratelimit.Result, count float64, cfg ratelimit.Config, inline *ratelimit.Config) reservedLimit {
	l := reservedLimit{Name: res.Name, Key: res.Key, Count: count}
	if inline != nil {
		c := *inline
		if !(c.MaxReserved <= ratelimit.MaxAmount) { // an unbounded MaxReserved (+Inf) has no JSON
			c.MaxReserved = ratelimit.MaxAmount
		}
		l.Config = &c
	}
	if !res.Reserved || res.RetryAt.IsZero() {
		return l
	}
	l.RetryAt = res.RetryAt.UTC()
	switch {
	case cfg.Shards > 1:
		l.Fixed = true
	case cfg.Kind == ratelimit.FixedWindow:
		// The row was left at res.Value (< 0) at the start of a window; RetryAt is the first
		// window start at which whole windows of Rate have paid that back.
		w := windowsFor(-res.Value, cfg.Rate)
		if w*float64(cfg.Period) > maxPull {
			l.Fixed = true // centuries away: not worth the overflow checks
			break
		}
		l.Owed = -res.Value
		l.At = l.RetryAt.Add(-time.Duration(w) * cfg.Period)
	case float64(l.RetryAt.Sub(res.Time)) >= maxPull:
		l.Fixed = true
	}
	return l
}

// maxPull bounds, in nanoseconds, the waits that pull-forward computes with: about 146 years,
// half of time.Duration's range, so that no arithmetic on them overflows.
const maxPull = float64(1 << 62)

// windowsFor returns the fewest whole windows of rate tokens that pay back owed: the least n
// with rate·n >= owed, computed as the decision computes it.
func windowsFor(owed, rate float64) float64 {
	if owed <= 0 {
		return 0
	}
	n := math.Ceil(owed / rate)
	for n > 1 && rate*(n-1) >= owed {
		n--
	}
	for rate*n < owed {
		n++
	}
	return n
}

// credit moves l forward by credited tokens given back to its limit at now (the credit's clock
// reading), cfg being the config in force. It reports whether l changed.
//
// The tokens of a job that reserved are due when the limit, counting only the reservations made
// up to and including the job's, is back at zero; the job needed e tokens of refill still at now
// (its place in the limit's queue). A credit of c out of a reservation made before the job's (or
// the job's own) raises that level by c, so the job now needs max(e - c, 0): for a token bucket of r tokens per unit of time,
// e = r·(RetryAt - now) and the new RetryAt is now + max(e - c, 0)/r, i.e. RetryAt - c/r but
// never before now; for a fixed window, e is what is still owed after the windows that have
// started since, and the new RetryAt is the first window start that pays back max(e - c, 0).
func (l *reservedLimit) credit(cfg ratelimit.Config, credited float64, now time.Time) bool {
	if l.Fixed || l.RetryAt.IsZero() || !l.RetryAt.After(now) || credited <= 0 {
		return false
	}
	periodUs := float64(cfg.Period.Microseconds())
	if cfg.Kind == ratelimit.FixedWindow {
		if l.At.IsZero() {
			return false // reserved as a token bucket: the config changed since, keep the time
		}
		n := int64(0)
		if now.After(l.At) {
			n = int64(now.Sub(l.At) / cfg.Period)
		}
		at := l.At.Add(time.Duration(n) * cfg.Period)
		owed := max(l.Owed-cfg.Rate*float64(n)-credited, 0)
		if owed == 0 {
			l.Owed, l.At, l.RetryAt = 0, at, now
			return true
		}
		// Record what is still owed even when it is due in the same window as before, so that the
		// next credit starts from it. Never later than it was (this also bounds the arithmetic).
		if w := windowsFor(owed, cfg.Rate); w*float64(cfg.Period) <= float64(l.RetryAt.Sub(at)) {
			l.Owed, l.At = owed, at
			l.RetryAt = at.Add(time.Duration(w) * cfg.Period)
			return true
		}
		return false
	}
	waitUs := float64(l.RetryAt.Sub(now).Microseconds())
	e := cfg.Rate * waitUs / periodUs
	e -= credited
	if e <= 0 {
		l.RetryAt = now
		return true
	}
	if w := math.Ceil(e * periodUs / cfg.Rate); w < waitUs { // never later than it was
		l.RetryAt = now.Add(time.Duration(w) * time.Microsecond)
		return true
	}
	return false
}

// limitID is a (name, key).
type limitID struct{ name, key string }

// pullForward reschedules, in tx, the reserved jobs waiting on the limits in credited (tokens
// given back to each, at the clock reading now, by job from, the one cancelled or settled) to the
// earliest time their tokens accrue given the credit, never later than they were, and returns how
// many moved earlier. Only job from and the jobs that reserved after it move: the tokens came out
// of its reservation, so the jobs ahead of it in the queue never counted them. On one (name, key)
// job IDs are in reservation order, since a reservation holds the limit's row lock until its
// transaction, which inserts the job, ends. Jobs locked by another transaction keep their time.
func (s *Scheduler) pullForward(ctx context.Context, db schedsql.DBTX, from int64, credited map[limitID]float64, now time.Time) (int, error) {
	ids := make([]limitID, 0, len(credited))
	for id, c := range credited {
		if c > 0 {
			ids = append(ids, id)
		}
	}
	slices.SortFunc(ids, func(a, b limitID) int { return cmp.Or(cmp.Compare(a.name, b.name), cmp.Compare(a.key, b.key)) })
	q := schedsql.New()
	var rows []schedsql.WaitingRow
	seen := map[int64]bool{}
	for _, id := range ids { // one query per limit, so that River's GIN index on metadata can serve it
		filter, err := json.Marshal(map[string]any{ReservedKey: map[string]any{"limits": []map[string]string{{"name": id.name, "key": id.key}}}})
		if err != nil {
			return 0, err
		}
		found, err := q.Waiting(ctx, db, schedsql.WaitingParams{Filter: string(filter), FromID: from, Now: ts(now)})
		if err != nil {
			return 0, fmt.Errorf("pull forward waiting jobs: %w", err)
		}
		for _, row := range found {
			if !seen[row.ID] { // a job waiting on two of the credited limits
				seen[row.ID] = true
				rows = append(rows, row)
			}
		}
	}
	if len(rows) == 0 {
		return 0, nil
	}
	var params schedsql.RescheduleParams
	earlier := 0
	for _, row := range rows {
		var r reservation
		if err := json.Unmarshal(row.Reserved, &r); err != nil {
			continue // not written by this package: leave it
		}
		moved := false
		for i := range r.Limits {
			l := &r.Limits[i]
			c := credited[limitID{l.Name, l.Key}]
			if c <= 0 {
				continue
			}
			cfg, err := s.limiter.Lookup(l.Name, l.Key, l.Config)
			if err != nil {
				continue // the limit is no longer registered: the job keeps its time
			}
			moved = l.credit(cfg, c, now) || moved
		}
		if !moved {
			continue
		}
		// Store the moved limits even when another limit keeps the job where it is, so that a
		// later credit of that one moves it as far as both allow.
		at := r.scheduledAt()
		if at.Before(row.ScheduledAt.Time) {
			earlier++
		} else {
			at = row.ScheduledAt.Time
		}
		b, err := json.Marshal(&r)
		if err != nil {
			return 0, err
		}
		params.Ids = append(params.Ids, row.ID)
		params.ScheduledAts = append(params.ScheduledAts, ts(at))
		params.Reserveds = append(params.Reserveds, string(b))
	}
	if len(params.Ids) == 0 {
		return 0, nil
	}
	if _, err := q.Reschedule(ctx, db, params); err != nil {
		return 0, fmt.Errorf("pull forward waiting jobs: %w", err)
	}
	return earlier, nil
}

func ts(t time.Time) pgtype.Timestamptz { return pgtype.Timestamptz{Time: t, Valid: true} }
