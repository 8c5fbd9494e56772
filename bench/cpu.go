package main

// CPU accounting (bench/README.md, "CPU per decision", says what the figures mean): the processor
// time this process and the database server used during the timed part of a cell, and the
// machine's idle time, read from Linux's /proc before and after it.
//
// The server is found by process ID, not by name, so that another Postgres or Redis on the
// machine is not counted: Postgres is the postmaster whose child serves this run's connection
// (pg_backend_pid), counted with all its children; Redis is the process_id of INFO server. A
// process's own time is lost from /proc when it exits, but the parent that reaps it adds it to
// its children's time, which is counted too: so a backend or worker that ends during a cell still
// counts, and the server's total never goes back.

import (
	"context"
	"os"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of the times in /proc: 100 on every Linux architecture Go
// supports (the kernel keeps it fixed for user space whatever its internal tick). A process's
// times are therefore read in steps of 10 ms.
const clockTicks = 100

// Server names, the keys of Env.ServerPIDs.
const (
	serverPostgres = "postgres"
	serverRedis    = "redis-server"
)

// procStat is what the bench reads from /proc/<pid>/stat.
type procStat struct {
	comm string
	ppid int
	own  float64 // user + system CPU seconds of the process (all its threads)
	kids float64 // user + system CPU seconds of its children that it has reaped
}

// parseStat reads the text of a /proc/<pid>/stat: "pid (comm) state ppid ... utime stime cutime
// cstime ...", ppid its 4th field and the times its 14th to 17th. comm may hold spaces and
// parentheses, so it ends at the last ")".
func parseStat(s string) (procStat, bool) {
	l, r := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if l < 0 || r < l {
		return procStat{}, false
	}
	f := strings.Fields(s[r+1:]) // f[0] is the 3rd field (state)
	if len(f) < 15 {
		return procStat{}, false
	}
	var n [5]float64 // ppid, utime, stime, cutime, cstime
	for i, j := range []int{1, 11, 12, 13, 14} {
		v, err := strconv.ParseFloat(f[j], 64)
		if err != nil {
			return procStat{}, false
		}
		n[i] = v
	}
	return procStat{comm: s[l+1 : r], ppid: int(n[0]), own: (n[1] + n[2]) / clockTicks, kids: (n[3] + n[4]) / clockTicks}, true
}

// readStat reads /proc/<pid>/stat.
func readStat(pid int) (procStat, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	return parseStat(string(b))
}

// parseIdle reads the machine's idle seconds (all CPUs, I/O wait included) from the text of
// /proc/stat, whose first line is "cpu user nice system idle iowait ...".
func parseIdle(s string) (float64, bool) {
	line, _, _ := strings.Cut(s, "\n")
	f := strings.Fields(line)
	if len(f) < 6 || f[0] != "cpu" {
		return 0, false
	}
	idle, err1 := strconv.ParseFloat(f[4], 64)
	iowait, err2 := strconv.ParseFloat(f[5], 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return (idle + iowait) / clockTicks, true
}

// findServerPIDs returns the process IDs of the servers this run uses, as Env.ServerPIDs: the
// postmaster serving env.Pool and Redis's process, each when it runs on this machine.
func findServerPIDs(ctx context.Context, env *Env) map[string]int {
	pids := map[string]int{}
	var backend int
	if err := env.Pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err == nil {
		// A backend's parent is the postmaster; both are named postgres. (A server elsewhere
		// gives a process ID that is not a postgres here.)
		if b, ok := readStat(backend); ok && b.comm == serverPostgres {
			if pm, ok := readStat(b.ppid); ok && pm.comm == serverPostgres {
				pids[serverPostgres] = b.ppid
			}
		}
	}
	if env.Redis != nil {
		if info, err := env.Redis.Info(ctx, "server").Result(); err == nil {
			for l := range strings.SplitSeq(info, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), "process_id:"); ok {
					if pid, err := strconv.Atoi(v); err == nil {
						if p, ok := readStat(pid); ok && p.comm == serverRedis {
							pids[serverRedis] = pid
						}
					}
				}
			}
		}
	}
	return pids
}

// cpuTimes is one reading: CPU seconds used so far by this process and by each server found, and
// the machine's idle seconds.
type cpuTimes struct {
	ok     bool
	self   float64
	server map[string]float64 // by server name; present when the server's process was read
	idle   float64
}

// readCPU reads the times now, the servers being the process trees rooted at roots (by name).
// ok is false where /proc cannot be read.
func readCPU(roots map[string]int) cpuTimes {
	t := cpuTimes{server: map[string]float64{}}
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return t
	}
	if t.idle, t.ok = parseIdle(string(stat)); !t.ok {
		return t
	}
	self, ok := readStat(os.Getpid())
	if !ok {
		t.ok = false
		return t
	}
	t.self = self.own
	if len(roots) == 0 {
		return t
	}
	byRoot := map[int]string{}
	for name, pid := range roots {
		if p, ok := readStat(pid); ok {
			byRoot[pid] = name
			t.server[name] = p.own + p.kids
		}
	}
	if len(byRoot) == 0 {
		return t
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.ok = false
		return t
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if _, isRoot := byRoot[pid]; isRoot {
			continue
		}
		p, ok := readStat(pid)
		if !ok {
			continue // gone meanwhile: its parent has its time now
		}
		if name, ok := byRoot[p.ppid]; ok {
			t.server[name] += p.own + p.kids
		}
	}
	return t
}

// CPUUse is the CPU a measurement used, in CPU seconds: this process (the callers, the client
// libraries, and in the HTTP cell the HTTP clients and server too), the database server (its
// every process), and the CPUs left idle. OK is false when not measured; Server is negative when
// the server was not found on this machine, 0 for a measurement with no server.
type CPUUse struct {
	OK                 bool
	Self, Server, Idle float64
}

// cpuSince is the CPU used from before to now by this process and the server named server ("" for
// none), with the servers' roots as before was read with.
func cpuSince(before cpuTimes, roots map[string]int, server string) CPUUse {
	after := readCPU(roots)
	if !before.ok || !after.ok {
		return CPUUse{}
	}
	u := CPUUse{OK: true, Self: after.self - before.self, Idle: after.idle - before.idle}
	if server != "" {
		a, okA := after.server[server]
		b, okB := before.server[server]
		if okA && okB {
			u.Server = a - b
		} else {
			u.Server = -1
		}
	}
	return u
}

// serverOf is the name of the server a contender of family f decides on: "" for none.
func serverOf(f Family) string {
	switch {
	case f.OnPostgres():
		return serverPostgres
	case f == FamilyRedis:
		return serverRedis
	}
	return ""
}

// columns formats u for ops operations over wall seconds: this process's and the server's
// microseconds per operation (the server's "—" when there is none or it was not found) and the
// idle CPUs; all "—" when not measured.
func (u CPUUse) columns(ops int64, wall float64, server bool) (self, srv, idle string) {
	if !u.OK || ops <= 0 || wall <= 0 {
		return "—", "—", "—"
	}
	srv = "—"
	if server && u.Server >= 0 {
		srv = fmtMicros(u.Server * 1e6 / float64(ops))
	}
	return fmtMicros(u.Self * 1e6 / float64(ops)), srv, strconv.FormatFloat(max(u.Idle, 0)/wall, 'f', 2, 64)
}

// fmtMicros formats microseconds: whole ones from 10 up, one decimal below.
func fmtMicros(us float64) string {
	if us >= 9.95 {
		return strconv.FormatFloat(us, 'f', 0, 64)
	}
	return strconv.FormatFloat(us, 'f', 1, 64)
}
