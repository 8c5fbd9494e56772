package scheduler

import (
	"time"

	"github.com/txlimit/txlimit/internal/schedsql"
	"github.com/txlimit/txlimit/ratelimit"
)

// SetGateNow replaces the clock a Gate uses to tell whether a paid-for job is due yet.
func SetGateNow(g *Gate, now func() time.Time) { g.now = now }

// MaxSnooze is the longest single snooze a Gate asks for.
const MaxSnooze = maxSnooze

// The jobs of Housekeeping, so that tests can work them one at a time.
type (
	PruneArgs      = pruneArgs
	PruneOutput    = pruneOutput
	PruneWorker    = pruneWorker
	StrandedArgs   = strandedArgs
	StrandedOutput = strandedOutput
	StrandedQueue  = strandedQueue
	StrandedWorker = strandedWorker
)

// The job metadata keys of the package.
const (
	MetadataKey = paidKey
	ReservedKey = reservedKey
	SettledKey  = settledKey
	StrandedKey = strandedKey
)

// NewPruneWorker returns the prune job's worker as Housekeeping registers it.
func NewPruneWorker(limiter *ratelimit.Limiter, db ratelimit.Executor, config *HousekeepingConfig) (*PruneWorker, error) {
	cfg, err := config.withDefaults("NewPruneWorker")
	if err != nil {
		return nil, err
	}
	return &pruneWorker{limiter: limiter, db: db, cfg: cfg}, nil
}

// NewStrandedWorker returns the stranded check's worker as Housekeeping registers it, checking at
// the times now returns instead of the database's clock.
func NewStrandedWorker(db ratelimit.Executor, config *HousekeepingConfig, now func() time.Time) (*StrandedWorker, error) {
	cfg, err := config.withDefaults("NewStrandedWorker")
	if err != nil {
		return nil, err
	}
	w := newStrandedWorker(db.(schedsql.DBTX), cfg)
	w.now = now
	return w, nil
}

// CheckQueueName is the check of a queue name River refuses.
func CheckQueueName(queue string) error { return checkQueueName("Test", "queue", queue) }
