//go:build reliability

package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txlimit/txlimit/ratelimit"
)

// soakEnvDuration reads a Go duration from the environment variable name, or returns def when it
// is unset.
func soakEnvDuration(t *testing.T, name string, def time.Duration) time.Duration {
	t.Helper()
	return soakEnv(t, name, def, time.ParseDuration, "a positive Go duration such as 60s or 10m")
}

// soakEnvInt reads a positive integer from the environment variable name, or returns def when it
// is unset.
func soakEnvInt(t *testing.T, name string, def int) int {
	t.Helper()
	return soakEnv(t, name, def, strconv.Atoi, "a positive integer")
}

// soakEnv reads the environment variable name with parse, or returns def when it is unset. A value
// that does not parse, or is not positive, fails the test, saying it wants what: a typo must not
// silently run the default.
func soakEnv[T int | time.Duration](t *testing.T, name string, def T, parse func(string) (T, error), what string) T {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := parse(s)
	if err != nil || v <= 0 {
		t.Fatalf("%s=%q: want %s", name, s, what)
	}
	return v
}

// soakSeconds formats d the way the summary lines do: whole seconds as "60s", otherwise as Go
// prints durations.
func soakSeconds(d time.Duration) string {
	if d%time.Second == 0 {
		return fmt.Sprintf("%ds", d/time.Second)
	}
	return d.String()
}

// soakQuietLogger discards River's log: the faults this suite injects are expected to make River
// complain.
func soakQuietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// soakErrClass names the kind of an error for the tallies in the logs: "limited" for a denial
// returned as an error, "retries" when InSerializableTx gave up, the SQLSTATE of a Postgres error
// (57P01 is a terminated backend), "timeout", "connection" for a connection that broke or could
// not be made, and "other".
func soakErrClass(err error) string {
	var pgErr *pgconn.PgError
	var exhausted *ratelimit.RetriesExhaustedError
	switch {
	case ratelimit.IsLimited(err):
		return "limited"
	case errors.As(err, &exhausted):
		return "retries"
	case errors.As(err, &pgErr):
		return pgErr.Code
	case errors.Is(err, context.DeadlineExceeded), pgconn.Timeout(err):
		return "timeout"
	case soakConnError(err):
		return "connection"
	}
	return "other"
}

// soakConnError reports whether err says the connection to the server broke or could not be
// made: what a terminated backend or a stopped server looks like from the client.
func soakConnError(err error) bool {
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) || pgconn.SafeToRetry(err) {
		return true
	}
	msg := err.Error()
	for _, s := range []string{"conn closed", "connection reset", "broken pipe", "unexpected EOF", "EOF",
		"connection refused", "closed pool", "failed to deallocate", "receive message", "write failed", "read failed"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// soakBug reports whether err can only come from a bug, in the library or in this test, rather than
// from an injected fault: input the library rejected (the test sends only valid input) or the
// library's own "internal error" (a grant it could not account for).
func soakBug(err error) bool {
	return errors.Is(err, ratelimit.ErrInvalid) || strings.Contains(err.Error(), "internal error")
}

// soakTally counts errors by class and keeps the first example of each, for the logs.
type soakTally struct {
	mu    sync.Mutex
	count map[string]int64
	first map[string]string
}

func (s *soakTally) add(err error) {
	class := soakErrClass(err)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.count == nil {
		s.count, s.first = map[string]int64{}, map[string]string{}
	}
	s.count[class]++
	if _, ok := s.first[class]; !ok {
		s.first[class] = err.Error()
	}
}

// String lists the classes by count, each with its first example.
func (s *soakTally) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	classes := make([]string, 0, len(s.count))
	for c := range s.count {
		classes = append(classes, c)
	}
	sort.Slice(classes, func(i, j int) bool { return s.count[classes[i]] > s.count[classes[j]] })
	var b strings.Builder
	for _, c := range classes {
		fmt.Fprintf(&b, "\n  %-10s %7d  e.g. %s", c, s.count[c], s.first[c])
	}
	if b.Len() == 0 {
		return " none"
	}
	return b.String()
}
