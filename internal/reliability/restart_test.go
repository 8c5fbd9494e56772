//go:build reliability

package reliability_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/txlimit/txlimit/internal/pgtemp"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// restartEnvBindir names a directory holding initdb, pg_ctl and postgres, for machines where
// TestRestart cannot find them (see restartBindir).
const restartEnvBindir = "TXLIMIT_PG_BINDIR"

// restartMaxRecovery is the longest a decision may take to succeed again after the server accepts
// connections.
const restartMaxRecovery = 5 * time.Second

// restartT0 is the frozen time of the restart's limiter: nothing ever refills, so every token
// granted during the whole run comes out of the capacity.
var restartT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// The restart's limits. Those with a per-phase key (p0, p1, …: a fresh key after each restart)
// are far from exhausted, so grants are being written when the server stops, and the first
// decision after a restart is a grant; their check is that every grant acknowledged as committed
// survived the stop (including the crash of -m immediate). restart_tight has one key for the whole
// run and is exhausted early: across both restarts it must never grant more than its capacity.
var restartLimits = map[string]ratelimit.Config{
	"restart_cap":     {Rate: 1, Period: time.Hour, Capacity: 1e6},
	"restart_shard":   {Rate: 4, Period: time.Hour, Capacity: 4e5, Shards: 4},
	"restart_reserve": {Rate: 1, Period: time.Hour, Capacity: 100, MaxReserved: 1e6},
	"restart_tight":   {Rate: 1, Period: time.Hour, Capacity: 300},
}

// restartTightKey is restart_tight's only key.
const restartTightKey = "all"

// restartCluster is a throwaway Postgres cluster that TestRestart owns: initdb'd into a temporary
// directory, listening on 127.0.0.1 only, on a port of its own, with trust authentication. It is
// never the shared server of the other tests.
type restartCluster struct {
	bindir string
	base   string // holds data/ and the server log
	data   string
	log    string
	port   int
	runAs  string // the OS user that runs initdb, pg_ctl and postgres: "postgres" under root, else "" (this user)
}

// restartBindir finds the directory of initdb, pg_ctl and postgres: $TXLIMIT_PG_BINDIR, else
// `pg_config --bindir`, else the newest /usr/lib/postgresql/*/bin, else the directory of an initdb
// on $PATH.
func restartBindir() (string, error) {
	has := func(dir string) bool {
		for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
			if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
				return false
			}
		}
		return true
	}
	var tried []string
	if dir := os.Getenv(restartEnvBindir); dir != "" {
		if has(dir) {
			return dir, nil
		}
		return "", fmt.Errorf("%s=%s holds no initdb, pg_ctl and postgres", restartEnvBindir, dir)
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dir := strings.TrimSpace(string(out))
		if has(dir) {
			return dir, nil
		}
		tried = append(tried, "pg_config --bindir ("+dir+")")
	} else {
		tried = append(tried, "pg_config --bindir (not found)")
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { // newest major version first
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi > vj
	})
	for _, dir := range dirs {
		if has(dir) {
			return dir, nil
		}
	}
	tried = append(tried, "/usr/lib/postgresql/*/bin")
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil && has(filepath.Dir(real)) {
			return filepath.Dir(real), nil
		}
	}
	tried = append(tried, "initdb on $PATH")
	return "", fmt.Errorf("no Postgres server binaries (initdb, pg_ctl, postgres): tried %s; install the Postgres server or set %s",
		strings.Join(tried, ", "), restartEnvBindir)
}

// restartNewCluster initdb's a cluster and starts it. The cluster is stopped (immediate mode) and
// its directory removed when the test ends, whether it passed or not.
func restartNewCluster(t *testing.T) *restartCluster {
	t.Helper()
	bindir, err := restartBindir()
	if err != nil {
		t.Fatal(err)
	}
	base, err := os.MkdirTemp("", "txlimit-restart-")
	if err != nil {
		t.Fatal(err)
	}
	c := &restartCluster{bindir: bindir, base: base, data: filepath.Join(base, "data"), log: filepath.Join(base, "server.log")}
	t.Cleanup(func() {
		if _, err := os.Stat(filepath.Join(c.data, "postmaster.pid")); err == nil {
			if out, err := c.pgctl("stop", "-m", "immediate", "-w", "-t", "60"); err != nil {
				t.Errorf("stop the throwaway cluster: %v\n%s", err, out)
			}
		}
		if t.Failed() {
			if log, err := os.ReadFile(c.log); err == nil {
				t.Logf("server log of the throwaway cluster:\n%s", log)
			}
		}
		if err := os.RemoveAll(base); err != nil {
			t.Errorf("remove %s: %v", base, err)
		}
	})
	if os.Geteuid() == 0 {
		// initdb and postgres refuse to run as root: the cluster belongs to the postgres user.
		c.runAs = "postgres"
		if _, err := exec.LookPath("runuser"); err != nil {
			t.Fatalf("running as root, the throwaway cluster is run as %q with runuser (util-linux), which is not on $PATH: %v", c.runAs, err)
		}
		u, err := user.Lookup(c.runAs)
		if err != nil {
			t.Fatalf("running as root, the throwaway cluster needs an OS user %q: %v", c.runAs, err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(base, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := c.command(c.bindir+"/initdb", "-D", c.data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
		"--locale=C", "--no-sync", "--no-instructions").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	for attempt := 1; ; attempt++ {
		if c.port, err = pgtemp.FreePort(); err != nil {
			t.Fatal(err)
		}
		// The last setting of a name wins, so a retry on another port appends again.
		conf := fmt.Sprintf("\n# TestRestart\nlisten_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = ''\n"+
			"fsync = off\nfull_page_writes = off\nmax_connections = 40\nshared_buffers = 16MB\n", c.port)
		f, err := os.OpenFile(filepath.Join(c.data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		_, err = f.WriteString(conf)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			t.Fatal(err)
		}
		out, err := c.pgctl("start", "-w", "-t", "60", "-l", c.log)
		if err == nil {
			break
		}
		if attempt == 3 {
			log, _ := os.ReadFile(c.log)
			t.Fatalf("pg_ctl start: %v\n%s\n%s", err, out, log)
		}
	}
	return c
}

// command runs a Postgres program as the cluster's user, in the cluster's directory (the
// postgres user may not be allowed into the test's).
func (c *restartCluster) command(path string, args ...string) *exec.Cmd {
	cmd := exec.Command(path, args...)
	if c.runAs != "" {
		cmd = exec.Command("runuser", append([]string{"-u", c.runAs, "--", path}, args...)...)
	}
	cmd.Dir = c.base
	return cmd
}

// pgctl runs pg_ctl on the cluster and returns its output.
func (c *restartCluster) pgctl(args ...string) (string, error) {
	out, err := c.command(c.bindir+"/pg_ctl", append([]string{"-D", c.data}, args...)...).CombinedOutput()
	return string(out), err
}

func (c *restartCluster) dsn() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", c.port)
}

// ping reports whether the server accepts a connection and answers a query now.
func (c *restartCluster) ping() bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.dsn())
	if err != nil {
		return false
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx) == nil
}

// restartCall is what one call of the load did, for the classification after the run.
type restartCall struct {
	start, end time.Time
	err        error
	ok         bool // the call said granted (with or without an error)
}

// restartRun is the state of TestRestart.
type restartRun struct {
	t     *testing.T
	pool  *pgxpool.Pool
	lim   *ratelimit.Limiter
	sched *scheduler.Scheduler

	phase       atomic.Int64 // the key suffix: a fresh key after each restart
	lastSuccess atomic.Int64 // UnixNano of the end of the latest call that succeeded

	mu       sync.Mutex
	calls    []restartCall
	acked    map[[2]string]float64 // tokens granted and acknowledged as committed, by (name, key)
	maybe    map[[2]string]float64 // tokens asked for by calls that failed: they may have committed
	failures atomic.Int64
}

func (r *restartRun) failf(format string, args ...any) {
	if r.failures.Add(1) <= 20 {
		r.t.Errorf(format, args...)
	}
}

// ack records the outcome of a call for tokens of (name, key): acknowledged as granted and
// committed when err is nil and granted, of unknown outcome when err is not nil.
func (r *restartRun) ack(name, key string, tokens float64, granted bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case err != nil:
		r.maybe[[2]string{name, key}] += tokens
	case granted:
		r.acked[[2]string{name, key}] += tokens
	}
}

// restartWindow is one stop of the server: it was fully down from down to up (when the start
// was issued), and accepted connections again at ready.
type restartWindow struct {
	mode                 string
	down, up, ready      time.Time
	firstSuccess         time.Time
	calls, errs, allowed int
}

// TestRestart stops its own Postgres server twice under load (pg_ctl stop -m fast, then -m
// immediate, which is a crash) and starts it again. Every call made while the server is down must
// fail with an error (fail closed: never "allowed"); nothing may panic; a decision must succeed
// again within 5 s of the server accepting connections; no acknowledged grant may be lost and no
// limit may grant more than it holds over the whole run; the jobs of reservations must match the
// reserved tokens exactly; and no goroutine may leak.
func TestRestart(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	start := time.Now()
	r := &restartRun{t: t, acked: map[[2]string]float64{}, maybe: map[[2]string]float64{}}
	var windows []*restartWindow
	var leaks int
	defer func() {
		var down, errs, allowed int
		var recovery time.Duration
		for _, w := range windows {
			down += w.calls
			errs += w.errs
			allowed += w.allowed
			if !w.firstSuccess.IsZero() {
				recovery = max(recovery, w.firstSuccess.Sub(w.ready))
			}
		}
		failures := r.failures.Load()
		if t.Failed() && failures == 0 {
			failures = 1
		}
		fmt.Printf("reliability: restart: stops=%d calls_while_down=%d errors_while_down=%d allowed_while_down=%d recovery=%dms leaks=%d failures=%d\n",
			len(windows), down, errs, allowed, recovery.Milliseconds(), leaks, failures)
		t.Logf("wall time %s", time.Since(start).Round(time.Millisecond))
	}()

	ctx := context.Background()
	c := restartNewCluster(t)
	t.Logf("throwaway cluster on 127.0.0.1:%d (binaries %s, run as %q), started in %s",
		c.port, c.bindir, c.runAs, time.Since(start).Round(time.Millisecond))

	cfg, err := pgxpool.ParseConfig(c.dsn())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "txlimit_restart"
	cfg.MaxConns = 8
	r.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer r.pool.Close()
	if err := migrations.Up(ctx, r.pool); err != nil {
		t.Fatalf("migrations.Up: %v", err)
	}
	if err := scheduler.Migrate(ctx, r.pool, &scheduler.MigrateOpts{Logger: soakQuietLogger()}); err != nil {
		t.Fatalf("scheduler.Migrate: %v", err)
	}
	r.lim, err = ratelimit.New(&ratelimit.LimiterConfig{Limits: restartLimits, Now: func() time.Time { return restartT0 }})
	if err != nil {
		t.Fatal(err)
	}
	_, r.sched = testdb.InsertScheduler(t, r.pool, r.lim, nil)

	// The load: workers call until stop is closed, and keep calling while the server is down.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(start.UnixNano()), uint64(w)))
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := r.once(rng); err != nil {
					time.Sleep(10 * time.Millisecond) // no hot loop while the server is down
				}
			}
		}()
	}
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopLoad() // also when a check below stops the test

	time.Sleep(1500 * time.Millisecond)
	for _, mode := range []string{"fast", "immediate"} {
		w := &restartWindow{mode: mode}
		windows = append(windows, w)
		if out, err := c.pgctl("stop", "-m", mode, "-w", "-t", "60"); err != nil {
			t.Fatalf("pg_ctl stop -m %s: %v\n%s", mode, err, out)
		}
		w.down = time.Now()
		time.Sleep(1500 * time.Millisecond)
		w.up = time.Now()
		r.phase.Add(1)
		if out, err := c.pgctl("start", "-W", "-l", c.log); err != nil {
			t.Fatalf("pg_ctl start: %v\n%s", err, out)
		}
		// ready is when the first successful probe began: the server accepted its connection
		// at some instant after that, so recoveries measured from it are if anything too long.
		for {
			w.ready = time.Now()
			if c.ping() {
				break
			}
			if time.Since(w.up) > 60*time.Second {
				t.Fatalf("the server did not accept connections within 60 s of pg_ctl start")
			}
			time.Sleep(2 * time.Millisecond)
		}
		for r.lastSuccess.Load() < w.ready.UnixNano() {
			if time.Since(w.ready) > 2*restartMaxRecovery {
				t.Fatalf("no decision succeeded within %s of the server accepting connections again (stop -m %s)", 2*restartMaxRecovery, mode)
			}
			time.Sleep(time.Millisecond)
		}
		time.Sleep(1500 * time.Millisecond)
	}
	stopLoad()

	// Classify the calls: those that started after a stop had completed and ended before the start
	// was issued ran while the server was down.
	for _, call := range r.calls {
		for _, w := range windows {
			if !call.start.Before(w.down) && !call.end.After(w.up) {
				w.calls++
				if call.err != nil {
					w.errs++
				} else {
					r.failf("a call made while the server was down (stop -m %s) returned no error (granted %v)", w.mode, call.ok)
				}
				if call.ok {
					w.allowed++
					r.failf("a call made while the server was down (stop -m %s) said granted (error: %v)", w.mode, call.err)
				}
			}
			if call.err == nil && call.end.After(w.up) && (w.firstSuccess.IsZero() || call.end.Before(w.firstSuccess)) {
				w.firstSuccess = call.end
			}
		}
	}
	for _, w := range windows {
		// A worker may get through a moment before the probe does: that counts as no wait.
		recovery := max(w.firstSuccess.Sub(w.ready), 0)
		first := w.firstSuccess
		if w.firstSuccess.Before(w.ready) {
			w.firstSuccess = w.ready // for the summary line
		}
		t.Logf("stop -m %s: down %s, %d calls while down, all failed: %v; after pg_ctl start, the server accepted connections "+
			"in %s and the first decision succeeded in %s: recovery %s",
			w.mode, w.up.Sub(w.down).Round(time.Millisecond), w.calls, w.errs == w.calls,
			w.ready.Sub(w.up).Round(time.Millisecond), first.Sub(w.up).Round(time.Millisecond), recovery.Round(time.Millisecond))
		if recovery >= restartMaxRecovery {
			r.failf("stop -m %s: the first decision succeeded %s after the server accepted connections again (limit %s)", w.mode, recovery, restartMaxRecovery)
		}
		if w.calls == 0 {
			r.failf("stop -m %s: no call was made while the server was down: the test checked nothing", w.mode)
		}
	}
	r.verify(t)

	r.pool.Close()
	if err := goleak.Find(ignore); err != nil {
		leaks = strings.Count(err.Error(), "Goroutine ")
	}
	goleak.VerifyNone(t, ignore)
}

// once makes one call of the load, of a kind drawn at random, records it, and returns its error.
// A panic is recorded as a failure.
func (r *restartRun) once(rng *rand.Rand) (err error) {
	call := restartCall{start: time.Now()}
	defer func() {
		if p := recover(); p != nil {
			r.failf("panic: %v\n%s", p, debug.Stack())
			err = fmt.Errorf("panic: %v", p)
		}
		call.end, call.err = time.Now(), err
		if err == nil {
			for {
				last := r.lastSuccess.Load()
				if call.end.UnixNano() <= last || r.lastSuccess.CompareAndSwap(last, call.end.UnixNano()) {
					break
				}
			}
		}
		r.mu.Lock()
		r.calls = append(r.calls, call)
		r.mu.Unlock()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	key := "p" + strconv.FormatInt(r.phase.Load(), 10)
	checkClosed := func(ok bool, err error, what string) {
		if err != nil && ok {
			r.failf("%s said granted with error %v", what, err)
		}
	}

	switch rng.IntN(5) {
	case 0: // a decision of its own on the pool
		count := float64(1 + rng.IntN(3))
		res, err := r.lim.LimitN(ctx, r.pool, "restart_cap", key, count, nil)
		checkClosed(res.OK, err, "LimitN on the pool")
		call.ok = res.OK
		r.ack("restart_cap", key, count, res.OK, err)
		return err

	case 1: // two limits at once in a READ COMMITTED transaction
		reqs := []ratelimit.Request{{Name: "restart_cap", Key: key, Count: 1}, {Name: "restart_shard", Key: key, Count: float64(1 + rng.IntN(2))}}
		var res ratelimit.ManyResult
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			var err error
			res, err = r.lim.LimitMany(ctx, tx, reqs, nil)
			checkClosed(res.OK, err, "LimitMany")
			return err
		})
		call.ok = res.OK
		for _, q := range reqs {
			r.ack(q.Name, key, q.Count, res.OK, err)
		}
		return err

	case 2: // reserve and schedule
		count := float64(1 + rng.IntN(3))
		var res *scheduler.Reservation
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			var err error
			res, err = r.sched.ReserveTx(ctx, tx, "restart_reserve", key, count,
				soakJobArgs{Reserved: []soakReserved{{Name: "restart_reserve", Key: key, Tokens: count}}}, nil)
			if err != nil && res != nil {
				r.failf("ReserveTx returned a reservation with error %v", err)
			}
			if ratelimit.IsLimited(err) {
				return nil // a denial: nothing was written
			}
			return err
		})
		call.ok = res != nil
		r.ack("restart_reserve", key, count, res != nil, err)
		return err

	case 3: // a SERIALIZABLE transaction
		count := float64(1 + rng.IntN(2))
		var res ratelimit.Result
		err := ratelimit.InSerializableTx(ctx, r.pool, nil, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			res, err = r.lim.LimitN(ctx, tx, "restart_shard", key, count, nil)
			checkClosed(res.OK, err, "LimitN in a SERIALIZABLE transaction")
			return err
		})
		call.ok = res.OK
		r.ack("restart_shard", key, count, res.OK, err)
		return err

	default: // the limit that is exhausted early and must stay exhausted
		res, err := r.lim.Limit(ctx, r.pool, "restart_tight", restartTightKey, nil)
		checkClosed(res.OK, err, "Limit on the pool")
		call.ok = res.OK
		r.ack("restart_tight", restartTightKey, 1, res.OK, err)
		return err
	}
}

// verify checks, for every limit and key, with consumed = capacity − value at the frozen clock:
//   - acknowledged ≤ consumed: no grant acknowledged as committed was lost to a stop or a crash;
//   - consumed ≤ acknowledged + the tokens of failed calls: nothing was consumed that no call asked
//     for (a failed call may or may not have committed);
//   - consumed ≤ capacity + MaxReserved: the limit never granted more than it holds;
//   - the reservations' jobs hold exactly the tokens consumed by reservations.
func (r *restartRun) verify(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	jobTokens := map[string]float64{}
	rows, err := r.pool.Query(ctx, `SELECT x->>'key', sum((x->>'tokens')::float8)
		FROM river_job, jsonb_array_elements(args->'reserved') AS x WHERE kind = $1 GROUP BY 1`, soakJobArgs{}.Kind())
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	for rows.Next() {
		var key string
		var tokens float64
		if err := rows.Scan(&key, &tokens); err != nil {
			t.Fatalf("verify: %v", err)
		}
		jobTokens[key] = tokens
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("verify: %v", err)
	}
	names := make([]string, 0, len(restartLimits))
	for name := range restartLimits {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		cfg := restartLimits[name]
		var keys []string
		if name == "restart_tight" {
			keys = []string{restartTightKey}
		} else {
			for phase := range r.phase.Load() + 1 {
				keys = append(keys, "p"+strconv.FormatInt(phase, 10))
			}
		}
		for _, key := range keys {
			st, err := r.lim.State(ctx, r.pool, name, key, nil)
			if err != nil {
				t.Fatalf("verify: Value(%s/%s): %v", name, key, err)
			}
			consumed := cfg.Capacity - st.Value
			acked, maybe := r.acked[[2]string{name, key}], r.maybe[[2]string{name, key}]
			t.Logf("%-15s %-3s capacity %7g: consumed %5g, acknowledged %5g, asked for by failed calls %5g",
				name, key, cfg.Capacity, consumed, acked, maybe)
			if acked > consumed {
				r.failf("%s/%s: %g tokens granted and acknowledged as committed, but only %g consumed: a commit was lost", name, key, acked, consumed)
			}
			if consumed > acked+maybe {
				r.failf("%s/%s: %g tokens consumed, more than granted (%g) plus asked for by failed calls (%g)", name, key, consumed, acked, maybe)
			}
			if consumed > cfg.Capacity+cfg.MaxReserved {
				r.failf("%s/%s: %g tokens consumed, more than the limit holds (%g + MaxReserved %g)", name, key, consumed, cfg.Capacity, cfg.MaxReserved)
			}
			if name == "restart_reserve" && jobTokens[key] != consumed {
				r.failf("%s/%s: %g tokens reserved, but the jobs hold %g", name, key, consumed, jobTokens[key])
			}
			if acked == 0 {
				r.failf("%s/%s: nothing was granted: the test did not exercise the limit", name, key)
			}
		}
	}
	if len(r.calls) == 0 {
		r.failf("no calls were made")
	}
}
