// Command bench measures txlimit side by side with a Redis Lua token bucket, a naive SERIALIZABLE
// read-modify-write in Postgres (and, in the over-grant test only, the same at READ COMMITTED) and
// golang.org/x/time/rate in memory, in one run on one machine, and
// writes docs/bench.md, docs/bench.svg and the README's performance table (its figures at 64 callers,
// between <!-- bench:begin --> and <!-- bench:end -->).
//
//	cd bench && go run . -quick   # make bench: under 2 minutes
//	cd bench && go run .          # make bench-full: under 15 minutes
//
// Postgres: BENCH_DATABASE_URL, else TEST_DATABASE_URL, else
// postgres://postgres@localhost:5432/test?sslmode=disable when it answers, else a container when a
// Docker daemon answers, else a private throwaway cluster (internal/devdb), whose fsync is off: a run
// on one refuses to rewrite the README's table and docs/bench.md. The run creates schema txlimit_bench,
// migrates it and drops it at the end. Redis: BENCH_REDIS_ADDR, else 127.0.0.1:6379; when it does not
// answer, the Redis contender is skipped. The contenders are one table, contenders (contenders.go).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/txlimit/txlimit/internal/devdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Mode is a set of durations.
type Mode struct {
	Name string
	// Cell is how long each contender's callers decide in a throughput cell, after the warm-ups:
	// the sum of its Rounds slices.
	Cell time.Duration
	// Rounds is how many slices of Cell/Rounds each contender of a throughput cell runs, the
	// contenders taking turns (cellOrder), so that a slower or faster moment of the machine falls
	// on all of them alike rather than on whichever ran then. It is even: forwards then backwards
	// balances a steady drift of the machine's speed only over pairs of rounds (with 3, the first
	// contender's slices sit earlier on average than the last one's).
	Rounds int
	// Shard is how long each run of the 1-vs-16-shards SERIALIZABLE comparison lasts.
	Shard time.Duration
	// OverGrant is the over-grant test's window: 3 s in every mode.
	OverGrant time.Duration
	// Paired is how many rounds the side-by-side latency comparison runs per limit.
	Paired int
}

var (
	quickMode = Mode{Name: "quick", Cell: 500 * time.Millisecond, Rounds: 2, Shard: 2 * time.Second, OverGrant: 3 * time.Second, Paired: 1000}
	fullMode  = Mode{Name: "full", Cell: 3 * time.Second, Rounds: 4, Shard: 10 * time.Second, OverGrant: 3 * time.Second, Paired: 5000}
)

// Bounds that keep every loop finite whatever the speed of the contender.
const (
	maxPerCaller = 20_000_000
	// overGrantCallers is the over-grant test's number of callers (64).
	overGrantCallers = 64
)

var callerCounts = []int{1, 16, 64}

func main() {
	quick := flag.Bool("quick", false, "quick mode (make bench): shorter cells, under 2 minutes")
	mdPath := flag.String("md", filepath.Join("..", "docs", "bench.md"), "markdown report to write")
	svgPath := flag.String("svg", filepath.Join("..", "docs", "bench.svg"), "picture to write")
	only := flag.String("contenders", "", "comma-separated contender IDs to run (default: all)")
	cell := flag.Duration("cell", 0, "override the duration of each throughput cell")
	lanes := flag.Int("lanes", 0, "BatcherConfig.Lanes of every Batcher of the run (0: the default)")
	readmePath := flag.String("readme", filepath.Join("..", "README.md"), "README whose performance table (between <!-- bench:begin --> and <!-- bench:end -->) to rewrite; \"\" for none, and none by default when -md is given")
	cpuProfile := flag.String("cpuprofile", "", "write a Go CPU profile of the whole run (this process only) to the file")
	flag.Parse()
	given := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if given["md"] && !given["readme"] {
		*readmePath = "" // a report written elsewhere leaves the README's table, which is docs/bench.md's, alone
	}

	mode := fullMode
	if *quick {
		mode = quickMode
	}
	if *cell > 0 {
		mode.Cell = *cell
		mode.Name += fmt.Sprintf(", cells of %s", *cell)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: -cpuprofile:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The command line as given, for the report (the flags that change what is measured).
	command := "cd bench && go run ."
	if *quick {
		command += " -quick"
	}
	if *cell > 0 {
		command += " -cell " + cell.String()
	}
	if *only != "" {
		command += " -contenders " + *only
	}
	if *lanes != 0 {
		command += fmt.Sprintf(" -lanes %d", *lanes)
	}
	if err := run(ctx, mode, command, *only, *lanes, *mdPath, *svgPath, *readmePath); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// Report is everything a run measured.
type Report struct {
	Mode      Mode
	Command   string
	Started   time.Time
	WallTime  time.Duration
	Machine   []string
	Defs      []*Def
	Skipped   map[string]string // contender ID -> why
	Results   []*Result
	Paired    []*Paired // the side-by-side latency comparison at 1 caller (paired.go)
	Shards    []*Result // the shard comparison under SERIALIZABLE: 1, 4, 16 and 64 shards
	OverGrant []*OverGrant
	PredLocks string        // what predicateLocks found
	HTTP      []*HTTPResult // the HTTP cell (http.go)
}

func run(ctx context.Context, mode Mode, command, only string, lanes int, mdPath, svgPath, readmePath string) error {
	if readmePath != "" {
		if err := checkReadme(readmePath); err != nil { // now, not after minutes of measuring
			return err
		}
	}
	rep := &Report{Mode: mode, Command: command, Started: time.Now(), Skipped: map[string]string{}}
	env, closeEnv, err := OpenEnv(ctx, EnvOpts{Schema: "txlimit_bench"})
	if err != nil {
		return err
	}
	defer closeEnv()
	if env.PGThrowaway && readmePath != "" {
		return errors.New("bench: no Postgres answered (BENCH_DATABASE_URL, TEST_DATABASE_URL, " + devdb.LocalURL +
			"), so the run found a private throwaway cluster, which runs with fsync off: its figures are not comparable " +
			"with a real server's, and this run would rewrite the README's table and docs/bench.md with them. Set " +
			"BENCH_DATABASE_URL to a real server, or give -md and -svg paths elsewhere to measure anyway")
	}
	env.ServerPIDs = findServerPIDs(ctx, env)
	if lanes != 0 {
		env.Batcher = &ratelimit.BatcherConfig{Lanes: lanes}
	}
	rep.Machine = machine(ctx, env)

	var wanted []string
	if only != "" {
		wanted = strings.Split(only, ",")
	}
	contenders := map[string]Contender{}
	for _, def := range Defs() {
		if wanted != nil && !slices.Contains(wanted, def.ID) {
			continue
		}
		c, err := def.New(ctx, env)
		var skip *SkipError
		switch {
		case errors.As(err, &skip):
			rep.Skipped[def.ID] = skip.Reason
			fmt.Fprintf(os.Stderr, "SKIP %s: %s\n", def.Name, skip.Reason)
			continue
		case err != nil:
			return fmt.Errorf("%s: %w", def.Name, err)
		}
		defer c.Close()
		contenders[def.ID] = c
		rep.Defs = append(rep.Defs, def)
	}
	if len(rep.Defs) == 0 && !slices.Contains(wanted, "http") {
		return errors.New("no contender to run")
	}

	var cells []Cell
	for _, lim := range []Limit{limitAllow, limitDeny} {
		for _, sc := range []Scenario{HotKey, PerUser} {
			for _, n := range callerCounts {
				cells = append(cells, Cell{Scenario: sc, Limit: lim, Callers: n})
			}
		}
	}
	cellDefs := rep.cellDefs()
	total, done := len(cells)*len(cellDefs), 0
	warmShards := 0 // every contender of a cell warms up as the most sharded one must (warmUps)
	for _, def := range cellDefs {
		warmShards = max(warmShards, def.Shards)
	}
	for ci, cell := range cells {
		results := map[*Def]*Result{}
		for round := range mode.Rounds {
			for _, def := range cellOrder(cellDefs, round) {
				if err := ctx.Err(); err != nil {
					return err
				}
				r := RunCell(ctx, env, def, contenders[def.ID], cell, RunOpts{
					Duration: mode.Cell / time.Duration(mode.Rounds), MaxPerCaller: maxPerCaller,
					Tag: fmt.Sprintf("c%d-%s", ci, def.ID), WarmShards: warmShards, Again: round > 0,
				})
				if results[def] == nil {
					results[def] = r
				} else {
					results[def].Add(r)
				}
			}
		}
		for _, def := range cellDefs {
			done++
			rep.Results = append(rep.Results, results[def])
			progress(fmt.Sprintf("[%d/%d]", done, total), results[def])
		}
	}

	// The side-by-side latency comparison at 1 caller, of whichever of its contenders run.
	var paired []*Def
	for _, id := range pairedIDs {
		if def := findDef(rep.Defs, id); def != nil {
			paired = append(paired, def)
		}
	}
	if len(paired) > 1 {
		for _, lim := range []Limit{limitAllow, limitDeny} {
			ps := RunPaired(ctx, paired, contenders, lim, mode.Paired)
			rep.Paired = append(rep.Paired, ps...)
			for _, p := range ps {
				fmt.Fprintf(os.Stderr, "[paired] %-12s %-38s p50 %s (%d decisions)\n", lim.Name, p.Def.Name, fmtDur(p.P50), p.N)
			}
		}
	}

	// One hot limit, 64 callers, each decision in its own SERIALIZABLE transaction, over 1, 4, 16
	// and 64 shards.
	for i, id := range []string{"txlimit-ser", "txlimit-4-ser", "txlimit-16-ser", "txlimit-64-ser"} {
		def := findDef(rep.Defs, id)
		if def == nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		cell := Cell{Scenario: HotKey, Limit: limitAllow, Callers: 64}
		r := RunCell(ctx, env, def, contenders[id], cell, RunOpts{
			Duration: mode.Shard, MaxPerCaller: maxPerCaller, Tag: fmt.Sprintf("shards%d", i),
		})
		rep.Shards = append(rep.Shards, r)
		progress("[shards]", r)
	}

	if len(rep.Shards) > 0 {
		if msg, err := predicateLocks(ctx, env); err != nil {
			rep.PredLocks = "predicate-lock probe failed: " + err.Error()
		} else {
			rep.PredLocks = msg
		}
		fmt.Fprintln(os.Stderr, "[shards]", rep.PredLocks)
	}

	for _, def := range rep.overGrantDefs() {
		if err := ctx.Err(); err != nil {
			return err
		}
		o := RunOverGrant(ctx, contenders[def.ID], def, limitOverGrant, "overgrant/"+def.ID, overGrantCallers, mode.OverGrant)
		rep.OverGrant = append(rep.OverGrant, o)
		fmt.Fprintf(os.Stderr, "[over-grant] %-38s decisions %7d allowed %3d max %3d (span %s) errors %d\n",
			def.Name, o.Decisions, o.Allowed, o.Max, o.Span.Round(time.Millisecond), o.Errors)
	}

	if wanted == nil || slices.Contains(wanted, "http") {
		if rep.HTTP, err = RunHTTP(ctx, env, max(mode.Cell, time.Second)); err != nil {
			return fmt.Errorf("http cell: %w", err)
		}
	}

	rep.WallTime = time.Since(rep.Started)
	for _, p := range []string{mdPath, svgPath} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(mdPath, []byte(rep.Markdown()+httpMarkdown(rep.HTTP)), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(svgPath, []byte(rep.SVG()), 0o644); err != nil {
		return err
	}
	if readmePath != "" {
		if err := rep.writeReadme(readmePath); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "wrote the performance table of %s\n", readmePath)
	}
	fmt.Fprintf(os.Stderr, "wrote %s and %s in %s\n", mdPath, svgPath, rep.WallTime.Round(time.Second))
	return nil
}

// cellOrder is the order the contenders of a cell run in, in its round-th round (from 0): as
// listed in even rounds, backwards in odd ones, so that over two rounds each contender's slices
// sit, on average, at the middle of the cell's time, and a machine that speeds up or slows down
// steadily while the cell runs favours none.
func cellOrder(defs []*Def, round int) []*Def {
	if round%2 == 0 {
		return defs
	}
	r := slices.Clone(defs)
	slices.Reverse(r)
	return r
}

func findDef(defs []*Def, id string) *Def {
	for _, d := range defs {
		if d.ID == id {
			return d
		}
	}
	return nil
}

func progress(prefix string, r *Result) {
	line := fmt.Sprintf("%s %-8s %-11s %2d callers  %-38s %10s/s  p50 %8s  p99 %8s",
		prefix, r.Cell.Scenario, r.Cell.Mix(), r.Cell.Callers, r.Def.Name,
		fmtRate(r.PerSecond()), fmtDur(r.P50), fmtDur(r.P99))
	line += fmt.Sprintf("  (%d in %s)", r.Decisions, r.Elapsed.Round(time.Millisecond))
	if r.CPU.OK && r.Decisions > 0 {
		self, srv, idle := r.CPU.columns(r.Decisions, r.Wall.Seconds(), serverOf(r.Def.Family) != "")
		line += fmt.Sprintf("  CPU µs/dec %s + %s, idle %s", self, srv, idle)
	}
	if r.Abandoned > 0 {
		line += fmt.Sprintf("  abandoned %d", r.Abandoned)
	}
	if r.Retries > 0 {
		line += fmt.Sprintf("  retries/dec %.2f", r.perDecision(r.Retries))
	}
	if r.Errors > 0 {
		line += fmt.Sprintf("  errors %d (first: %v)", r.Errors, r.FirstErr)
	}
	fmt.Fprintln(os.Stderr, line)
}
