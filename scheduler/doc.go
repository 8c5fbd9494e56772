// Package scheduler runs rate-limited work with River, Postgres's transactional job queue.
//
// # Reserve and schedule
//
// A caller told "retry at T" may be gone by T. Scheduler.ReserveTx instead reserves the tokens
// (ratelimit.LimitOpts.Reserve) and inserts a River job for T, both in the caller's pgx.Tx: the job
// exists if and only if the reservation committed. When the tokens are there the job runs now; when
// the limit would go past MaxReserved nothing is reserved, no job is inserted and the error is a
// *ratelimit.LimitedError carrying RetryAt. ReserveManyTx does the same for several limits at once,
// all or nothing.
//
// A reserved job was paid for when it was scheduled, so it runs without checking the limit again.
// When its real cost is known it settles the reservation: Scheduler.SettleTx credits back what was
// not used or charges the overrun, exactly once per job (recorded in the job's metadata in the same
// transaction). Scheduler.CancelTx cancels a job that has not started and refunds everything it
// reserved. Tokens given back either way pull the jobs waiting behind it forward, in the same
// transaction, to when their own tokens will have accrued (docs/scheduler.md has the algebra).
//
// # Precise timing
//
// River promotes a job inserted with a future ScheduledAt from scheduled to available in a
// maintenance pass that runs every 5 seconds, so on its own it starts such a job up to ~5 s late.
// River fetches an available job as soon as its scheduled_at has passed, though, so PreciseHook
// inserts the jobs of ReserveTx (and of any insert whose context went through WithPrecise) as
// available with their future scheduled_at, the state River itself gives to short snoozes. A queue
// configured with PreciseQueue polls every 50 ms and starts them within about that of their time.
// docs/scheduler.md has the trade-offs and the measured lateness.
//
// # Rate-limited workers
//
// Gate is a River worker middleware that makes jobs pay a limit before they run. A job that cannot
// take its tokens now reserves them and is snoozed (river.JobSnooze) until they are due, which does
// not consume one of its attempts; when the limit is past MaxReserved it is snoozed until RetryAt
// and tries again. Jobs so run at the limit's rate, in order, without failing or spinning.
//
// # Housekeeping
//
// Housekeeping registers two River periodic jobs (HousekeepingConfig): one runs Limiter.PruneAll
// every hour, the other finds, every minute, the reserved jobs that have not started 5 minutes past
// their time, or that River cancelled or discarded before they started without their refund (a
// reserved job holds its tokens until it runs, settles or is cancelled), counts each
// once (the OpenTelemetry counter txlimit.scheduler.stranded) and logs a warning per queue with the
// fix.
//
// # Setup
//
// Migrate applies River's own migrations (rivermigrate) next to txlimit's (migrations.Up). The
// River client needs PreciseHook among its Hooks, and the reserved jobs a queue that River's
// clients work, configured with PreciseQueue. ReserveTx refuses a job headed for a queue no client
// works (ErrQueueNotWorked; Config.Queues says how it knows), before anything is reserved.
// Scheduler.Check verifies at start-up that River's tables are there, that the hook is registered
// and that the queue is worked, and returns a *SetupError naming the fix. No check sees the queue's
// poll interval (River lets no other package read a client's queue config): a queue left at
// River's default FetchPollInterval (1 s) starts reserved jobs up to about a second late, and
// nothing reports it. Give the reserved jobs' args an InsertOpts method that names their queue, so
// that no call can forget it and Check verifies it:
//
//	func (CompletionArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{Queue: "llm"} }
//
//	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
//		Hooks:   []rivertype.Hook{&scheduler.PreciseHook{}},
//		Queues:  map[string]river.QueueConfig{"llm": scheduler.PreciseQueue(10)},
//		Workers: workers,
//	})
//	sched, err := scheduler.New(client, limiter, nil)
//	err = sched.Check(ctx, pool, CompletionArgs{})
//
//	// In a request handler, inside the application's transaction:
//	res, err := sched.ReserveTx(ctx, tx, "llm-tokens", orgID, estimate, CompletionArgs{...}, nil)
//
//	// In the worker, in the transaction that completes the job:
//	settled, err := sched.SettleTx(ctx, tx, job.ID, usedTokens)
package scheduler
