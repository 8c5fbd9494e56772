package scheduler

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txlimit/txlimit/internal/countbound"
	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// reservedKey is the key of job metadata under which ReserveTx and ReserveManyTx record what the
// job reserved, for CancelTx, SettleTx and the pull-forward of waiting jobs. River UI shows it
// with the job's other metadata; do not edit it.
const reservedKey = "txlimit_reserved"

// settledKey is the key of job metadata under which SettleTx records the job's settlement, so that
// a second settlement of the job changes nothing.
const settledKey = "txlimit_settled"

// reservation is the value stored under reservedKey.
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
	// Row is the limit's row as the job's reservation left it, plus every credit given back since
	// out of the job's reservation or an earlier one: the job's tokens have accrued when this row
	// is out of debt. Nil when the job did not wait, or waits on a Fixed limit.
	Row *queueRow `json:"row,omitempty"`
	// Fixed marks a limit whose credits do not move the job (a sharded limit: a credit goes to
	// the emptiest shards, which need not be the ones the job charged).
	Fixed bool `json:"fixed,omitempty"`
}

// queueRow is a state (value, ts) of a limit's row (docs/spec.md §1).
type queueRow struct {
	Value float64   `json:"value"`
	TS    time.Time `json:"ts"`
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

// largestMaxReserved is the largest finite Config.MaxReserved ratelimit accepts (countbound.Max),
// which stands for Unbounded in a recorded config.
const largestMaxReserved = countbound.Max

// newReservedLimit records a granted decision of count tokens of (name, key), with its inline
// config, if any.
func newReservedLimit(res ratelimit.Result, count float64, inline *ratelimit.Config) reservedLimit {
	l := reservedLimit{Name: res.Name, Key: res.Key, Count: count}
	if inline != nil {
		c := *inline
		if !(c.MaxReserved <= largestMaxReserved) { // an unbounded MaxReserved (+Inf) has no JSON
			c.MaxReserved = largestMaxReserved
		}
		l.Config = &c
	}
	if !res.Reserved || res.RetryAt.IsZero() {
		return l
	}
	l.RetryAt = res.RetryAt.UTC()
	if res.Config.Shards > 1 || res.TS.IsZero() {
		l.Fixed = true
	} else {
		l.Row = &queueRow{Value: res.Value, TS: res.TS.UTC()}
	}
	return l
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
//
// A job's tokens of a limit accrue when the limit, counting only the reservations made up to and
// including the job's, is out of debt: when the row its reservation left, plus every credit since
// out of its reservation or an earlier one (reservedLimit.Row), is out of debt. The credit is added
// to the row of each job it moves, and the engine says, for all of them in one statement, when
// each row is out of debt from now on (Limiter.OutOfDebtAt: the SQL that computes every RetryAt).
func (s *Scheduler) pullForward(ctx context.Context, tx pgx.Tx, from int64, credited map[limitID]float64, now time.Time) (int, error) {
	ids := make([]limitID, 0, len(credited))
	for id, c := range credited {
		if c > 0 {
			ids = append(ids, id)
		}
	}
	slices.SortFunc(ids, func(a, b limitID) int { return cmp.Or(cmp.Compare(a.name, b.name), cmp.Compare(a.key, b.key)) })
	q := schedsql.New()
	var found []schedsql.WaitingRow
	seen := map[int64]bool{}
	for _, id := range ids { // one query per limit, so that River's GIN index on metadata can serve it
		filter, err := json.Marshal(map[string]any{reservedKey: map[string]any{"limits": []map[string]string{{"name": id.name, "key": id.key}}}})
		if err != nil {
			return 0, err
		}
		rows, err := q.Waiting(ctx, tx, schedsql.WaitingParams{Filter: string(filter), FromID: from, Now: ts(now)})
		if err != nil {
			return 0, fmt.Errorf("pull forward waiting jobs: %w", err)
		}
		for _, row := range rows {
			if !seen[row.ID] { // a job waiting on two of the credited limits
				seen[row.ID] = true
				found = append(found, row)
			}
		}
	}

	// Add the credits to the rows of the jobs they move, and ask when those rows are out of debt.
	type job struct {
		id          int64
		scheduledAt time.Time
		r           reservation
	}
	type line struct{ job, limit int } // a credited limit of a job: jobs[job].r.Limits[limit]
	var jobs []job
	var lines []line
	var rows []ratelimit.Row
	for _, row := range found {
		var r reservation
		if err := json.Unmarshal(row.Reserved, &r); err != nil {
			continue // not written by this package: leave it
		}
		n := len(lines)
		for i := range r.Limits {
			l := &r.Limits[i]
			c := credited[limitID{l.Name, l.Key}]
			if c <= 0 || l.Row == nil || l.Row.TS.IsZero() || !l.RetryAt.After(now) {
				continue // not credited, Fixed, or accrued already
			}
			if cfg, err := s.limiter.Lookup(l.Name, l.Key, l.Config); err != nil || cfg.Shards > 1 {
				continue // no longer registered, or sharded since: the job keeps its time
			}
			l.Row.Value += c
			lines = append(lines, line{job: len(jobs), limit: i})
			rows = append(rows, ratelimit.Row{Name: l.Name, Key: l.Key, Config: l.Config, Value: l.Row.Value, TS: l.Row.TS})
		}
		if len(lines) > n {
			jobs = append(jobs, job{id: row.ID, scheduledAt: row.ScheduledAt.Time, r: r})
		}
	}
	if len(rows) == 0 {
		return 0, nil
	}
	due, err := s.limiter.OutOfDebtAt(ctx, tx, now, rows)
	if err != nil {
		return 0, fmt.Errorf("pull forward waiting jobs: %w", err)
	}
	for k, ln := range lines {
		if l := &jobs[ln.job].r.Limits[ln.limit]; due[k].Before(l.RetryAt) { // never later than it was
			l.RetryAt = due[k]
		}
	}

	// Store every credited job's rows, also where another limit keeps the job where it is (so that
	// a later credit of that one moves it as far as both allow), or where the credit moved no time
	// (a fixed window's credit too small to pay back a whole window: the next one adds to it).
	var params schedsql.RescheduleParams
	earlier := 0
	for _, j := range jobs {
		at := j.r.scheduledAt()
		if at.Before(j.scheduledAt) {
			earlier++
		} else {
			at = j.scheduledAt
		}
		b, err := json.Marshal(&j.r)
		if err != nil {
			return 0, err
		}
		params.Ids = append(params.Ids, j.id)
		params.ScheduledAts = append(params.ScheduledAts, ts(at))
		params.Reserveds = append(params.Reserveds, string(b))
	}
	if _, err := q.Reschedule(ctx, tx, params); err != nil {
		return 0, fmt.Errorf("pull forward waiting jobs: %w", err)
	}
	return earlier, nil
}

func ts(t time.Time) pgtype.Timestamptz { return pgtype.Timestamptz{Time: t, Valid: true} }
