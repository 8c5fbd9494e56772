//go:build reliability

package reliability_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// privEnvRevoke names an optional privilege clause that TestLeastPrivilege revokes after applying
// the README's grants, to show what that grant is needed for.
const privEnvRevoke = "TXLIMIT_PRIV_REVOKE"

// privGrants returns the SQL block of README.md between its grants markers: the grants the README
// tells users to give their run-time role. The test applies exactly this text, so the README and
// what is tested cannot drift apart.
func privGrants(t *testing.T) string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatalf("read README.md: %v", err)
	}
	_, rest, ok := strings.Cut(string(readme), "<!-- grants:begin -->\n```sql\n")
	block, _, ok2 := strings.Cut(rest, "```\n<!-- grants:end -->")
	if !ok || !ok2 || !strings.Contains(block, "GRANT") {
		t.Fatal("README.md has no ```sql block of GRANTs between <!-- grants:begin --> and <!-- grants:end -->")
	}
	if !strings.Contains(block, "<schema>") || !strings.Contains(block, "<role>") {
		t.Fatal("README.md's grants block must use the placeholders <schema> and <role>")
	}
	return block
}

// privJobArgs is a job worked by the run-time role's River client. With a Budget it settles the
// reservation that paid for it (Settle) and completes itself in the same transaction.
type privJobArgs struct {
	Step   string               `json:"step"`
	Budget scheduler.Settlement `json:"budget"`
	Actual float64              `json:"actual"`
}

func (privJobArgs) Kind() string { return "txlimit_priv_job" }

// privGatedArgs is a job that pays the limit "gated" through a scheduler.Gate before it runs.
type privGatedArgs struct {
	N int `json:"n"`
}

func (privGatedArgs) Kind() string { return "txlimit_priv_gated" }

// privLog records what River logs at warning level and above.
type privLog struct {
	mu      sync.Mutex
	records []string
}

func (l *privLog) Enabled(_ context.Context, level slog.Level) bool { return level >= slog.LevelWarn }

func (l *privLog) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Level.String() + " " + r.Message)
	r.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
	l.mu.Lock()
	l.records = append(l.records, b.String())
	l.mu.Unlock()
	return nil
}

func (l *privLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *privLog) WithGroup(string) slog.Handler      { return l }

func (l *privLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.records...)
}

// privEvents counts River's job events by kind and step.
type privEvents struct {
	mu     sync.Mutex
	counts map[string]int
	errs   []string
}

func (e *privEvents) add(what string) {
	e.mu.Lock()
	e.counts[what]++
	e.mu.Unlock()
}

func (e *privEvents) fail(format string, args ...any) {
	e.mu.Lock()
	e.errs = append(e.errs, fmt.Sprintf(format, args...))
	e.mu.Unlock()
}

func (e *privEvents) get(what string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.counts[what]
}

// privIsPermissionDenied reports whether err is Postgres's insufficient_privilege (42501), as a
// *pgconn.PgError in the chain or, when a migrator flattened the chain, in the text.
func privIsPermissionDenied(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "42501"
	}
	return err != nil && strings.Contains(err.Error(), "SQLSTATE 42501")
}

// privCatalog describes every object of schema and the applied migration versions, as the owner
// sees them: two equal descriptions mean the schema did not change.
func privCatalog(t *testing.T, owner *pgxpool.Pool, schema string) string {
	t.Helper()
	var out string
	err := owner.QueryRow(context.Background(), `
		SELECT coalesce(string_agg(x, E'\n' ORDER BY x), '') FROM (
			SELECT format('rel %s %s owner=%s', c.relname, c.relkind, pg_get_userbyid(c.relowner)) AS x
			FROM pg_class c WHERE c.relnamespace = $1::text::regnamespace
			UNION ALL
			SELECT format('col %s.%s %s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod))
			FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
			WHERE c.relnamespace = $1::text::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
			UNION ALL
			SELECT format('fn %s owner=%s', p.oid::regprocedure, pg_get_userbyid(p.proowner))
			FROM pg_proc p WHERE p.pronamespace = $1::text::regnamespace
			UNION ALL
			SELECT format('type %s', t.typname) FROM pg_type t WHERE t.typnamespace = $1::text::regnamespace
			UNION ALL
			SELECT format('goose %s %s', version_id, is_applied) FROM txlimit_goose_version
			UNION ALL
			SELECT format('river %s %s', line, version) FROM river_migration
		) s`, schema).Scan(&out)
	if err != nil {
		t.Fatalf("describe schema %s: %v", schema, err)
	}
	return out
}

// TestLeastPrivilege: a role with only the README's grants can use every call of ratelimit and
// scheduler and run a River client, and cannot migrate.
func TestLeastPrivilege(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// The owner: creates the schema, migrates txlimit and River.
	owner := testdb.Pool(t, &testdb.Options{MaxConns: 3})
	if err := scheduler.Migrate(ctx, owner, nil); err != nil {
		t.Fatalf("scheduler.Migrate as the owner: %v", err)
	}
	var schema string
	if err := owner.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		t.Fatal(err)
	}
	// A hardened database: functions are not executable by PUBLIC, so the role can use only
	// what the grants give it.
	if _, err := owner.Exec(ctx, "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA "+pgx.Identifier{schema}.Sanitize()+" FROM PUBLIC"); err != nil {
		t.Fatalf("revoke PUBLIC's EXECUTE: %v", err)
	}

	// The run-time role, unique to this run, with a password so that it can log in whatever the
	// server's authentication method.
	var b [6]byte
	_, _ = rand.Read(b[:])
	role := "txlimit_priv_" + hex.EncodeToString(b[:])
	password := hex.EncodeToString(b[:]) + "-pw"
	if _, err := owner.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD '%s' NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS",
		pgx.Identifier{role}.Sanitize(), password)); err != nil {
		t.Fatalf("create role %s (the test database's user needs CREATEROLE): %v", role, err)
	}
	t.Cleanup(func() {
		// Runs after the role's pool is closed (cleanups run last-in first-out).
		ctx := context.Background()
		_, _ = owner.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
		for _, q := range []string{"DROP OWNED BY " + pgx.Identifier{role}.Sanitize(), "DROP ROLE " + pgx.Identifier{role}.Sanitize()} {
			if _, err := owner.Exec(ctx, q); err != nil {
				t.Errorf("cleanup: %s: %v", q, err)
			}
		}
	})
	grants := strings.NewReplacer("<schema>", pgx.Identifier{schema}.Sanitize(), "<role>", pgx.Identifier{role}.Sanitize()).Replace(privGrants(t))
	if _, err := owner.Exec(ctx, grants); err != nil {
		t.Fatalf("apply README.md's grants: %v\n%s", err, grants)
	}
	// To see what a grant is for, take part of it back and watch what breaks, e.g.
	// TXLIMIT_PRIV_REVOKE='DELETE ON river_job' or 'USAGE ON SCHEMA <schema>'
	// (docs/reliability.md lists the outcomes).
	if revoke := os.Getenv(privEnvRevoke); revoke != "" {
		revoke = strings.ReplaceAll(revoke, "<schema>", pgx.Identifier{schema}.Sanitize())
		q := "REVOKE " + revoke + " FROM " + pgx.Identifier{role}.Sanitize()
		if _, err := owner.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		t.Logf("%s=%q: %s; this run is expected to fail", privEnvRevoke, revoke, q)
	}

	cfg, err := pgxpool.ParseConfig(testdb.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	cfg.ConnConfig.Password = password
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	// The role is what it should be: logged in as itself, not a superuser, no CREATE on the
	// schema, owner of nothing in it.
	var who string
	var super, create bool
	var owned int
	err = pool.QueryRow(ctx, `SELECT session_user, r.rolsuper, has_schema_privilege(current_user, $1, 'CREATE'),
			(SELECT count(*) FROM pg_class c WHERE c.relnamespace = $1::text::regnamespace AND c.relowner = r.oid)
		FROM pg_roles r WHERE r.rolname = current_user`, schema).Scan(&who, &super, &create, &owned)
	if err != nil {
		t.Fatalf("connect as %s: %v", role, err)
	}
	if who != role || super || create || owned != 0 {
		t.Fatalf("the run-time role is not least-privileged: session_user=%s superuser=%v create=%v owns=%d", who, super, create, owned)
	}

	var operations, allowed, migrateRefused, failures int
	op := func(name string, fn func() error) {
		t.Helper()
		operations++
		err := func() (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("panicked: %v", r)
				}
			}()
			return fn()
		}()
		if err != nil {
			failures++
			t.Errorf("as the run-time role, %s: %v", name, err)
			return
		}
		allowed++
	}
	defer func() {
		fmt.Printf("reliability: privilege: operations=%d allowed=%d migrate_refused=%d failures=%d\n",
			operations, allowed, migrateRefused, failures)
	}()

	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"api":     {Rate: 10, Period: time.Hour, MaxReserved: 10}, // no refill to speak of: Credit's exact figure holds however slow the steps
		"sharded": {Rate: 40, Period: time.Second, MaxReserved: 100, Shards: 4},
		"brief":   {Rate: 1000, Period: time.Second},                             // full again a millisecond after a call
		"llm":     {Rate: 10, Period: time.Second, Capacity: 1, MaxReserved: 10}, // a reservation waits 100 ms a token
		"gated":   {Rate: 1, Period: 2 * time.Second, Capacity: 1},               // the 2nd and 3rd gated jobs snooze however fast River works them
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := func(cond bool, format string, args ...any) error {
		if cond {
			return nil
		}
		return fmt.Errorf(format, args...)
	}

	// package ratelimit, every call.
	op("Limit", func() error {
		r, err := limiter.Limit(ctx, pool, "api", "user-1", nil)
		return errors.Join(err, want(r.OK, "denied"))
	})
	op("LimitN with Reserve", func() error {
		r, err := limiter.LimitN(ctx, pool, "api", "user-1", 15, &ratelimit.LimitOpts{Reserve: true})
		return errors.Join(err, want(r.OK && r.Reserved, "not reserved: %+v", r))
	})
	op("Check", func() error { _, err := limiter.Check(ctx, pool, "api", "user-1", nil); return err })
	op("CheckN", func() error { _, err := limiter.CheckN(ctx, pool, "sharded", "hot", 3, nil); return err })
	op("Limit on a sharded limit", func() error {
		r, err := limiter.LimitN(ctx, pool, "sharded", "hot", 7, nil) // more than one shard holds: both picks
		return errors.Join(err, want(r.OK, "denied"))
	})
	op("Limit on a sharded limit in a SERIALIZABLE transaction", func() error {
		// Steering checks each shard it settles on for staleness under a snapshot (txlimit_stale).
		var r ratelimit.Result
		err := ratelimit.InSerializableTx(ctx, pool, nil, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			r, err = limiter.Limit(ctx, tx, "sharded", "serializable", nil)
			return err
		})
		return errors.Join(err, want(r.OK, "denied"))
	})
	op("LimitMany", func() error {
		r, err := limiter.LimitMany(ctx, pool, []ratelimit.Request{
			{Name: "api", Key: "user-2"}, {Name: "sharded", Key: "hot"}, {Name: "sharded", Key: "cold", Count: 2},
		}, nil)
		return errors.Join(err, want(r.OK, "denied"))
	})
	op("CheckMany", func() error {
		_, err := limiter.CheckMany(ctx, pool, []ratelimit.Request{{Name: "api", Key: "user-1"}, {Name: "sharded", Key: "hot"}}, nil)
		return err
	})
	op("Credit", func() error {
		r, err := limiter.Credit(ctx, pool, "api", "user-1", 2, nil)
		return errors.Join(err, want(r.Credited == 2, "credited %v", r.Credited))
	})
	op("State", func() error {
		st, err := limiter.State(ctx, pool, "sharded", "hot", nil)
		return errors.Join(err, want(len(st.Shards) == 4, "shards %v", st.Shards))
	})
	op("Reset", func() error { return limiter.Reset(ctx, pool, "api", "user-2") })
	op("Prune", func() error {
		if _, err := limiter.Limit(ctx, pool, "brief", "k", nil); err != nil {
			return err
		}
		time.Sleep(5 * time.Millisecond)
		n, err := limiter.Prune(ctx, pool, "brief", nil)
		return errors.Join(err, want(n >= 1, "pruned %d rows, want >= 1", n))
	})
	op("CheckSchema (the start-up check the README's set-up makes)", func() error {
		return ratelimit.CheckSchema(ctx, pool)
	})
	op("InSerializableTx", func() error {
		return ratelimit.InSerializableTx(ctx, pool, nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := limiter.LimitMany(ctx, tx, []ratelimit.Request{{Name: "api", Key: "user-3"}, {Name: "sharded", Key: "hot"}}, nil)
			return err
		})
	})

	// package scheduler and a River client, all as the role.
	events := &privEvents{counts: map[string]int{}}
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[privJobArgs]) error {
		if job.Args.Budget.Name == "" {
			events.add("done " + job.Args.Step)
			return nil
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			events.fail("job %s: begin: %v", job.Args.Step, err)
			return err
		}
		defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
		res, err := job.Args.Budget.Settle(ctx, tx, limiter, job.Args.Actual, nil)
		if err != nil {
			events.fail("job %s: Settle: %v", job.Args.Step, err)
			return err
		}
		if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
			events.fail("job %s: JobCompleteTx: %v", job.Args.Step, err)
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			events.fail("job %s: commit: %v", job.Args.Step, err)
			return err
		}
		switch {
		case res.Credited > 0:
			events.add("settle credit")
		case res.Charged > 0:
			events.add("settle charge")
		}
		events.add("done " + job.Args.Step)
		return nil
	}))
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[privGatedArgs]) error {
		events.add("done gated")
		return nil
	}))
	gate, err := scheduler.NewGate(&scheduler.GateConfig{
		DB:      pool,
		Limiter: limiter,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "gated"}, job.Kind == privGatedArgs{}.Kind()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	logs := &privLog{}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Hooks:               []rivertype.Hook{&scheduler.PreciseHook{}},
		Logger:              slog.New(logs),
		Middleware:          []rivertype.Middleware{gate},
		Queues:              map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(4)},
		ReindexerIndexNames: []string{}, // REINDEX needs the owner: see README.md
		TestOnly:            true,
		Workers:             workers,
	})
	if err != nil {
		t.Fatal(err)
	}
	sub, cancelSub := client.Subscribe(river.EventKindJobCompleted, river.EventKindJobSnoozed, river.EventKindJobFailed)
	defer cancelSub()
	go func() {
		for ev := range sub {
			events.add(string(ev.Kind))
			if ev.Kind == river.EventKindJobFailed {
				events.fail("job %d (%s) failed: %v", ev.Job.ID, ev.Job.Kind, ev.Job.Errors)
			}
		}
	}()
	sched, err := scheduler.New(client, limiter, nil)
	if err != nil {
		t.Fatal(err)
	}
	inTx := func(fn func(tx pgx.Tx) error) error { return pgx.BeginFunc(ctx, pool, fn) }

	stopped := false
	op("River client Start (leader election, queue registration)", func() error { return client.Start(ctx) })
	t.Cleanup(func() {
		if !stopped {
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = client.Stop(sctx)
		}
	})
	op("Scheduler.Check (the start-up check the README's set-up makes)", func() error {
		return sched.Check(ctx, pool, privJobArgs{})
	})
	later := &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: time.Now().Add(time.Hour)}}
	op("CancelTx of a reserved job that has not started", func() error {
		return inTx(func(tx pgx.Tx) error {
			r, err := sched.ReserveTx(ctx, tx, "api", "user-6", 1, privJobArgs{Step: "cancelled"}, later)
			if err != nil {
				return err
			}
			s, err := sched.CancelTx(ctx, tx, r.Job.ID)
			if err != nil {
				return err
			}
			return want(s.Cancelled && s.Limits[0].Credited > 0, "cancel: %+v", s)
		})
	})
	op("SettleTx of a reserved job", func() error {
		return inTx(func(tx pgx.Tx) error {
			r, err := sched.ReserveTx(ctx, tx, "api", "user-7", 2, privJobArgs{Step: "settled"}, later)
			if err != nil {
				return err
			}
			s, err := sched.SettleTx(ctx, tx, r.Job.ID, 1)
			if err != nil {
				return err
			}
			if _, err := sched.CancelTx(ctx, tx, r.Job.ID); !errors.Is(err, scheduler.ErrNotCancellable) {
				return fmt.Errorf("cancel of a settled job: got %v, want ErrNotCancellable", err)
			}
			return want(s.Limits[0].Credited > 0, "settle: %+v", s)
		})
	})
	budget := func(reserved float64) scheduler.Settlement {
		return scheduler.Settlement{Name: "llm", Key: "org", Reserved: reserved}
	}
	op("ReserveTx (runs now)", func() error {
		return inTx(func(tx pgx.Tx) error {
			r, err := sched.ReserveTx(ctx, tx, "llm", "org", 1, privJobArgs{Step: "now", Budget: budget(1), Actual: 0.5}, nil)
			if err != nil {
				return err
			}
			return want(r.ScheduledAt.IsZero(), "scheduled at %s, want now", r.ScheduledAt)
		})
	})
	op("ReserveTx (reserved, scheduled for RetryAt)", func() error {
		return inTx(func(tx pgx.Tx) error {
			// 2 is more than the capacity of 1: reserved however long since the last call.
			r, err := sched.ReserveTx(ctx, tx, "llm", "org", 2, privJobArgs{Step: "reserved", Budget: budget(2), Actual: 2.5}, nil)
			if err != nil {
				return err
			}
			return want(!r.ScheduledAt.IsZero(), "not scheduled")
		})
	})
	op("ReserveManyTx", func() error {
		return inTx(func(tx pgx.Tx) error {
			_, err := sched.ReserveManyTx(ctx, tx, []ratelimit.Request{{Name: "api", Key: "user-4"}, {Name: "sharded", Key: "hot"}},
				privJobArgs{Step: "many"}, nil)
			return err
		})
	})
	unique := &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}}
	op("ReserveTx of a unique job, twice (duplicate credited back)", func() error {
		var dup bool
		for range 2 {
			err := inTx(func(tx pgx.Tx) error {
				r, err := sched.ReserveTx(ctx, tx, "api", "user-5", 1, privJobArgs{Step: "unique"}, unique)
				if err == nil {
					dup = r.Duplicate
				}
				return err
			})
			if err != nil {
				return err
			}
		}
		return want(dup, "the second insert was not a duplicate")
	})
	op("InsertManyTx of gated jobs", func() error {
		return inTx(func(tx pgx.Tx) error {
			_, err := client.InsertManyTx(ctx, tx, []river.InsertManyParams{{Args: privGatedArgs{N: 1}}, {Args: privGatedArgs{N: 2}}, {Args: privGatedArgs{N: 3}}})
			return err
		})
	})
	op("InsertTx of a job scheduled for later (promoted by River's scheduler)", func() error {
		return inTx(func(tx pgx.Tx) error {
			_, err := client.InsertTx(ctx, tx, privJobArgs{Step: "scheduled"}, &river.InsertOpts{ScheduledAt: time.Now().Add(200 * time.Millisecond)})
			return err
		})
	})

	// Wait for River to fetch, snooze and complete them all: 2 reserved + 1 many + 1 unique +
	// 3 gated + 1 scheduled. River's scheduler promotes a scheduled job within about 5 s.
	const wantCompleted = 8
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && events.get(string(river.EventKindJobCompleted)) < wantCompleted {
		time.Sleep(20 * time.Millisecond)
	}
	op("River fetched and completed every job", func() error {
		n := events.get(string(river.EventKindJobCompleted))
		return want(n == wantCompleted, "%d of %d jobs completed", n, wantCompleted)
	})
	op("Gate snoozed a job until its tokens were due, then ran it", func() error {
		return want(events.get(string(river.EventKindJobSnoozed)) >= 1 && events.get("done gated") == 3,
			"snoozed %d, gated jobs done %d of 3", events.get(string(river.EventKindJobSnoozed)), events.get("done gated"))
	})
	op("Settlement.Settle credits back an overestimate (in the job's completing tx)", func() error {
		return want(events.get("settle credit") == 1, "credits settled: %d", events.get("settle credit"))
	})
	op("Settlement.Settle charges an overrun (in the job's completing tx)", func() error {
		return want(events.get("settle charge") == 1, "charges settled: %d", events.get("settle charge"))
	})
	op("River client Stop", func() error {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		stopped = true
		return client.Stop(sctx)
	})
	events.mu.Lock()
	for _, e := range events.errs {
		failures++
		t.Errorf("as the run-time role: %s", e)
	}
	events.mu.Unlock()
	for _, r := range logs.all() {
		if strings.Contains(r, "permission denied") || strings.Contains(r, "42501") {
			failures++
			t.Errorf("River logged a permission error as the run-time role: %s", r)
		}
	}

	// The role cannot migrate, and trying leaves the schema as it was.
	before := privCatalog(t, owner, schema)
	for _, m := range []struct {
		name string
		run  func() error
	}{
		{"migrations.Up", func() error { return migrations.Up(ctx, pool) }},
		{"scheduler.Migrate", func() error { return scheduler.Migrate(ctx, pool, nil) }},
	} {
		var err error
		func() {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("panicked: %v", r)
				}
			}()
			err = m.run()
		}()
		if !privIsPermissionDenied(err) {
			failures++
			t.Errorf("%s as the run-time role: got %v, want a permission error (SQLSTATE 42501)", m.name, err)
			continue
		}
		migrateRefused++
		t.Logf("%s as the run-time role: refused: %v", m.name, err)
	}
	if after := privCatalog(t, owner, schema); after != before {
		failures++
		t.Errorf("the refused migrations changed the schema:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	// What the README says the role cannot do either: DDL, and River's REINDEX.
	for _, q := range []string{"CREATE TABLE txlimit_priv_probe (i int)", "REINDEX INDEX CONCURRENTLY river_job_kind"} {
		if _, err := pool.Exec(ctx, q); !privIsPermissionDenied(err) {
			failures++
			t.Errorf("%s as the run-time role: got %v, want a permission error", q, err)
		}
	}
}
