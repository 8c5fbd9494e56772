package scheduler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/scheduler"
)

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
		fmt.Println(scheduler.IsPrecise(ctx), params.State, params.ScheduledAt.Format(time.RFC3339))
	}
	// Output:
	// false scheduled 2030-01-01T00:00:00Z
	// true available 2030-01-01T00:00:00Z
}
