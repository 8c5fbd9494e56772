// Command llmbudget keeps LLM calls within a tokens-per-minute budget with txlimit and River.
//
// Requests arrive faster than the budget allows, each with an estimate of the tokens its model call
// will use. Each one, in its own transaction, reserves its estimate from the budget and schedules
// a River job for when the budget has it (scheduler.ReserveTx): now, later, or, when more than
// MaxReserved would be owed, not at all (the caller is told when to come back). A worker runs a
// deterministic stand-in for the model call, which reports the tokens actually used, and settles
// the reservation with them (scheduler.SettleTx, exactly once) in the transaction that completes
// the job: the unused part is credited back, an overrun is charged. Credited tokens pull the jobs
// still waiting forward to when their own tokens have accrued. One user gives up while waiting:
// the job is cancelled and its tokens refunded (scheduler.CancelTx), which pulls the others forward
// too.
//
// Time is scaled down so that the run takes about 12 s: one budget minute lasts 4 s here. The
// program prints a timeline of requests, model calls and the budget, then checks that the calls
// started no faster than the budget allowed, and exits 0.
//
// It connects to DATABASE_URL and migrates the first schema of its search_path, as an application
// does at start-up: make demo sets DATABASE_URL to a fresh schema, dropped at the end (by hand,
// name an empty one: …?search_path=llmbudget). It imports only public packages, so it can be copied
// into an application.
//
// With -no-pull-forward it settles with scheduler.Settlement.Settle instead, which credits the
// unused tokens without moving the waiting jobs (and is not exactly-once), and cancels with River's
// JobCancelTx and a settlement of 0: the mean wait of both runs is compared in docs/scheduler.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

const (
	// minute is how long one budget minute lasts in this demo.
	minute = 4 * time.Second
	// tpm is the budget: tokens per (scaled) minute, also its burst.
	tpm = 6000
	// maxOwed is the most the budget may owe to reservations: a minute and a half's worth.
	maxOwed = tpm * 3 / 2
	// arrival is the time between two requests.
	arrival = 200 * time.Millisecond
	// modelLatency is how long the stand-in model call takes.
	modelLatency = 150 * time.Millisecond
	org          = "org-42"
	limitName    = "llm-tokens"
	// giveUp is the request whose user gives up while it waits, when request giveUpAt arrives.
	giveUp, giveUpAt = 21, 24
)

// noPull settles with Settlement.Settle, which does not pull waiting jobs forward.
var noPull = flag.Bool("no-pull-forward", false, "settle and cancel without pulling waiting jobs forward (for comparison)")

// estimates are the requests' estimated token counts, in order of arrival.
var estimates = []float64{
	900, 1200, 400, 1500, 800, 1100, 600, 1300, 700, 1000,
	1400, 500, 900, 1200, 800, 1500, 600, 1100, 1300, 700,
	1000, 1400, 900, 500, 1200, 800, 1500, 1100, 600, 1000,
}

// usage is the stand-in for the model: the tokens request i actually used, a deterministic share
// of its estimate, sometimes more than estimated.
func usage(i int, estimate float64) float64 {
	shares := []float64{0.8, 0.55, 1.1, 0.7, 0.95, 0.6, 1.2, 0.75}
	return math.Round(estimate * shares[i%len(shares)])
}

// CompletionArgs is a model call that reserved its estimate.
type CompletionArgs struct {
	Request  int     `json:"request"`
	Estimate float64 `json:"estimate"`
}

// Kind implements river.JobArgs.
func (CompletionArgs) Kind() string { return "llm_completion" }

// completionWorker makes the model call and settles the reservation with its actual usage.
type completionWorker struct {
	river.WorkerDefaults[CompletionArgs]
	pool    *pgxpool.Pool
	limiter *ratelimit.Limiter
	sched   *scheduler.Scheduler
	tl      *timeline
}

func (w *completionWorker) Work(ctx context.Context, job *river.Job[CompletionArgs]) error {
	started := time.Now()
	i := job.Args.Request
	time.Sleep(modelLatency) // the model call
	estimate := job.Args.Estimate
	used := usage(i, estimate)
	settling := time.Now()

	// Settle and complete the job in one transaction. SettleTx records the settlement on the job,
	// so that even a retry or a second worker cannot settle it twice.
	var credited, charged float64
	pulled := 0
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		if *noPull {
			budget := scheduler.Settlement{Name: limitName, Key: org, Reserved: estimate}
			res, err := budget.Settle(ctx, tx, w.limiter, used, nil)
			if err != nil {
				return err
			}
			credited, charged = res.Credited, res.Charged
		} else {
			res, err := w.sched.SettleTx(ctx, tx, job.ID, used)
			if err != nil {
				return err
			}
			credited, charged, pulled = res.Limits[0].Credited, res.Limits[0].Charged, res.PulledForward
		}
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		return err
	})
	if err != nil {
		return err
	}
	note := "exact"
	switch {
	case credited > 0:
		note = fmt.Sprintf("credited %.0f back", credited)
		if pulled > 0 {
			note += ", " + jobs(pulled) + " pulled forward"
		}
	case charged > 0:
		note = fmt.Sprintf("charged %.0f overrun", charged)
	}
	w.tl.ran(i, started, settling, job.ScheduledAt, estimate, used, credited, note)
	return nil
}

func main() {
	flag.Parse()
	if err := run(context.Background()); err != nil {
		log.Fatalf("llmbudget: %v", err)
	}
}

func run(ctx context.Context) error {
	fmt.Println("# llmbudget: LLM calls kept within a tokens-per-minute budget, reserved and scheduled with River")
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		return errors.New("DATABASE_URL is not set: set it to a Postgres URL, or run make demo, which finds or starts a Postgres")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = 16 // the queue's 10 workers, River's own connections and the requests
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		return err
	}

	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		limitName: {Rate: tpm, Period: minute, MaxReserved: maxOwed},
	}})
	if err != nil {
		return err
	}
	tl := newTimeline()
	worker := &completionWorker{pool: pool, limiter: limiter, tl: tl}
	client, sched, err := newClient(pool, limiter, worker)
	if err != nil {
		return err
	}
	// The start-up check: River's tables are there and the client has PreciseHook.
	if err := sched.Check(ctx, pool, CompletionArgs{}); err != nil {
		return err
	}
	if err := client.Start(ctx); err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = client.Stop(ctx)
	}()

	fmt.Printf("\n== the budget and the requests\n")
	fmt.Printf("budget %q for %s: %d tokens per minute, at most %d owed; one minute lasts %s here\n",
		limitName, org, tpm, maxOwed, minute)
	fmt.Printf("%d requests, one every %s, %.0f tokens estimated in all (%.1f budget minutes' worth)\n",
		len(estimates), arrival, sum(estimates), sum(estimates)/tpm)
	fmt.Println("\n== the timeline, in time order (about 12 s)")
	fmt.Println("a call's line is printed when it has settled; budget bars: each # is 500 tokens available, each - 500 tokens owed")
	fmt.Println("\n    time  event")

	// The budget, sampled while the demo runs.
	stopSampling := make(chan struct{})
	var sampling sync.WaitGroup
	sampling.Go(func() {
		t := time.NewTicker(minute / 3)
		defer t.Stop()
		for {
			select {
			case <-stopSampling:
				return
			case <-t.C:
				if st, err := limiter.State(ctx, pool, limitName, org, nil); err == nil {
					tl.budget(st.Value)
				}
			}
		}
	})

	accepted := 0
	jobIDs := map[int]int64{}
	for i, estimate := range estimates {
		time.Sleep(time.Until(tl.start.Add(time.Duration(i) * arrival)))
		if i == giveUpAt {
			if id, ok := jobIDs[giveUp]; ok {
				cancelled, err := cancel(ctx, pool, client, sched, limiter, tl, giveUp, id, estimates[giveUp])
				if err != nil {
					return err
				}
				if cancelled { // else its call has run or runs: it is waited for like the others
					accepted--
				}
			}
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// The application's own writes for the request would go here, in tx.
			res, err := sched.ReserveTx(ctx, tx, limitName, org, estimate, CompletionArgs{Request: i, Estimate: estimate}, nil)
			if err != nil {
				return err
			}
			jobIDs[i] = res.Job.ID
			tl.reserved(i, estimate, res)
			return nil
		})
		var limited *ratelimit.LimitedError
		switch {
		case errors.As(err, &limited):
			tl.rejected(i, estimate, limited.RetryAt)
		case err != nil:
			return err
		default:
			accepted++
		}
	}

	deadline := time.Now().Add(time.Minute)
	for tl.done() < accepted {
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d accepted calls ran within a minute", tl.done(), accepted)
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(stopSampling)
	sampling.Wait()
	st, err := limiter.State(ctx, pool, limitName, org, nil)
	if err != nil {
		return err
	}
	tl.budget(st.Value)
	return tl.summary(len(estimates), accepted, st.Value)
}

// newClient returns the River client that inserts and works the model calls, and the Scheduler
// that reserves their tokens through it; worker gets the Scheduler it settles with. The client
// also runs txlimit's housekeeping: the hourly prune, and the stranded check, which logs a warning
// (to slog.Default) for reserved calls that nothing starts, e.g. after a process died before its
// calls ran, so that no reservation is held silently. (It first runs a minute after start-up,
// after this demo.)
func newClient(pool *pgxpool.Pool, limiter *ratelimit.Limiter, worker *completionWorker) (*river.Client[pgx.Tx], *scheduler.Scheduler, error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, worker)
	housekeeping, err := scheduler.Housekeeping(workers, limiter, pool, nil)
	if err != nil {
		return nil, nil, err
	}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Hooks:        []rivertype.Hook{&scheduler.PreciseHook{}},
		Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
		PeriodicJobs: housekeeping,
		Queues:       map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(10)},
		Workers:      workers,
	})
	if err != nil {
		return nil, nil, err
	}
	sched, err := scheduler.New(client, limiter, nil)
	if err != nil {
		return nil, nil, err
	}
	worker.sched = sched
	return client, sched, nil
}

// cancel cancels the job of request i, whose user gave up, and refunds its tokens, unless its call
// has started already (then nothing is refunded: the call runs and settles). It reports whether the
// job was cancelled.
func cancel(ctx context.Context, pool *pgxpool.Pool, client *river.Client[pgx.Tx], sched *scheduler.Scheduler,
	limiter *ratelimit.Limiter, tl *timeline, i int, jobID int64, estimate float64) (cancelled bool, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if *noPull { // the way without CancelTx: cancel, then settle for 0 (no pull-forward)
			job, err := client.JobCancelTx(ctx, tx, jobID)
			if err != nil {
				return err
			}
			// River leaves a finished job as it is and only asks a running one to stop, without an
			// error: either has made its call, so nothing is refunded.
			if job.State != rivertype.JobStateCancelled || job.AttemptedAt != nil {
				tl.event("request %2d  gives up, too late: job %d is %s", i, jobID, job.State)
				return nil
			}
			budget := scheduler.Settlement{Name: limitName, Key: org, Reserved: estimate}
			res, err := budget.Settle(ctx, tx, limiter, 0, nil)
			if err != nil {
				return err
			}
			tl.cancelled(i, res.Credited, 0)
			cancelled = true
			return nil
		}
		res, err := sched.CancelTx(ctx, tx, jobID)
		var started *scheduler.NotCancellableError
		if errors.As(err, &started) {
			tl.event("request %2d  gives up, too late: %v", i, err)
			return nil
		}
		if err != nil {
			return err
		}
		tl.cancelled(i, res.Limits[0].Credited, res.PulledForward)
		cancelled = true
		return nil
	})
	return cancelled && err == nil, err
}

// jobs says how many waiting jobs.
func jobs(n int) string {
	if n == 1 {
		return "1 waiting job"
	}
	return fmt.Sprintf("%d waiting jobs", n)
}

func sum(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s
}

// timeline prints events as they happen and keeps what the summary checks.
type timeline struct {
	start time.Time

	mu         sync.Mutex
	calls      []call
	scheduled  map[int]time.Time // when each request's job was first scheduled
	rejections int
	cancels    int
	firstGrant time.Time
	used       float64
	lateMax    time.Duration
}

// newTimeline returns a timeline that starts now.
func newTimeline() *timeline { return &timeline{start: time.Now(), scheduled: map[int]time.Time{}} }

type call struct {
	request            int
	started, settling  time.Time
	reserved, credited float64
}

// event prints one line of the timeline, stamped with the time it is printed at, so that the lines
// are in time order whichever goroutine prints them.
func (t *timeline) event(format string, args ...any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.printLocked(format, args...)
}

// printLocked is event with t.mu held.
func (t *timeline) printLocked(format string, args ...any) {
	fmt.Printf("%7.2fs  %s\n", time.Since(t.start).Seconds(), fmt.Sprintf(format, args...))
}

func (t *timeline) reserved(i int, estimate float64, res *scheduler.Reservation) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.firstGrant.IsZero() {
		t.firstGrant = res.Results[0].Time
	}
	if res.ScheduledAt.IsZero() {
		t.printLocked("request %2d  reserves %5.0f  runs now", i, estimate)
		return
	}
	t.scheduled[i] = res.ScheduledAt
	t.printLocked("request %2d  reserves %5.0f  scheduled for %6.2fs", i, estimate, res.ScheduledAt.Sub(t.start).Seconds())
}

func (t *timeline) cancelled(i int, refund float64, pulled int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cancels++
	t.printLocked("request %2d  gives up while it waits: job cancelled, %.0f tokens refunded, %s pulled forward",
		i, refund, jobs(pulled))
}

func (t *timeline) rejected(i int, estimate float64, retryAt time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rejections++
	t.printLocked("request %2d  rejected %5.0f  more than %d would be owed: retry at %.2fs; nothing reserved, no job",
		i, estimate, maxOwed, retryAt.Sub(t.start).Seconds())
}

func (t *timeline) ran(i int, started, settling, scheduledAt time.Time, reserved, used, credited float64, note string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	late := started.Sub(scheduledAt)
	t.calls = append(t.calls, call{request: i, started: started, settling: settling, reserved: reserved, credited: credited})
	t.used += used
	t.lateMax = max(t.lateMax, late)
	pulled := ""
	if first, ok := t.scheduled[i]; ok && scheduledAt.Before(first) {
		pulled = fmt.Sprintf(", pulled forward from %.2fs", first.Sub(t.start).Seconds())
	}
	t.printLocked("  call %2d  ran at %5.2fs (%3.0f ms after its time%s), used %5.0f of %5.0f: %s",
		i, started.Sub(t.start).Seconds(), float64(late)/float64(time.Millisecond), pulled, used, reserved, note)
}

func (t *timeline) budget(v float64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	const scale = 500 // tokens per character
	bar := strings.Repeat("#", int(max(v, 0)/scale))
	if v < 0 {
		bar = strings.Repeat("-", int(-v/scale)) + "|"
		bar = fmt.Sprintf("%*s", maxOwed/scale+1, bar)
	} else {
		bar = fmt.Sprintf("%*s|%s", maxOwed/scale, "", bar)
	}
	t.printLocked("budget %7.0f  %s", v, bar)
}

func (t *timeline) done() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.calls)
}

// summary checks that the calls started no faster than the budget allowed: at each call's start,
// the estimates reserved by the calls started so far, less what settlements had credited back,
// fit in the burst plus what had accrued since the first reservation. (An overrun only makes
// later reservations wait longer.)
func (t *timeline) summary(requests, accepted int, final float64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	slices.SortFunc(t.calls, func(a, b call) int { return a.started.Compare(b.started) })
	var reserved, worst float64
	for _, c := range t.calls {
		reserved += c.reserved
		var credited float64
		for _, d := range t.calls {
			if d.settling.Before(c.started) {
				credited += d.credited
			}
		}
		allowed := tpm + tpm*c.started.Sub(t.firstGrant).Seconds()/minute.Seconds()
		if over := reserved - credited - allowed; over > 1 {
			return fmt.Errorf("at %.2fs the calls had taken %.0f tokens, more than the %.0f the budget allowed",
				c.started.Sub(t.start).Seconds(), reserved-credited, allowed)
		} else if worst == 0 || over > worst {
			worst = over
		}
	}
	last := t.calls[len(t.calls)-1].started.Sub(t.firstGrant)
	var wait time.Duration
	for _, c := range t.calls {
		wait += c.started.Sub(t.start.Add(time.Duration(c.request) * arrival))
	}
	fmt.Printf("\n== what happened\n")
	fmt.Printf("%d requests: %d ran, %d cancelled with a refund, %d rejected with a time to retry\n",
		requests, accepted, t.cancels, t.rejections)
	mode := "with pull-forward"
	if *noPull {
		mode = "without pull-forward (-no-pull-forward)"
	}
	fmt.Printf("mean wait from request to model call: %d ms, %s\n", (wait / time.Duration(len(t.calls))).Milliseconds(), mode)
	fmt.Printf("reserved %.0f tokens, used %.0f, over %.1f budget minutes (%d tokens each)\n",
		reserved, t.used, last.Seconds()/minute.Seconds(), tpm)
	fmt.Printf("latest start after its scheduled time: %d ms; budget left: %.0f\n", t.lateMax.Milliseconds(), final)
	fmt.Printf("the budget held: at every call's start, tokens taken <= tokens accrued (closest: %.0f under)\n", -worst)
	return nil
}
