package scheduler

import (
	"cmp"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/riverqueue/river"

	"github.com/txlimit/txlimit/internal/schedsql"
)

// workedFor is how long ReserveTx trusts that River's queue table listed a queue: it reads the
// table again after that. A queue River's clients stop working stays in the table for 24 h anyway.
const workedFor = time.Minute

// jobQueue returns the queue River inserts args into with opts: opts.Queue, else the queue of the
// args' own InsertOpts (river.JobArgsWithInsertOpts), else river.QueueDefault, as River decides it.
func jobQueue(args river.JobArgs, opts river.InsertOpts) string {
	var own river.InsertOpts
	if a, ok := args.(river.JobArgsWithInsertOpts); ok {
		own = a.InsertOpts()
	}
	return cmp.Or(opts.Queue, own.Queue, river.QueueDefault)
}

// queueNameRE is River's rule for a queue name (validateQueueName in river's client.go, v0.51.0),
// which River does not export; with at most 64 characters. TestQueueNameRuleIsRivers keeps the two
// equal.
var queueNameRE = regexp.MustCompile(`^(?:[a-z0-9])+(?:[_|\-]?[a-z0-9]+)*$`)

// checkQueueName returns the *ratelimit.ArgumentError of op's argument arg when queue is a name
// River refuses, nil otherwise: a job headed for it would be refused at insert, and no client can
// work it, so it is bad input, not a queue no client works yet.
func checkQueueName(op, arg, queue string) error {
	if len(queue) <= 64 && queueNameRE.MatchString(queue) {
		return nil
	}
	return argError(op, arg, fmt.Sprintf("is %q, a queue name River refuses: use lower-case letters and digits, "+
		"runs of them joined by one '_', '-' or '|', at most 64 characters", queue), nil)
}

// jobQueueArg names the argument that set the queue jobQueue returns for opts.
func jobQueueArg(opts river.InsertOpts) string {
	if opts.Queue != "" {
		return "ReserveOpts.InsertOpts.Queue"
	}
	return "args' InsertOpts().Queue"
}

// configuredQueue returns the *SetupError of a job headed for queue when Config.Queues is set and
// does not name it, nil otherwise: it needs no database.
func (s *Scheduler) configuredQueue(op, queue string) error {
	if s.queues == nil || slices.Contains(s.queues, queue) {
		return nil
	}
	return &SetupError{Package: pkgScheduler, Op: op, Problem: ErrQueueNotWorked, Queue: queue, Fix: fmt.Sprintf(
		"insert the job into one of scheduler.Config.Queues (%s) with ReserveOpts.InsertOpts.Queue, or have a River client work %q and add it to scheduler.Config.Queues",
		quoted(s.queues), queue)}
}

// workedQueue returns the *SetupError of a job headed for queue when River's queue table, read
// through db, lists other queues but not this one: no River client works it, so the job would wait
// there with its tokens reserved. An empty table (no client has worked a queue on this database
// yet) refuses nothing. With Config.Queues set, it only checks that list.
func (s *Scheduler) workedQueue(ctx context.Context, op string, db schedsql.DBTX, queue string) error {
	if s.queues != nil {
		return s.configuredQueue(op, queue)
	}
	if until, ok := s.worked.Load(queue); ok && time.Now().Before(until.(time.Time)) {
		return nil
	}
	names, err := schedsql.New().WorkedQueues(ctx, db)
	if err != nil {
		return fmt.Errorf("scheduler: %s: read River's queues (river_queue): %w", op, err)
	}
	if len(names) == 0 {
		return nil
	}
	if slices.Contains(names, queue) {
		s.worked.Store(queue, time.Now().Add(workedFor))
		return nil
	}
	return &SetupError{Package: pkgScheduler, Op: op, Problem: ErrQueueNotWorked, Queue: queue, Fix: fmt.Sprintf(
		"insert the job into a queue River's clients work (%s) with ReserveOpts.InsertOpts.Queue, or add %q to river.Config.Queues of a client",
		quoted(names), queue)}
}

// quoted lists names quoted, comma-separated; at most 10, then how many more.
func quoted(names []string) string {
	q := make([]string, 0, min(len(names), 11))
	for i, n := range names {
		if i == 10 {
			q = append(q, fmt.Sprintf("and %d more", len(names)-10))
			break
		}
		q = append(q, fmt.Sprintf("%q", n))
	}
	return strings.Join(q, ", ")
}
