package main

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestHaltPoll(t *testing.T) {
	root := t.TempDir()
	put := func(path, content string) {
		t.Helper()
		full := filepath.Join(root, path)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got := haltPoll(root); got != "" {
		t.Fatalf("no sysfs: haltPoll = %q, want empty", got)
	}
	put("sys/devices/system/cpu/cpuidle/current_driver", "acpi_idle\n")
	put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "0\n")
	if got := haltPoll(root); got != "" {
		t.Fatalf("another cpuidle driver: haltPoll = %q, want empty", got)
	}
	put("sys/devices/system/cpu/cpuidle/current_driver", "haltpoll\n")
	if err := os.Remove(filepath.Join(root, "sys/module/haltpoll/parameters/guest_halt_poll_ns")); err != nil {
		t.Fatal(err)
	}
	if got := haltPoll(root); got != "" {
		t.Fatalf("haltpoll driver without its parameter: haltPoll = %q, want empty", got)
	}
	put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "0\n")
	if got, want := haltPoll(root), "; guest halt polling off (haltpoll guest_halt_poll_ns=0): an idle CPU halts at once"; got != want {
		t.Fatalf("off: haltPoll = %q, want %q", got, want)
	}
	put("sys/module/haltpoll/parameters/guest_halt_poll_ns", "200000\n")
	if got, want := haltPoll(root), "; guest halt polling up to 200000 ns (haltpoll guest_halt_poll_ns)"; got != want {
		t.Fatalf("on: haltPoll = %q, want %q", got, want)
	}
}

// readmeReport is a report with the 64-caller cells of the README's contenders and of one other,
// Redis Lua's throughput 100,000/s in every cell, the Batcher's 77,000/s on the hot key.
func readmeReport(t *testing.T, command string) *Report {
	t.Helper()
	rep := &Report{Command: command, Defs: Defs()}
	perSecond := map[string]float64{"txlimit": 2462, "txlimit-batched": 77000, "txlimit-ser": 696, "redis-lua": 100000, "floor": 2893, "naive-ser": 736}
	for id, n := range perSecond {
		d := findDef(rep.Defs, id)
		if d == nil {
			t.Fatalf("no contender %q", id)
		}
		for _, sc := range []Scenario{HotKey, PerUser} {
			for _, lim := range []Limit{limitAllow, limitDeny} {
				decided := n
				if id == "txlimit-batched" && sc == PerUser {
					decided = 42873
				}
				rep.Results = append(rep.Results, &Result{Def: d, Cell: Cell{sc, lim, 64}, Counts: Counts{Decisions: int64(decided)}, Elapsed: time.Second})
			}
		}
	}
	return rep
}

func TestReadmeTable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ command, says string }{
		{"cd bench && go run . -quick", "from the run of `make bench` that wrote"},
		{"cd bench && go run .", "from the run of `make bench-full` that wrote"},
		{"cd bench && go run . -quick -lanes 2", "from the run of `cd bench && go run . -quick -lanes 2` that wrote"},
	} {
		rep := readmeReport(t, tc.command)
		got := rep.ReadmeTable()
		want := `| contender | hot key, allow-heavy | hot key, deny-heavy | per user, allow-heavy | per user, deny-heavy |
|---|--:|--:|--:|--:|
| txlimit batched (pool) | 77,000 (0.77×) | 77,000 (0.77×) | 42,873 (0.43×) | 42,873 (0.43×) |
| txlimit (pool) | 2,462 (0.025×) | 2,462 (0.025×) | 2,462 (0.025×) | 2,462 (0.025×) |
| txlimit in SERIALIZABLE tx | 696 (0.007×) | 696 (0.007×) | 696 (0.007×) | 696 (0.007×) |
| Redis Lua (EVALSHA) | 100,000 | 100,000 | 100,000 | 100,000 |
| floor: UPDATE … RETURNING | 2,893 | 2,893 | 2,893 | 2,893 |
`
		if !strings.HasSuffix(got, "\n\n"+want) {
			t.Fatalf("%s: ReadmeTable's table:\n%s\nwant:\n%s", tc.command, got, want)
		}
		if !strings.Contains(strings.ReplaceAll(got, "\n", " "), tc.says) || !strings.Contains(got, "[docs/bench.md](docs/bench.md)") {
			caption, _, _ := strings.Cut(got, "\n\n")
			t.Fatalf("%s: ReadmeTable's caption %q: want it to say %q and link docs/bench.md", tc.command, caption, tc.says)
		}
		// Every row is the report's own, so the README quotes docs/bench.md.
		md := rep.Markdown()
		for _, row := range strings.Split(strings.TrimSpace(want), "\n")[2:] {
			if !strings.Contains(md, "\n"+row+"\n") {
				t.Fatalf("%s: the README's row %q is not a row of the report", tc.command, row)
			}
		}
		if strings.Contains(got, "UTC") {
			t.Fatalf("%s: ReadmeTable is dated: %q", tc.command, got)
		}
	}
}

func TestReadmeTableOfAPartialRun(t *testing.T) {
	t.Parallel()
	rep := readmeReport(t, "cd bench && go run . -quick -contenders txlimit")
	rep.Results = slices.DeleteFunc(rep.Results, func(r *Result) bool { return r.Def.ID != "txlimit" })
	got := rep.ReadmeTable()
	for step, row := range []string{
		"| txlimit batched (pool) | — | — | — | — |",
		"| txlimit (pool) | 2,462 | 2,462 | 2,462 | 2,462 |",
		"| Redis Lua (EVALSHA) | — | — | — | — |",
	} {
		if !strings.Contains(got, "\n"+row+"\n") {
			t.Fatalf("step %d: got\n%s\nwant the row %q", step, got, row)
		}
	}
}

func TestSpliceReadme(t *testing.T) {
	t.Parallel()
	const table = "caption\n\n| a |\n|---|\n| 1 |\n"
	for i, tc := range []struct{ readme, want string }{
		{"# r\n\n<!-- bench:begin -->\nold\n\nrows\n<!-- bench:end -->\n\nafter\n", "# r\n\n<!-- bench:begin -->\ncaption\n\n| a |\n|---|\n| 1 |\n<!-- bench:end -->\n\nafter\n"},
		{"<!-- bench:begin -->\n<!-- bench:end -->", "<!-- bench:begin -->\ncaption\n\n| a |\n|---|\n| 1 |\n<!-- bench:end -->"},
		{"no markers\n", ""},
		{"<!-- bench:begin -->\nonly the begin\n", ""},
		{"<!-- bench:end -->\n<!-- bench:begin -->\n", ""},
		{"<!-- bench:begin -->\nx\n<!-- bench:end -->\n<!-- bench:begin -->\ny\n<!-- bench:end -->\n", ""},
		{"text <!-- bench:begin --> x <!-- bench:end -->\n", ""},
	} {
		got, err := spliceReadme(tc.readme, table)
		if tc.want == "" {
			if err == nil {
				t.Fatalf("step %d: got %q, want an error", i, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Fatalf("step %d: got %q, %v; want %q", i, got, err, tc.want)
		}
		if again, err := spliceReadme(got, table); err != nil || again != got {
			t.Fatalf("step %d: splicing twice: got %q, %v; want %q", i, again, err, got)
		}
	}
}

func TestWriteReadme(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "README.md")
	rep := readmeReport(t, "cd bench && go run . -quick")
	if err := rep.writeReadme(path); err == nil || !strings.Contains(err.Error(), "-readme ''") {
		t.Fatalf("no README: got %v, want an error saying how to leave it alone", err)
	}
	if err := os.WriteFile(path, []byte("# txlimit\n\nno markers\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkReadme(path); err == nil || !strings.Contains(err.Error(), "-readme ''") {
		t.Fatalf("no markers: checkReadme got %v, want an error saying how to leave the README alone", err)
	}
	if err := os.WriteFile(path, []byte("# txlimit\n\n## Performance\n\n<!-- bench:begin -->\n<!-- bench:end -->\n\nMore.\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkReadme(path); err != nil {
		t.Fatal(err)
	}
	if err := rep.writeReadme(path); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := "# txlimit\n\n## Performance\n\n<!-- bench:begin -->\n" + rep.ReadmeTable() + "<!-- bench:end -->\n\nMore.\n"; string(got) != want {
		t.Fatalf("got:\n%s\nwant:\n%s", got, want)
	}
}

// The README's performance table and docs/bench.md come from the same run: every row of the one is
// a row of the other.
func TestReadmeQuotesBenchMd(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	bench, err := os.ReadFile(filepath.Join("..", "docs", "bench.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok1 := strings.Cut(string(readme), readmeBegin+"\n")
	table, _, ok2 := strings.Cut(rest, readmeEnd)
	if !ok1 || !ok2 {
		t.Fatalf("README.md has no performance table between %s and %s", readmeBegin, readmeEnd)
	}
	rows := 0
	for row := range strings.SplitSeq(table, "\n") {
		if !strings.HasPrefix(row, "| ") || strings.HasPrefix(row, "| contender |") {
			continue
		}
		rows++
		if !strings.Contains(string(bench), "\n"+row+"\n") {
			t.Fatalf("README.md's performance row %q is not in docs/bench.md: both come from one run of make bench (rerun it, or copy the rows)", row)
		}
	}
	if rows != len(readmeIDs) {
		t.Fatalf("README.md's performance table has %d rows, want %d (readmeIDs)", rows, len(readmeIDs))
	}
}

// TestWarmUps: the warm-up gives each key of a cell 2·Shards decisions when a contender of the run
// is sharded and, on the deny-heavy limit, at least its burst (10), which empties a bucket that
// starts full, whichever contenders run: the report calls that mix one where nearly every decision
// is denied. Without it, a run of unsharded contenders alone (-contenders txlimit, say) started each
// deny-heavy key with 9 tokens, and at 64 callers per user a quick cell granted most decisions.
func TestWarmUps(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		shards int
		cell   Cell
		want   int
	}{
		// Unsharded, deny-heavy: the burst per key.
		{0, Cell{PerUser, limitDeny, 64}, 10}, {1, Cell{PerUser, limitDeny, 1}, 10}, {0, Cell{HotKey, limitDeny, 1}, 10},
		{0, Cell{HotKey, limitDeny, 4}, 3}, {0, Cell{HotKey, limitDeny, 64}, 1},
		// Unsharded, allow-heavy: one per caller.
		{0, Cell{PerUser, limitAllow, 64}, 1}, {0, Cell{HotKey, limitAllow, 1}, 1},
		// Sharded: 2·Shards per key, also on the deny-heavy limit.
		{16, Cell{PerUser, limitDeny, 64}, 32}, {16, Cell{PerUser, limitAllow, 16}, 32}, {16, Cell{HotKey, limitAllow, 16}, 2},
		{16, Cell{HotKey, limitAllow, 64}, 1}, {64, Cell{HotKey, limitDeny, 16}, 8},
	} {
		if got := warmUps(tc.shards, tc.cell); got != tc.want {
			t.Errorf("warmUps(%d, %s %s, %d callers) = %d, want %d", tc.shards, tc.cell.Scenario, tc.cell.Mix(), tc.cell.Callers, got, tc.want)
		}
	}
}

// A cell's contenders take turns, slice by slice (Mode.Rounds): forwards, then backwards.
func TestCellOrder(t *testing.T) {
	a, b, c := &Def{ID: "a"}, &Def{ID: "b"}, &Def{ID: "c"}
	defs := []*Def{a, b, c}
	if got := cellOrder(defs, 0); !slices.Equal(got, defs) {
		t.Fatalf("round 0: %v", got)
	}
	if got := cellOrder(defs, 1); !slices.Equal(got, []*Def{c, b, a}) {
		t.Fatalf("round 1: %v", got)
	}
	if !slices.Equal(defs, []*Def{a, b, c}) {
		t.Fatal("cellOrder reordered the cell's own list")
	}
}

// A contender's slices of one cell add up to one result: counts, times, round trips, WAL and CPU
// summed, percentiles over both slices' latencies; a figure one slice did not measure is not
// measured in the sum.
func TestResultAdd(t *testing.T) {
	slice := func(decisions int64, lat time.Duration, trips, wal int64, cpu CPUUse) *Result {
		r := &Result{Counts: Counts{Decisions: decisions, Allowed: decisions / 2, Retries: 1}, Elapsed: time.Second, Wall: 2 * time.Second,
			Trips: trips, WAL: wal, CPU: cpu}
		for range decisions {
			r.hist.add(lat)
		}
		r.P50, r.P99 = r.hist.quantile(0.5), r.hist.quantile(0.99)
		return r
	}
	r := slice(300, time.Millisecond, 300, 3000, CPUUse{OK: true, Self: 1, Server: 2, Idle: 0.5})
	r.Add(slice(100, time.Second, 200, 1000, CPUUse{OK: true, Self: 3, Server: 4, Idle: 0.25}))
	if r.Decisions != 400 || r.Allowed != 200 || r.Retries != 2 || r.Elapsed != 2*time.Second || r.Wall != 4*time.Second ||
		r.Trips != 500 || r.WAL != 4000 || r.CPU != (CPUUse{OK: true, Self: 4, Server: 6, Idle: 0.75}) {
		t.Fatalf("sum: %+v", r)
	}
	if r.PerSecond() != 200 {
		t.Fatalf("PerSecond %v, want 200", r.PerSecond())
	}
	if r.P50 != time.Duration(bucketMid(bucketOf(uint64(time.Millisecond)))) || r.P99 != time.Duration(bucketMid(bucketOf(uint64(time.Second)))) {
		t.Fatalf("p50 %v, p99 %v: want those of 300 decisions of 1ms and 100 of 1s together", r.P50, r.P99)
	}
	r.Add(slice(1, time.Millisecond, -1, 10, CPUUse{OK: true, Self: 1, Server: -1}))
	if r.Trips != -1 || r.WAL != 4010 || r.CPU.Server != -1 || !r.CPU.OK {
		t.Fatalf("a slice without round trips or server CPU: %+v", r)
	}
	r.Add(slice(1, time.Millisecond, 1, 10, CPUUse{}))
	if r.CPU.OK {
		t.Fatalf("a slice without CPU: %+v", r.CPU)
	}
	// Failures and abandoned calls add up too; the first error is the first slice's that had one.
	first, second := errors.New("first"), errors.New("second")
	for i, err := range []error{nil, first, second} {
		s := slice(1, time.Millisecond, 1, 10, CPUUse{})
		s.Errors, s.Abandoned, s.FirstErr = int64(i), 2, err
		r.Add(s)
	}
	if r.Errors != 3 || r.Abandoned != 6 || r.FirstErr != first {
		t.Fatalf("errors %d, abandoned %d, first %v: want 3, 6, %v", r.Errors, r.Abandoned, r.FirstErr, first)
	}
}

// Over a mode's Rounds, cellOrder gives every contender of a cell the same mean place in the
// cell's sequence of slices, so that a machine that speeds up or slows down steadily while the
// cell runs favours none: forwards then backwards balances only in pairs of rounds.
func TestCellOrderBalancesEveryMode(t *testing.T) {
	for _, mode := range []Mode{quickMode, fullMode} {
		for n := 2; n <= len(contenders); n++ {
			defs := Defs()[:n]
			place := map[*Def]int{}
			for round := range mode.Rounds {
				for i, d := range cellOrder(defs, round) {
					place[d] += round*n + i
				}
			}
			for _, d := range defs[1:] {
				if place[d] != place[defs[0]] {
					t.Fatalf("%s mode, %d rounds, %d contenders: %s's slices sit at places summing to %d, %s's to %d",
						mode.Name, mode.Rounds, n, defs[0].ID, place[defs[0]], d.ID, place[d])
				}
			}
		}
	}
}
