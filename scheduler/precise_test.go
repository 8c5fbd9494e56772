package scheduler_test

import (
	"context"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/scheduler"
)

func TestPreciseHook(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := &scheduler.PreciseHook{}
	tests := []struct {
		precise bool
		state   rivertype.JobState
		want    rivertype.JobState
	}{
		{precise: true, state: rivertype.JobStateScheduled, want: rivertype.JobStateAvailable},
		{precise: false, state: rivertype.JobStateScheduled, want: rivertype.JobStateScheduled},
		{precise: true, state: rivertype.JobStateAvailable, want: rivertype.JobStateAvailable},
		{precise: true, state: rivertype.JobStatePending, want: rivertype.JobStatePending},
	}
	for i, tt := range tests {
		c := ctx
		if tt.precise {
			c = scheduler.WithPrecise(ctx)
		}
		at := time.Now().Add(time.Hour)
		p := &rivertype.JobInsertParams{State: tt.state, ScheduledAt: &at}
		require.NoError(t, h.InsertBegin(c, p))
		require.Equal(t, tt.want, p.State, "case %d", i)
		require.Equal(t, at, *p.ScheduledAt, "case %d: scheduled_at is kept", i)
	}
}

func TestPreciseQueueIsValid(t *testing.T) {
	t.Parallel()
	q := scheduler.PreciseQueue(5)
	require.LessOrEqual(t, q.FetchCooldown, q.FetchPollInterval, "River rejects a poll interval below the cooldown")
	require.Equal(t, 5, q.MaxWorkers)
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, &testdb.Options{NoMigrate: true})
	require.NoError(t, scheduler.Migrate(ctx, pool, nil))
	require.NoError(t, scheduler.Migrate(ctx, pool, nil), "a second run is a no-op")
	// The tables work: an insert-only client can list jobs in this schema.
	client := newClient(t, pool, nil)
	res, err := client.JobList(ctx, river.NewJobListParams())
	require.NoError(t, err)
	require.Empty(t, res.Jobs)
	require.Error(t, scheduler.Migrate(ctx, nil, nil))
}
