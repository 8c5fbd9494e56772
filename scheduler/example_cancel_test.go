package scheduler_test

import (
	"context"
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

// RequestArgs is a job whose reservation ReserveTx recorded in its metadata.
type RequestArgs struct {
	N int `json:"n"`
}

func (RequestArgs) Kind() string { return "request" }

// A cancelled job gives back what it reserved, a job that used less than it reserved gives back the
// rest, exactly once, and either pulls the jobs waiting behind it forward.
func Example_cancelAndSettle() {
	ctx := context.Background()
	pool, done := testdb.ForExample()
	defer done()
	if err := scheduler.Migrate(ctx, pool, nil); err != nil {
		panic(err)
	}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Hooks: []rivertype.Hook{&scheduler.PreciseHook{}}})
	if err != nil {
		panic(err)
	}
	now := time.Date(2030, 1, 1, 9, 0, 0, 0, time.UTC) // a fixed clock, for this example's output
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"llm-tokens": {Rate: 10_000, Period: time.Minute, MaxReserved: 50_000}},
		Now:    func() time.Time { return now },
	})
	if err != nil {
		panic(err)
	}
	sched, err := scheduler.New(client, limiter, nil)
	if err != nil {
		panic(err)
	}
	if err := sched.Check(ctx, pool, nil); err != nil { // at start-up: River's tables and the hook
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
		fmt.Printf("cancel job 1: refunded %.0f, %d waiting job pulled forward\n", res.Limits[0].Credited, res.PulledForward)
		return err
	})
	fmt.Println("job 2 due in", at(ids[2]))

	for range 2 { // settled twice: the second changes nothing
		inTx(func(tx pgx.Tx) error {
			res, err := sched.SettleTx(ctx, tx, ids[0], 7000)
			fmt.Printf("settle job 0: used 7000 of 10000, credited %.0f, repeated %t\n", res.Limits[0].Credited, res.Repeated)
			return err
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
