package main

import (
	"os"
	"runtime"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// A name with spaces and parentheses; utime 250 and stime 50 ticks: 3 seconds.
	line := "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 100 1000 10\n"
	comm, secs, ok := parseStat(line)
	if !ok || comm != "my (odd) name" || secs != 3 {
		t.Fatalf("parseStat = %q, %v, %v; want \"my (odd) name\", 3, true", comm, secs, ok)
	}
	for _, bad := range []string{"", "4242 no parentheses", "4242 (short) S 1 2 3"} {
		if _, _, ok := parseStat(bad); ok {
			t.Errorf("parseStat(%q) accepted a malformed line", bad)
		}
	}
}

func TestCPUSinceSeesThisProcess(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the CPU figures come from Linux's /proc")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc:", err)
	}
	before := readCPU()
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
		if u = cpuSince(before, ""); u.Self >= 3.0/clockTicks {
			break
		}
	}
	if !u.OK || u.Self < 3.0/clockTicks || u.Server != 0 || u.Idle < 0 {
		t.Fatalf("cpuSince = %+v (x %d): want this process's CPU seen, no server, idle >= 0", u, x)
	}
	if got := cpuSince(before, "no-such-server-process"); got.Server != -1 {
		t.Errorf("Server of a server with no process = %v, want -1", got.Server)
	}
}

func TestFmtCPUPer(t *testing.T) {
	for _, c := range []struct {
		secs float64
		ok   bool
		ops  int64
		want string
	}{
		{0.5, true, 10_000, "50"},
		{0.05, true, 10_000, "5.0"},
		{0.5, false, 10_000, "—"},
		{-1, true, 10_000, "—"},
		{0.5, true, 0, "—"},
	} {
		if got := fmtCPUPer(c.secs, c.ok, c.ops); got != c.want {
			t.Errorf("fmtCPUPer(%v, %v, %d) = %q, want %q", c.secs, c.ok, c.ops, got, c.want)
		}
	}
}
