package main

import (
	"os"
	"os/exec"
	"runtime"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// A name with spaces and parentheses; every field a different number: ppid 77, utime 250,
	// stime 50, cutime 30, cstime 20 ticks.
	line := "4242 (my (odd) name) S 77 4242 4243 0 -1 4194560 100 5 6 7 250 50 30 20 20 0 1 0 100 1000 10\n"
	p, ok := parseStat(line)
	want := procStat{comm: "my (odd) name", ppid: 77, own: 3, kids: 0.5}
	if !ok || p != want {
		t.Fatalf("parseStat = %+v, %v; want %+v, true", p, ok, want)
	}
	for _, bad := range []string{"", "4242 no parentheses", "4242 (short) S 1 2 3", "4242 (x) S 1 2 3 4 5 6 7 8 9 10 11 twelve 13 14 15"} {
		if _, ok := parseStat(bad); ok {
			t.Errorf("parseStat(%q) accepted a malformed line", bad)
		}
	}
}

func TestParseIdle(t *testing.T) {
	// user nice system idle iowait irq ...: idle 700 and iowait 50 ticks.
	idle, ok := parseIdle("cpu  100 200 300 700 50 60 70 80 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
	if !ok || idle != 7.5 {
		t.Fatalf("parseIdle = %v, %v; want 7.5, true", idle, ok)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4 5 6\n", "cpu 1 2 3\n", "cpu 1 2 3 x 5 6\n"} {
		if _, ok := parseIdle(bad); ok {
			t.Errorf("parseIdle(%q) accepted a malformed line", bad)
		}
	}
}

func TestCPUSince(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the CPU figures come from Linux's /proc")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc:", err)
	}
	// A server of one process, this test's parent (the go command, or whatever ran the test), and
	// one named nowhere.
	roots := map[string]int{"parent": os.Getppid(), "gone": 1 << 30}
	before := readCPU(roots)
	if !before.ok {
		t.Fatal("readCPU could not read /proc")
	}
	// Burn CPU until at least 3 ticks show, within a bound far above what that takes.
	x := 0
	var u CPUUse
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
		for i := range 1_000_000 {
			x += i & 7
		}
		if u = cpuSince(before, roots, ""); u.Self >= 3.0/clockTicks {
			break
		}
	}
	if !u.OK || u.Self < 3.0/clockTicks || u.Server != 0 || u.Idle < 0 {
		t.Fatalf("cpuSince = %+v (x %d): want this process's CPU seen, no server, idle >= 0", u, x)
	}
	if got := cpuSince(before, roots, "gone"); got.Server != -1 {
		t.Errorf("Server of a server not found = %v, want -1", got.Server)
	}
	if got := cpuSince(before, roots, "parent"); got.Server < 0 {
		t.Errorf("Server of a running process = %v, want >= 0", got.Server)
	}
}

// TestCPUSinceCountsChildrenThatExit: a child of the server that burns CPU and exits during the
// measurement still counts, through its parent's reaped-children time.
func TestCPUSinceCountsChildrenThatExit(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the CPU figures come from Linux's /proc")
	}
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh:", err)
	}
	// This test process is the "server"; its child burns about 0.2 s of CPU and exits.
	roots := map[string]int{"self": os.Getpid()}
	before := readCPU(roots)
	if !before.ok {
		t.Fatal("readCPU could not read /proc")
	}
	cmd := exec.Command(sh, "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	child := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	if child < 30*time.Millisecond {
		t.Skipf("the child used only %s of CPU: too little to see in 10 ms ticks", child)
	}
	got := cpuSince(before, roots, "self")
	// The server's figure is this process's own time plus its reaped child's; the child's alone
	// must show (to within two ticks).
	if got.Server-got.Self < child.Seconds()-2.0/clockTicks {
		t.Fatalf("server CPU %.3fs (this process %.3fs) misses the exited child's %s", got.Server, got.Self, child)
	}
}

func TestColumns(t *testing.T) {
	u := CPUUse{OK: true, Self: 0.5, Server: 0.05, Idle: 1.5}
	for _, c := range []struct {
		u               CPUUse
		ops             int64
		wall            float64
		server          bool
		self, srv, idle string
	}{
		{u, 10_000, 2, true, "50", "5.0", "0.75"},
		{u, 10_000, 2, false, "50", "—", "0.75"},
		{CPUUse{OK: true, Self: 0.5, Server: -1, Idle: 1}, 10_000, 2, true, "50", "—", "0.50"},
		{CPUUse{OK: true, Self: 0.09995, Idle: -0.1}, 10_000, 2, false, "10", "—", "0.00"},
		{CPUUse{}, 10_000, 2, true, "—", "—", "—"},
		{u, 0, 2, true, "—", "—", "—"},
		{u, 10_000, 0, true, "—", "—", "—"},
	} {
		self, srv, idle := c.u.columns(c.ops, c.wall, c.server)
		if self != c.self || srv != c.srv || idle != c.idle {
			t.Errorf("%+v.columns(%d, %v, %v) = %q, %q, %q; want %q, %q, %q",
				c.u, c.ops, c.wall, c.server, self, srv, idle, c.self, c.srv, c.idle)
		}
	}
}
