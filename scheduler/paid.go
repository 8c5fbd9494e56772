package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
)

// paidKey is the key of job metadata under which a job records the attempts that have already
// paid for their tokens: ReserveTx sets it for attempt 1 (standing for every limit the job
// reserved), a Gate for each limit it reserved on and snoozed the job for. A Gate lets such an
// attempt through without taking its limit's tokens again, and clears its record once the job has
// run. A Gate that was denied records there too when it may ask again. River UI shows it with the
// job's other metadata.
const paidKey = "txlimit_paid"

// payments is the value stored under paidKey.
type payments struct {
	// Attempt, when set, is the attempt ReserveTx's reservation paid for: it stands for whatever
	// the job reserved, so every Gate lets that attempt through. River keeps a job's attempt
	// number across snoozes and increments it for a retry, so a retry pays again.
	Attempt int `json:"attempt,omitempty"`

	// Limits are the Gates' payments (or denials), one per limit (name, key): a payment counts only
	// for the limit it names, so a job behind two Gates pays each, once.
	Limits []gatePayment `json:"limits,omitempty"`

	// Name, Key and Due are a Gate's payment as versions before Limits recorded it, with Attempt
	// its attempt: read into Limits, never written. Without Name (versions before payments named
	// their limit), Attempt and Due are a payment for any Gate, due then.
	Name string    `json:"name,omitempty"`
	Key  string    `json:"key,omitempty"`
	Due  time.Time `json:"due,omitzero"`
}

// gatePayment is a Gate's payment of one limit for one attempt of a job, or, with RetryAt set, its
// denial: nothing paid, and the time before which the Gate does not ask again.
type gatePayment struct {
	Name    string `json:"name"`
	Key     string `json:"key"`
	Attempt int    `json:"attempt"`
	// Due is when the tokens are due, on the clock of the process that reserved them (River
	// schedules snoozes on the same clock); for tokens taken at once, when they were taken; on a
	// denial, the denial's RetryAt.
	Due time.Time `json:"due,omitzero"`
	// RetryAt, set on a denial, is the denial's RetryAt plus the Gate's jitter, on the same clock:
	// the job, snoozed as often as it takes, does not ask again from one snooze before Due to
	// RetryAt (before that it asks at every wake-up, the limit may have changed).
	RetryAt time.Time `json:"retry_at,omitzero"`
}

// readPayments returns the payments recorded in a job's metadata; none when it has none or they
// cannot be read.
func readPayments(metadata []byte) payments {
	var m struct {
		Paid *payments `json:"txlimit_paid"`
	}
	if len(metadata) == 0 || json.Unmarshal(metadata, &m) != nil || m.Paid == nil {
		return payments{}
	}
	p := *m.Paid
	if p.Name != "" { // an earlier version's single Gate payment
		p.Limits = append(p.Limits, gatePayment{Name: p.Name, Key: p.Key, Attempt: p.Attempt, Due: p.Due})
		p.Attempt, p.Name, p.Key, p.Due = 0, "", "", time.Time{}
	}
	return p
}

// gateRun is the Gates' bookkeeping of one run of a job. The first Gate the job passes reads it
// from the job's metadata and shares it through the context with the Gates inside it (one in
// river.Config.Middleware, one of the worker, say): each changes its own limit's payment, and each
// stores the whole record (river.MetadataSet replaces the key's value), the outermost last.
type gateRun struct {
	jobID   int64
	attempt int
	// read is what the job's metadata recorded when the run started: what each Gate finds paid.
	read payments
	// pay is what the run will record: read, changed by the Gates the job passed.
	pay payments
	// snoozed reports that a Gate snoozed the job for its limit: the Gates it had passed keep
	// their payments for the job's next run.
	snoozed bool
}

type gateRunKey struct{}

// gateRunOf returns the bookkeeping of job's run, from ctx when an outer Gate started it, and the
// context that carries it.
func gateRunOf(ctx context.Context, job *rivertype.JobRow) (*gateRun, context.Context) {
	if r, ok := ctx.Value(gateRunKey{}).(*gateRun); ok && r.jobID == job.ID {
		return r, ctx
	}
	read := readPayments(job.Metadata)
	pay := read
	pay.Limits = slices.Clone(read.Limits)
	r := &gateRun{jobID: job.ID, attempt: job.Attempt, read: read, pay: pay}
	return r, context.WithValue(ctx, gateRunKey{}, r)
}

// paid returns the payment of the run's attempt for the limit id, as the run found it: ReserveTx's,
// which stands for every limit (Name empty, Due zero; an earlier version's Gate payment for any
// limit has its Due), or a Gate's of that limit, or its denial (RetryAt set).
func (r *gateRun) paid(id limitID) (gatePayment, bool) {
	if r.read.Attempt != 0 && r.read.Attempt == r.attempt {
		return gatePayment{Attempt: r.attempt, Due: r.read.Due}, true
	}
	for _, p := range r.read.Limits {
		if p.Name == id.name && p.Key == id.key && p.Attempt == r.attempt {
			return p, true
		}
	}
	return gatePayment{}, false
}

// set records p: ReserveTx's payment when p.Name is empty, else a Gate's, replacing any payment of
// its limit.
func (r *gateRun) set(p gatePayment) {
	if p.Name == "" {
		r.pay.Attempt = p.Attempt
		return
	}
	r.clear(p)
	r.pay.Limits = append(r.pay.Limits, p)
}

// clear removes the payment p: ReserveTx's when p.Name is empty, else the Gate's of its limit.
func (r *gateRun) clear(p gatePayment) {
	if p.Name == "" {
		r.pay.Attempt = 0
		return
	}
	r.pay.Limits = slices.DeleteFunc(r.pay.Limits, func(q gatePayment) bool { return q.Name == p.Name && q.Key == p.Key })
}

// store records the run's payments in the job's metadata when the attempt ends, dropping those
// of other attempts; the key is null when none is left.
func (r *gateRun) store(ctx context.Context) error {
	if r.pay.Attempt != r.attempt {
		r.pay.Attempt = 0
	}
	kept := r.pay.Limits[:0]
	for _, p := range r.pay.Limits {
		if p.Attempt == r.attempt {
			kept = append(kept, p)
		}
	}
	r.pay.Limits = kept
	var v any
	if r.pay.Attempt != 0 || len(r.pay.Limits) > 0 {
		v = r.pay
	}
	return river.MetadataSet(ctx, paidKey, v)
}

// ownedKeys are the job metadata keys this package writes: the job's payment, reservation,
// settlement and stranded mark.
var ownedKeys = []string{paidKey, reservedKey, settledKey, strandedKey}

// withPaid returns the metadata of a new reserved job: the caller's metadata (a JSON object, or
// empty) without the package's own keys, which would be another job's bookkeeping (metadata
// copied from a job that was settled makes a new reservation look settled: never refunded, never
// reported stranded), and with paidKey set to ReserveTx's payment of attempt 1.
func withPaid(metadata []byte) ([]byte, error) {
	return withKey(metadata, paidKey, payments{Attempt: 1}, ownedKeys...)
}

// withKey returns metadata (a JSON object, or empty) without the keys drop and with key set to v.
func withKey(metadata []byte, key string, v any, drop ...string) ([]byte, error) {
	m := map[string]json.RawMessage{} // raw values: the caller's numbers and nesting stay as they were
	if len(metadata) > 0 {
		if err := json.Unmarshal(metadata, &m); err != nil {
			return nil, fmt.Errorf("must be a JSON object: %w", err)
		}
		if m == nil { // "null"
			m = map[string]json.RawMessage{}
		}
	}
	for _, k := range drop {
		delete(m, k)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	m[key] = b
	return json.Marshal(m)
}
