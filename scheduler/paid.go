package scheduler

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/riverqueue/river/rivertype"
)

// paidKey is the key of job metadata under which a job records that one of its attempts has
// already paid for its tokens: ReserveTx sets it for attempt 1, Gate for an attempt it reserved
// and snoozed. Gate lets such an attempt run without taking tokens again, and clears the key when
// it does. River UI shows it with the job's other metadata.
const paidKey = "txlimit_paid"

// paid is the value stored under paidKey.
type paid struct {
	// Attempt is the attempt the tokens were paid for. River keeps a job's attempt number across
	// snoozes and increments it for a retry, so a retry pays again.
	Attempt int `json:"attempt"`
	// Due, when set, is when the reservation's tokens are due, on the clock of the process that
	// reserved them (River schedules snoozes on the same clock).
	Due time.Time `json:"due,omitzero"`
	// Name and Key are the limit a Gate paid; empty for ReserveTx's payment, which stands for
	// whatever the job reserved.
	Name string `json:"name,omitempty"`
	Key  string `json:"key,omitempty"`
}

// paidFor returns the payment recorded on job for its current attempt and the limit (name, key),
// if any: a Gate's payment counts only for its own limit, so that a second Gate on the job (one
// global, one of the worker) never takes the first one's payment for its own.
func paidFor(job *rivertype.JobRow, name, key string) (paid, bool) {
	var m struct {
		Paid *paid `json:"txlimit_paid"`
	}
	if len(job.Metadata) == 0 || json.Unmarshal(job.Metadata, &m) != nil || m.Paid == nil {
		return paid{}, false
	}
	p := *m.Paid
	return p, p.Attempt == job.Attempt && (p.Name == "" || p.Name == name && p.Key == key)
}

// withPaid returns metadata (a JSON object, or empty) with paidKey set to p.
func withPaid(metadata []byte, p paid) ([]byte, error) { return withKey(metadata, paidKey, p) }

// withKey returns metadata (a JSON object, or empty) with key set to v.
func withKey(metadata []byte, key string, v any) ([]byte, error) {
	m := map[string]json.RawMessage{} // raw values: the caller's numbers and nesting stay as they were
	if len(metadata) > 0 {
		if err := json.Unmarshal(metadata, &m); err != nil {
			return nil, fmt.Errorf("must be a JSON object: %w", err)
		}
		if m == nil { // "null"
			m = map[string]json.RawMessage{}
		}
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	m[key] = b
	return json.Marshal(m)
}
