package scheduler_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// CompletionArgs is an LLM call that reserved its estimated tokens. It carries nothing of its
// reservation: ReserveTx records that in the job, where SettleTx reads it.
type CompletionArgs struct {
	Prompt string `json:"prompt"`
}

func (CompletionArgs) Kind() string { return "completion" }

// RequestArgs is a job whose reservation ReserveTx recorded in its metadata.
type RequestArgs struct {
	N int `json:"n"`
}

func (RequestArgs) Kind() string { return "request" }

// Requests reserve their estimated LLM tokens from a 10,000 tokens/minute budget and are scheduled
// for when the budget allows, in the transaction that accepts them.
func Example_reserveAndSchedule() {
	ctx := context.Background()
	// In an application: the application's pool, with migrations.Up and scheduler.Migrate run at
	// start-up. The examples get a fresh schema with txlimit's migrations, reached as the tests are.
	pool, done := examplePool()
	defer done()
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		panic(err)
	}
	var sched *scheduler.Scheduler // made below, with the client
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[CompletionArgs]) error {
		used := 7000.0 // call the model: it says how many tokens the call used
		// Settle in the transaction that completes the job: exactly once, whatever retries.
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := sched.SettleTx(ctx, tx, job.ID, used); err != nil {
				return err
			}
			_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
			return err
		})
	}))
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Hooks:   []rivertype.Hook{&scheduler.PreciseHook{}},
		Workers: workers,
	})
	if err != nil {
		panic(err)
	}
	now := time.Date(2030, 1, 1, 9, 0, 0, 0, time.UTC) // a fixed clock, for this example's output
	limiter, sched := newExampleScheduler(client, ratelimit.Config{Rate: 10_000, Period: time.Minute, MaxReserved: 20_000}, now)

	for _, estimate := range []float64{8000, 6000, 9000, 20000} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// ... the application's own writes ...
			res, err := sched.ReserveTx(ctx, tx, "llm-tokens", "org-42", estimate, CompletionArgs{Prompt: "..."}, nil)
			if err != nil {
				return err
			}
			if res.ScheduledAt.IsZero() {
				fmt.Printf("%5.0f tokens: runs now\n", estimate)
			} else {
				fmt.Printf("%5.0f tokens: scheduled %s later, %s\n", estimate, res.ScheduledAt.Sub(now), res.Job.State)
			}
			return nil
		})
		var limited *ratelimit.LimitedError
		if errors.As(err, &limited) {
			fmt.Printf("%5.0f tokens: rejected, more than 20000 would be owed; nothing reserved, no job\n", estimate)
		} else if err != nil {
			panic(err)
		}
	}
	st, _ := limiter.State(ctx, pool, "llm-tokens", "org-42", nil)
	list, _ := client.JobList(ctx, river.NewJobListParams())
	fmt.Printf("budget %.0f, %d jobs\n", st.Value, len(list.Jobs))
	// Output:
	//  8000 tokens: runs now
	//  6000 tokens: scheduled 24s later, available
	//  9000 tokens: scheduled 1m18s later, available
	// 20000 tokens: rejected, more than 20000 would be owed; nothing reserved, no job
	// budget -13000, 3 jobs
}

// A cancelled job gives back what it reserved, a job that used less than it reserved gives back the
// rest, exactly once, and either pulls the jobs waiting behind it forward.
func Example_cancelAndSettle() {
	ctx := context.Background()
	pool, done := examplePool()
	defer done()
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Hooks: []rivertype.Hook{&scheduler.PreciseHook{}}})
	if err != nil {
		panic(err)
	}
	now := time.Date(2030, 1, 1, 9, 0, 0, 0, time.UTC) // a fixed clock, for this example's output
	limiter, sched := newExampleScheduler(client, ratelimit.Config{Rate: 10_000, Period: time.Minute, MaxReserved: 50_000}, now)
	// At start-up: River's tables, then the check that they and the hook are there.
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		panic(err)
	}
	if err := sched.Check(ctx, pool, nil); err != nil {
		panic(err)
	}
	inTx := func(fn func(tx pgx.Tx) error) {
		if err := pgx.BeginFunc(ctx, pool, fn); err != nil {
			panic(err)
		}
	}
	var ids []int64
	for i, estimate := range []float64{10_000, 5000, 5000} {
		inTx(func(tx pgx.Tx) error {
			res, err := sched.ReserveTx(ctx, tx, "llm-tokens", "org-42", estimate, RequestArgs{N: i}, nil)
			if err == nil {
				ids = append(ids, res.Job.ID)
			}
			return err
		})
	}
	at := func(id int64) time.Duration {
		job, err := client.JobGet(ctx, id)
		if err != nil {
			panic(err)
		}
		return job.ScheduledAt.Sub(now)
	}
	fmt.Println("job 2 due in", at(ids[2]))

	inTx(func(tx pgx.Tx) error {
		res, err := sched.CancelTx(ctx, tx, ids[1])
		if err != nil {
			return err
		}
		fmt.Printf("cancel job 1: refunded %.0f, %d waiting job pulled forward\n", res.Limits[0].Credited, res.PulledForward)
		return nil
	})
	fmt.Println("job 2 due in", at(ids[2]))

	for range 2 { // settled twice: the second changes nothing
		inTx(func(tx pgx.Tx) error {
			res, err := sched.SettleTx(ctx, tx, ids[0], 7000)
			if err != nil {
				return err
			}
			fmt.Printf("settle job 0: used 7000 of 10000, credited %.0f, repeated %t\n", res.Limits[0].Credited, res.Repeated)
			return nil
		})
	}
	fmt.Println("job 2 due in", at(ids[2]))
	st, _ := limiter.State(ctx, pool, "llm-tokens", "org-42", nil)
	fmt.Printf("budget %.0f\n", st.Value)
	// Output:
	// job 2 due in 1m0s
	// cancel job 1: refunded 5000, 1 waiting job pulled forward
	// job 2 due in 30s
	// settle job 0: used 7000 of 10000, credited 3000, repeated false
	// settle job 0: used 7000 of 10000, credited 3000, repeated true
	// job 2 due in 12s
	// budget -2000
}

// newExampleScheduler is how the two examples above make their Scheduler on client: a limiter whose
// one limit is "llm-tokens" of config tokens, on a clock fixed at now so that the output is exact,
// and scheduler.New on the client and that limiter. It panics where an application would handle
// the error.
func newExampleScheduler(client *river.Client[pgx.Tx], tokens ratelimit.Config, now time.Time) (*ratelimit.Limiter, *scheduler.Scheduler) {
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"llm-tokens": tokens},
		Now:    func() time.Time { return now },
	})
	if err != nil {
		panic(err)
	}
	sched, err := scheduler.New(client, limiter, nil)
	if err != nil {
		panic(err)
	}
	return limiter, sched
}

// Jobs of the same identity get the same jitter every time; different identities spread out.
func ExampleJitterFor() {
	for _, identity := range []string{"alice", "bob", "carol", "alice"} {
		fmt.Println(identity, scheduler.JitterFor(identity, 2*time.Second))
	}
	// Output:
	// alice 414.3ms
	// bob 1.924109s
	// carol 336.455ms
	// alice 414.3ms
}

// A job that settles its reservation carries a Settlement in its args.
func ExampleSettlement() {
	type CompletionArgs struct {
		Prompt string               `json:"prompt"`
		Budget scheduler.Settlement `json:"budget"`
	}
	args := CompletionArgs{
		Prompt: "Summarise the ticket",
		Budget: scheduler.Settlement{Name: "llm-tokens", Key: "org-42", Reserved: 1200},
	}
	b, _ := json.Marshal(args)
	fmt.Println(string(b))
	// Output: {"prompt":"Summarise the ticket","budget":{"name":"llm-tokens","key":"org-42","reserved":1200}}
}

// PreciseHook inserts a job scheduled for later as available, keeping its time, when the insert's
// context asks for precision; River then fetches it as soon as it is due.
func ExamplePreciseHook() {
	hook := &scheduler.PreciseHook{}
	at := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, ctx := range []context.Context{context.Background(), scheduler.WithPrecise(context.Background())} {
		params := &rivertype.JobInsertParams{State: rivertype.JobStateScheduled, ScheduledAt: &at}
		_ = hook.InsertBegin(ctx, params)
		fmt.Println(params.State, params.ScheduledAt.Format(time.RFC3339))
	}
	// Output:
	// scheduled 2030-01-01T00:00:00Z
	// available 2030-01-01T00:00:00Z
}
