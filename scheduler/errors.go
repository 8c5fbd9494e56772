package scheduler

import (
	"fmt"

	"github.com/txlimit/txlimit/internal/nilarg"
	"github.com/txlimit/txlimit/ratelimit"
)

// argError is bad input to op, a call of this package: an *ratelimit.ArgumentError (errors.As;
// errors.Is(err, ratelimit.ErrInvalid)) whose message names the call the user made,
// "scheduler: New: limiter is nil: pass ...", where ratelimit's would say "ratelimit: New: ...".
// err, when not nil, is another library's refusal of the value (River's).
func argError(op, arg, reason string, err error) error {
	return &schedArgError{&ratelimit.ArgumentError{Op: op, Arg: arg, Reason: reason, Err: err}}
}

// nilArg returns the *ratelimit.ArgumentError of op's argument arg when v is nil, a nil pointer in
// an interface included (a nil *pgxpool.Tx as a pgx.Tx, a nil pointer to a job's args), which would
// panic at its first method call; fix says what to pass. It is nil otherwise. Package ratelimit
// checks its Executor the same way.
func nilArg(op, arg string, v any, fix string) error {
	if r := nilarg.Reason(v); r != "" {
		return argError(op, arg, r+": "+fix, nil)
	}
	return nil
}

// schedArgError is a *ratelimit.ArgumentError reported by this package.
type schedArgError struct{ *ratelimit.ArgumentError }

func (e *schedArgError) Error() string {
	s := fmt.Sprintf("scheduler: %s: %s %s", e.Op, e.Arg, e.Reason)
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the *ratelimit.ArgumentError, which unwraps to the other library's refusal.
func (e *schedArgError) Unwrap() error { return e.ArgumentError }
