package scheduler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/scheduler"
)

// strandedCount returns the counter txlimit.scheduler.stranded of queue (0 if none).
func strandedCount(t *testing.T, reader *sdkmetric.ManualReader, queue string) int64 {
	t.Helper()
	rm := metrictest.Collect(t, reader)
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, "github.com/txlimit/txlimit/scheduler", sm.Scope.Name)
	}
	return metrictest.Sum(t, rm, "txlimit.scheduler.stranded", attribute.String("txlimit.queue", queue))
}

// TestStrandedWorker (issue 31, item 2): reserved jobs not started a minute (After) past their
// time are counted once each, by queue, logged with the fix, recorded as the job's output, and
// marked; a job due exactly After ago, a cancelled job and a job counted before are not.
func TestStrandedWorker(t *testing.T) { direct(t, stranded) }

func stranded(t *testing.T, c conn) {
	ctx := context.Background()
	b := setupCalls(t, perMinute10, c)
	// A client has worked the default queue (River's queue table lists it), none "orphan"; the
	// Scheduler is told, wrongly, that both are worked.
	workQueues(t, b.pool, c, river.QueueDefault)
	sched, err := scheduler.New(insertOnly(t, b.pool), b.limiter, &scheduler.Config{Queues: []string{"orphan", river.QueueDefault}})
	require.NoError(t, err)

	// The bucket is empty at t0; each reservation of 5 waits 30 s more (one token per 6 s).
	_, err = b.limiter.LimitN(ctx, b.pool, "calls", "k", 10, nil)
	require.NoError(t, err)
	var ids []int64
	for i, queue := range []string{"orphan", "orphan", river.QueueDefault, "orphan"} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := sched.ReserveTx(ctx, tx, "calls", "k", 5, callArgs{N: i}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: queue}})
			if err == nil {
				require.Equal(t, t0.Add(time.Duration(i+1)*30*time.Second), res.ScheduledAt.UTC(), "job %d", i)
				ids = append(ids, res.Job.ID)
			}
			return err
		}))
	}
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { // the last one is cancelled
		_, err := sched.CancelTx(ctx, tx, ids[3])
		return err
	}))
	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	reader := sdkmetric.NewManualReader()
	var now time.Time
	w, err := scheduler.NewStrandedWorker(b.pool, &scheduler.HousekeepingConfig{
		StrandedAfter: time.Minute, Logger: logger, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
	}, func() time.Time { return now })
	require.NoError(t, err)
	check := func(at time.Time) scheduler.StrandedOutput {
		t.Helper()
		now = at
		return workJob[scheduler.StrandedArgs, scheduler.StrandedOutput](t, b, w, scheduler.StrandedArgs{}, true)
	}
	orphanFix := `"no River client works queue \"orphan\": add it to river.Config.Queues of a client, or cancel the jobs with Scheduler.CancelTx to refund their tokens"`
	defaultFix := `"River's clients work queue \"default\" but did not start these jobs: see whether its clients are stopped, the queue paused (QueuePause) or its workers behind"`
	line := func(queue string, jobs, id int64, at time.Time, worked bool, fix string) string {
		return fmt.Sprintf(`level=WARN msg="txlimit: reserved jobs stranded" queue=%s jobs=%d first_job_id=%d first_scheduled_at=%s worked=%t fix=%s`,
			queue, jobs, id, at.Format("2006-01-02T15:04:05.000Z07:00"), worked, fix)
	}

	steps := []struct {
		now      time.Time
		want     scheduler.StrandedOutput
		logs     []string
		counters map[string]int64 // txlimit.scheduler.stranded by queue, cumulative
	}{
		// step 0: the first job was due at t0+30s, exactly After ago: not yet stranded.
		{now: t0.Add(90 * time.Second), want: scheduler.StrandedOutput{Queues: []scheduler.StrandedQueue{}},
			counters: map[string]int64{"orphan": 0, "default": 0}},
		// step 1: a microsecond later it is.
		{now: t0.Add(90*time.Second + time.Microsecond), want: scheduler.StrandedOutput{Total: 1, Queues: []scheduler.StrandedQueue{
			{Queue: "orphan", Jobs: 1, FirstJobID: ids[0], FirstScheduledAt: t0.Add(30 * time.Second)},
		}}, logs: []string{line("orphan", 1, ids[0], t0.Add(30*time.Second), false, orphanFix)},
			counters: map[string]int64{"orphan": 1, "default": 0}},
		// step 2: the second and third; not the first again, nor the cancelled fourth (due t0+2m).
		{now: t0.Add(4 * time.Minute), want: scheduler.StrandedOutput{Total: 2, Queues: []scheduler.StrandedQueue{
			{Queue: "default", Jobs: 1, FirstJobID: ids[2], FirstScheduledAt: t0.Add(90 * time.Second), Worked: true},
			{Queue: "orphan", Jobs: 1, FirstJobID: ids[1], FirstScheduledAt: t0.Add(60 * time.Second)},
		}}, logs: []string{
			line("default", 1, ids[2], t0.Add(90*time.Second), true, defaultFix),
			line("orphan", 1, ids[1], t0.Add(60*time.Second), false, orphanFix),
		}, counters: map[string]int64{"orphan": 2, "default": 1}},
		// step 3: an hour later, nothing new.
		{now: t0.Add(time.Hour), want: scheduler.StrandedOutput{Queues: []scheduler.StrandedQueue{}},
			counters: map[string]int64{"orphan": 2, "default": 1}},
	}
	for i, s := range steps {
		before := len(logs.String())
		got := check(s.now)
		require.Equal(t, s.want, got, "step %d", i)
		var lines []string
		if out := strings.TrimSpace(logs.String()[before:]); out != "" {
			lines = strings.Split(out, "\n")
		}
		require.Equal(t, s.logs, lines, "step %d", i)
		for queue, n := range s.counters {
			require.Equal(t, n, strandedCount(t, reader, queue), "step %d: %s of %s", i, "txlimit.scheduler.stranded", queue)
		}
	}

	// The first job carries when it was found; the cancelled one carries nothing.
	var mark struct {
		At time.Time `json:"at"`
	}
	require.NoError(t, json.Unmarshal(metadataValue(t, jobRow(t, b, ids[0]).Metadata, scheduler.StrandedKey), &mark))
	require.True(t, mark.At.Equal(t0.Add(90*time.Second+time.Microsecond)), "marked at %s", mark.At)
	require.Nil(t, metadataValue(t, jobRow(t, b, ids[3]).Metadata, scheduler.StrandedKey))
}
