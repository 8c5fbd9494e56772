package ratelimit

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrInvalid is matched (errors.Is) by every error that rejects bad input before any SQL runs:
// *ConfigError, *ArgumentError and *UnknownLimitError. Nothing is written when it is returned.
var ErrInvalid = errors.New("ratelimit: invalid input")

// ConfigError reports a Config field that is out of range. Nothing was written.
type ConfigError struct {
	// Limit is the name of the limit whose config is wrong.
	Limit string
	// Field is the Config field, e.g. "Rate".
	Field string
	// Value is the offending value.
	Value any
	// Reason says what the field must be.
	Reason string
}

// Error names the limit, the field, what it must be and the value it had.
func (e *ConfigError) Error() string {
	return fmt.Sprintf("ratelimit: limit %q: Config.%s %s (got %v)", e.Limit, e.Field, e.Reason, e.Value)
}

// Is makes errors.Is(err, ErrInvalid) true.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalid }

// ArgumentError reports a bad argument to a call: a count, key or name, a handle, an option.
// Nothing was written. Package scheduler returns it too, for its own calls' arguments.
type ArgumentError struct {
	// Op is the call, e.g. "Limit".
	Op string
	// Arg is the argument, e.g. "count", "key", "name", "db", "requests", "opts", "Reserve" or
	// "LimiterConfig.Now"; a field of an options struct is named with its path
	// ("HousekeepingConfig.Queue").
	Arg string
	// Reason says what is wrong.
	Reason string
	// Err is the error of the other library that refused the value, when the refusal was not
	// this package's own. Defaults to nil.
	Err error
}

// Error names the call, the argument and what is wrong with it.
func (e *ArgumentError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("ratelimit: %s: %s %s: %v", e.Op, e.Arg, e.Reason, e.Err)
	}
	return fmt.Sprintf("ratelimit: %s: %s %s", e.Op, e.Arg, e.Reason)
}

// Is makes errors.Is(err, ErrInvalid) true.
func (e *ArgumentError) Is(target error) bool { return target == ErrInvalid }

// Unwrap returns Err, the other library's refusal, if any.
func (e *ArgumentError) Unwrap() error { return e.Err }

// UnknownLimitError reports a name that the Limiter does not know, used without an inline config.
type UnknownLimitError struct {
	// Name is the unknown limit name.
	Name string
}

// Error names the unknown limit and says how to make it known.
func (e *UnknownLimitError) Error() string {
	return fmt.Sprintf("ratelimit: unknown limit %q: register it in LimiterConfig.Limits or pass a Config with the call", e.Name)
}

// Is makes errors.Is(err, ErrInvalid) true.
func (e *UnknownLimitError) Is(target error) bool { return target == ErrInvalid }

// LimitedError is a denial turned into an error, for callers who set AsError so that a denial aborts
// their transaction. It is returned only for denials: a granted reservation is never an error.
type LimitedError struct {
	// Name and Key identify the (first) denied limit.
	Name, Key string
	// RetryAt is when the call could succeed: the latest RetryAt of all denied limits.
	RetryAt time.Time
	// Time is the clock reading the denial was decided with (Result.Time): the database's clock
	// unless LimiterConfig.Now is set. RetryAt - Time is the wait; see RetryAfter.
	Time time.Time
	// Denied lists every denied limit (one element for a single-limit call).
	Denied []Result
}

// Error lists every denied (name, key) and the time to retry at.
func (e *LimitedError) Error() string {
	var b strings.Builder
	b.WriteString("ratelimit: rate limited: ")
	for i, d := range e.Denied {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%q key %q", d.Name, d.Key)
	}
	fmt.Fprintf(&b, "; retry at %s", e.RetryAt.UTC().Format(time.RFC3339Nano))
	return b.String()
}

// RetryAfter returns RetryAt - Time, the wait before retrying on the clock the denial was decided
// with (0 when there is none).
func (e *LimitedError) RetryAfter() time.Duration { return waitUntil(e.RetryAt, e.Time) }

// IsLimited reports whether err is, or wraps, a *LimitedError.
func IsLimited(err error) bool {
	var le *LimitedError
	return errors.As(err, &le)
}

// RetriesExhaustedError is returned by InSerializableTx, and by a Batcher's calls, when every
// attempt failed with a serialization failure or deadlock. It wraps the last cause.
type RetriesExhaustedError struct {
	// Attempts is how many times the transaction or batch ran, reruns after a *BusyError's wait
	// (which cost no attempt of TxOpts.MaxAttempts) included.
	Attempts int
	// Err is the last cause.
	Err error

	what string // what gave up: "serializable transaction", "batch of 3 calls"
}

// Error says what gave up, after how many attempts, and what the last one failed with.
func (e *RetriesExhaustedError) Error() string {
	what := e.what
	if what == "" {
		what = "serializable transaction"
	}
	return fmt.Sprintf("ratelimit: %s gave up after %d attempts: %v", what, e.Attempts, e.Err)
}

// Unwrap returns the last cause, so errors.Is and errors.As see through the give-up.
func (e *RetriesExhaustedError) Unwrap() error { return e.Err }

// BusyError is returned by Limit and LimitN (and a LimitMany of one request, which is decided as
// they are) on a sharded limit inside a REPEATABLE READ or SERIALIZABLE transaction when every
// candidate shard was taken by another transaction at that moment (deciding on it, or having
// passed over it as stale: see the package doc, "Shards"). The call wrote nothing. It is a
// serialization failure: there the call could only have waited for a shard that another
// transaction is about to commit, and then failed with SQLSTATE 40001 anyway, so it fails at once
// instead. Roll the transaction back and run it again after a backoff; InSerializableTx does. It unwraps to a *pgconn.PgError with Code "40001",
// so IsRetryable and retry loops that look for that code treat it as one.
type BusyError struct {
	// Name and Key identify the limit.
	Name, Key string
	// Candidates is how many shards the call tried.
	Candidates int

	first int32 // the call's first candidate shard, which InSerializableTx waits for
}

// Error names the limit and how many shards were tried.
func (e *BusyError) Error() string {
	return fmt.Sprintf("ratelimit: limit %q key %q: all %d candidate shards are being decided on by other transactions; retry the transaction (SQLSTATE 40001)",
		e.Name, e.Key, e.Candidates)
}

// Unwrap returns the serialization failure this is: a *pgconn.PgError with Code "40001".
func (e *BusyError) Unwrap() error {
	return &pgconn.PgError{Severity: "ERROR", Code: "40001", Message: e.Error()}
}

// IsRetryable reports whether err is a Postgres serialization failure (SQLSTATE 40001) or deadlock
// (40P01), a *BusyError among them: the transaction can be retried from the start. The SQLSTATE
// is that of the first error in err's chain with an SQLState method: pgx's *pgconn.PgError, and
// lib/pq's *pq.Error from an application's own statements in a *sql.Tx.
func IsRetryable(err error) bool {
	var coded interface{ SQLState() string }
	if errors.As(err, &coded) {
		code := coded.SQLState()
		return code == "40001" || code == "40P01"
	}
	return false
}
