//go:build reliability

package reliability_test

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// The soak's scheduler workers: they cancel and settle the jobs of the reservations the other
// workers commit (scheduler.CancelTx, SettleManyTx), which credits their tokens back (and charges
// overruns) and pulls the waiting jobs forward, in READ COMMITTED and SERIALIZABLE transactions,
// with deliberate rollbacks, repeated settles and the killer running. Each credit or charge writes
// its ledger rows in the same transaction, so the exact ledger invariant of verify covers them:
// a refund or settlement that counted twice, or was lost, would show there. A cancelled or settled
// job stays in river_job with its args, so the reservations still match the jobs one for one.
const (
	soakSchedWorkers = 2
	soakOpCancel     = "cancel"
	soakOpSettle     = "settle"
	soakOpCharge     = "settle_charge" // the ledger kind of an overrun charged by a settlement
)

// soakSched holds the scheduler workers' client and tallies.
type soakSched struct {
	s      *soakRun
	client *river.Client[pgx.Tx]
	sched  *scheduler.Scheduler

	cancels, settles, repeats, refused, pulled atomic.Int64
}

// startSched starts the scheduler workers on wg; they stop at deadline or on a failure, and log
// their tallies.
func (s *soakRun) startSched(t *testing.T, wg *sync.WaitGroup, deadline time.Time, seed uint64) {
	t.Helper()
	client, sched := testdb.InsertScheduler(t, s.pool, s.lim, nil)
	ss := &soakSched{s: s, client: client, sched: sched}
	var mine sync.WaitGroup
	for w := range soakSchedWorkers {
		mine.Add(1)
		go func() {
			defer mine.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(1000+w)))
			for time.Now().Before(deadline) && s.failures.Load() == 0 {
				ss.once(rng)
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		mine.Wait()
		t.Logf("scheduler workers: %d cancels with refund, %d settlements (%d repeated, changing nothing), %d refused (started, settled or cancelled), %d waiting jobs pulled forward",
			ss.cancels.Load(), ss.settles.Load(), ss.repeats.Load(), ss.refused.Load(), ss.pulled.Load())
		if s.failures.Load() == 0 && (ss.cancels.Load() == 0 || ss.settles.Load() == 0 || ss.pulled.Load() == 0) {
			s.failf("the scheduler workers did not exercise what they claim: cancels %d, settlements %d, pulled forward %d",
				ss.cancels.Load(), ss.settles.Load(), ss.pulled.Load())
		}
	}()
}

// once cancels or settles one random waiting job of the soak in its own transaction.
func (ss *soakSched) once(rng *rand.Rand) {
	s := ss.s
	defer func() {
		if r := recover(); r != nil {
			s.failf("panic: %v\n%s", r, debug.Stack())
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// One of the older of the 50 latest jobs, to cancel or settle while later ones wait behind it.
	list, err := ss.client.JobList(ctx, river.NewJobListParams().Kinds(soakJobArgs{}.Kind()).
		States(rivertype.JobStateAvailable).OrderBy(river.JobListOrderByID, river.SortOrderDesc).First(50))
	if err != nil {
		s.errs.add(err)
		return
	}
	if len(list.Jobs) == 0 {
		time.Sleep(5 * time.Millisecond)
		return
	}
	job := list.Jobs[len(list.Jobs)-1-rng.IntN(min(len(list.Jobs), 10))]
	if rng.IntN(2) == 0 { // the oldest still waiting for its tokens: jobs behind it can move
		for i := len(list.Jobs) - 1; i >= 0; i-- {
			if soakWaiting(list.Jobs[i], s.clock.Now()) {
				job = list.Jobs[i]
				break
			}
		}
	}
	op := s.nextOp.Add(1)
	s.clock.tick()
	kind := soakOpCancel
	if rng.IntN(2) == 0 {
		kind = soakOpSettle
	}
	var reqs []soakReq
	for _, r := range soakJobReserved(job) {
		for _, l := range s.limits {
			if l.name == r.Name {
				reqs = append(reqs, soakReq{lim: l, key: r.Key, count: r.Tokens})
			}
		}
	}
	actual := make([]float64, len(reqs))
	for i, r := range reqs {
		actual[i] = float64(rng.IntN(2*int(r.count) + 1)) // integers in [0, 2·reserved]: credits and overruns
	}
	repeat := rng.IntN(4) == 0
	rollback := rng.IntN(100) < 10
	body := func(ctx context.Context, tx pgx.Tx) error {
		if kind == soakOpCancel {
			return ss.cancel(ctx, tx, op, job.ID, reqs, rollback)
		}
		return ss.settle(ctx, tx, op, job.ID, reqs, actual, repeat, rollback)
	}
	if rng.IntN(2) == 0 {
		err = ratelimit.InSerializableTx(ctx, s.pool, &ratelimit.TxOpts{MaxAttempts: 8, MaxBackoff: 50 * time.Millisecond}, body)
	} else {
		err = pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error { return body(ctx, tx) })
	}
	switch {
	case err == nil:
		s.commits.Add(1)
	case errors.Is(err, errSoakRollback):
		s.rollbacks.Add(1)
	case errors.Is(err, scheduler.ErrNotCancellable):
		ss.refused.Add(1)
	default:
		s.errs.add(err)
		if soakBug(err) || errors.Is(err, scheduler.ErrSetup) {
			s.failf("op %d (%s job %d): %v", op, kind, job.ID, err)
		}
	}
}

// cancel cancels job and writes its refunds to the ledger.
func (ss *soakSched) cancel(ctx context.Context, tx pgx.Tx, op, jobID int64, reqs []soakReq, rollback bool) error {
	res, err := ss.sched.CancelTx(ctx, tx, jobID)
	if err != nil {
		return err
	}
	if len(res.Limits) != len(reqs) {
		ss.s.failf("op %d: CancelTx of job %d refunded %d limits, it reserved %d", op, jobID, len(res.Limits), len(reqs))
		return errors.New("soak: bad refund")
	}
	for i, r := range res.Limits {
		if r.Credited != reqs[i].count || r.Name != reqs[i].lim.name || r.Key != reqs[i].key {
			// Only the capacity can cut a credit short, and no shard ever gets near it.
			ss.s.failf("op %d: CancelTx of job %d refunded %+v, it reserved %s/%s %g", op, jobID, r, reqs[i].lim.name, reqs[i].key, reqs[i].count)
		}
		if err := ss.s.ledger(ctx, tx, op, soakOpCredit, []soakReq{{lim: reqs[i].lim, key: r.Key, count: r.Credited}}, +1); err != nil {
			return err
		}
	}
	if rollback {
		return errSoakRollback
	}
	ss.cancels.Add(1)
	ss.pulled.Add(int64(res.PulledForward))
	return nil
}

// settle settles job with actual and writes its credits and charges to the ledger, unless it was
// settled (or cancelled) already; when repeat is set it settles a second time in the same
// transaction, which must change nothing.
func (ss *soakSched) settle(ctx context.Context, tx pgx.Tx, op, jobID int64, reqs []soakReq, actual []float64, repeat, rollback bool) error {
	res, err := ss.sched.SettleManyTx(ctx, tx, jobID, actual)
	if err != nil {
		return err
	}
	if res.Repeated {
		ss.repeats.Add(1)
		return nil // settled or cancelled by an earlier transaction: nothing written
	}
	for i, l := range res.Limits {
		r := reqs[i]
		want := soakSettledLimit(r, actual[i])
		if l != want {
			ss.s.failf("op %d: SettleManyTx of job %d: %+v, want %+v", op, jobID, l, want)
		}
		switch {
		case l.Credited > 0:
			err = ss.s.ledger(ctx, tx, op, soakOpCredit, []soakReq{{lim: r.lim, key: r.key, count: l.Credited}}, +1)
		case l.Charged > 0:
			err = ss.s.ledger(ctx, tx, op, soakOpCharge, []soakReq{{lim: r.lim, key: r.key, count: l.Charged}}, -1)
		}
		if err != nil {
			return err
		}
	}
	if repeat {
		again, err := ss.sched.SettleManyTx(ctx, tx, jobID, actual)
		if err != nil {
			return err
		}
		if !again.Repeated || len(again.Limits) != len(res.Limits) {
			ss.s.failf("op %d: a second SettleManyTx of job %d in the same transaction settled again: %+v", op, jobID, again)
		}
		ss.repeats.Add(1)
	}
	if rollback {
		return errSoakRollback
	}
	ss.settles.Add(1)
	ss.pulled.Add(int64(res.PulledForward))
	return nil
}

// soakSettledLimit is what settling r with actual must report.
func soakSettledLimit(r soakReq, actual float64) scheduler.SettledLimit {
	l := scheduler.SettledLimit{Name: r.lim.name, Key: r.key, Reserved: r.count, Actual: actual}
	if actual > r.count {
		l.Charged = actual - r.count
	} else {
		l.Credited = r.count - actual
	}
	return l
}

// soakJobReserved returns what a soak job's args say it reserved, in request order.
func soakJobReserved(job *rivertype.JobRow) []soakReserved {
	var args soakJobArgs
	if err := jsonUnmarshalSoak(job.EncodedArgs, &args); err != nil {
		return nil
	}
	return args.Reserved
}

// soakWaiting reports whether the reservation recorded on job (job metadata "txlimit_reserved") is
// due after now on one of its limits.
func soakWaiting(job *rivertype.JobRow, now time.Time) bool {
	var md map[string]struct {
		Limits []struct {
			RetryAt time.Time `json:"retry_at"`
		} `json:"limits"`
	}
	if jsonUnmarshalSoak(job.Metadata, &md) != nil {
		return false
	}
	for _, l := range md["txlimit_reserved"].Limits {
		if l.RetryAt.After(now) {
			return true
		}
	}
	return false
}

func jsonUnmarshalSoak(b []byte, v any) error { return json.Unmarshal(b, v) }
