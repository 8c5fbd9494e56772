package main

// CPU accounting: the processor time each side of a measurement used, so that a cell says what a
// decision costs the machine, not only how many were made. Throughput alone hides which side is
// busy: two limiters can cost the same CPU per decision while one leaves CPUs idle, waiting on
// round trips and commits. The figures come from Linux's /proc (each process's user + system
// time, and the machine's idle time), read before and after the timed part of a cell; elsewhere,
// or when the database runs on another machine, they are not measured.

import (
	"os"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of the times in /proc: 100 on every Linux architecture Go
// supports (the kernel keeps it fixed for user space whatever its internal tick).
const clockTicks = 100

// Server process names: what the database server's processes are called in /proc/<pid>/stat.
const (
	commPostgres = "postgres"
	commRedis    = "redis-server"
)

// cpuTimes is one reading: CPU seconds used so far by this process and by each server, and the
// machine's idle seconds (all CPUs together, I/O wait included).
type cpuTimes struct {
	ok     bool
	self   float64
	server map[string]float64 // by process name; a name is present when such a process ran
	idle   float64
}

// readCPU reads the times now. ok is false where /proc cannot be read.
func readCPU() cpuTimes {
	t := cpuTimes{server: map[string]float64{}}
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return t
	}
	line, _, _ := strings.Cut(string(stat), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait ...
	if len(f) < 6 || f[0] != "cpu" {
		return t
	}
	idle, err1 := strconv.ParseFloat(f[4], 64)
	iowait, err2 := strconv.ParseFloat(f[5], 64)
	if err1 != nil || err2 != nil {
		return t
	}
	t.idle = (idle + iowait) / clockTicks
	self := os.Getpid()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return t
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, secs, ok := processCPU(pid)
		if !ok {
			continue // gone meanwhile
		}
		switch {
		case pid == self:
			t.self = secs
		case comm == commPostgres || comm == commRedis:
			t.server[comm] += secs
		}
	}
	t.ok = true
	return t
}

// processCPU returns the name of process pid and the user + system CPU seconds it has used.
func processCPU(pid int) (string, float64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return "", 0, false
	}
	return parseStat(string(b))
}

// parseStat reads the name and the user + system CPU seconds from the text of a /proc/<pid>/stat:
// "pid (comm) state ppid ...", utime and stime being its 14th and 15th fields. comm may hold
// spaces and parentheses, so it ends at the last ")".
func parseStat(s string) (string, float64, bool) {
	l, r := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if l < 0 || r < l {
		return "", 0, false
	}
	f := strings.Fields(s[r+1:]) // from state, the 3rd field: utime is f[11], stime f[12]
	if len(f) < 13 {
		return "", 0, false
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return "", 0, false
	}
	return s[l+1 : r], (ut + st) / clockTicks, true
}

// CPUUse is the CPU a measurement used, in CPU seconds: this process (the callers, the client
// libraries, and in the HTTP cell the HTTP clients and server too), the database server's
// processes (all of them: backends and background workers alike), and the CPUs left idle. OK is
// false when not measured; Server is negative when no process of the server was found (a server
// on another machine).
type CPUUse struct {
	OK                 bool
	Self, Server, Idle float64
}

// cpuSince is the CPU used from before to now by this process and the server named comm ("" for
// none: Server is then 0).
func cpuSince(before cpuTimes, comm string) CPUUse {
	after := readCPU()
	if !before.ok || !after.ok {
		return CPUUse{}
	}
	u := CPUUse{OK: true, Self: after.self - before.self, Idle: after.idle - before.idle}
	if comm != "" {
		a, okA := after.server[comm]
		b := before.server[comm]
		if okA {
			u.Server = a - b
		} else {
			u.Server = -1
		}
	}
	return u
}

// serverComm is the name of the server process a contender of family f decides on: "" for none.
func serverComm(f Family) string {
	switch {
	case f.OnPostgres():
		return commPostgres
	case f == FamilyRedis:
		return commRedis
	}
	return ""
}

// fmtCPUPer formats CPU seconds per operation as microseconds; "—" when not measured.
func fmtCPUPer(secs float64, ok bool, ops int64) string {
	if !ok || secs < 0 || ops <= 0 {
		return "—"
	}
	us := secs * 1e6 / float64(ops)
	if us >= 10 {
		return strconv.FormatFloat(us, 'f', 0, 64)
	}
	return strconv.FormatFloat(us, 'f', 1, 64)
}

// fmtIdle formats idle CPU seconds over a wall time in seconds as a number of CPUs.
func fmtIdle(u CPUUse, wall float64) string {
	if !u.OK || wall <= 0 {
		return "—"
	}
	return strconv.FormatFloat(max(u.Idle, 0)/wall, 'f', 2, 64)
}
