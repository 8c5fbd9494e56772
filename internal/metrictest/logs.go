package metrictest

import (
	"strings"
	"sync"
)

// Logs is what a test's logger wrote: a sink that the goroutines sharing the logger (a Batcher's
// lane, a worker, a server's handlers) may write to while the test reads it.
type Logs struct {
	mu sync.Mutex
	b  strings.Builder
}

// Write appends p. It never fails.
func (l *Logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *Logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
