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

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// CompletionArgs is an LLM call that reserved its estimated tokens.
type CompletionArgs struct {
	Prompt string               `json:"prompt"`
	Budget scheduler.Settlement `json:"budget"`
}

func (CompletionArgs) Kind() string { return "completion" }

// Requests reserve their estimated LLM tokens from a 10,000 tokens/minute budget and are scheduled
// for when the budget allows, in the transaction that accepts them.
func Example_reserveAndSchedule() {
	ctx := context.Background()
	// In an application: the application's pool, with migrations.Up and scheduler.Migrate run at
	// start-up. The examples get a fresh schema with txlimit's migrations.
	pool, done := testdb.ForExample()
	defer done()
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		panic(err)
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[CompletionArgs]) error {
		return nil // call the model, then settle in the job's tx: sched.SettleTx(ctx, tx, job.ID, used)
	}))
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Hooks:   []rivertype.Hook{&scheduler.PreciseHook{}},
		Workers: workers,
	})
	if err != nil {
		panic(err)
	}
	now := time.Date(2030, 1, 1, 9, 0, 0, 0, time.UTC) // a fixed clock, for this example's output
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"llm-tokens": {Rate: 10_000, Period: time.Minute, MaxReserved: 20_000}},
		Now:    func() time.Time { return now },
	})
	if err != nil {
		panic(err)
	}
	sched, err := scheduler.New(client, limiter, nil)
	if err != nil {
		panic(err)
	}

	for _, estimate := range []float64{8000, 6000, 9000, 20000} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// ... the application's own writes ...
			budget := scheduler.Settlement{Name: "llm-tokens", Key: "org-42", Reserved: estimate}
			res, err := sched.ReserveTx(ctx, tx, budget.Name, budget.Key, estimate, CompletionArgs{Prompt: "...", Budget: budget}, nil)
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
