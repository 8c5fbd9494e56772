package scheduler

import (
	"fmt"

	"github.com/txlimit/txlimit/ratelimit"
)

// argError is bad input to op, a call of this package: an *ratelimit.ArgumentError (errors.As;
// errors.Is(err, ratelimit.ErrInvalid)) whose message names the call the user made,
// "scheduler: New: limiter is nil: pass ...", where ratelimit's would say "ratelimit: New: ...".
// err, when not nil, is another library's refusal of the value (River's).
func argError(op, arg, reason string, err error) error {
	return &schedArgError{&ratelimit.ArgumentError{Op: op, Arg: arg, Reason: reason, Err: err}}
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
