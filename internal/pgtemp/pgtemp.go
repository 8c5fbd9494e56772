// Package pgtemp starts a private, throwaway Postgres cluster for the tests and the examples when
// no other database is available: initdb into a temporary directory, postgres on a free loopback
// port, stopped and removed afterwards.
//
// Clean-up does not depend on the Go program ending well. The cluster is run by a watchdog, a
// small shell process in a session of its own (so Ctrl-C in a terminal does not reach it), whose
// standard input is a pipe that only this process holds open. When the program ends in any way
// (return, failed test, panic, os.Exit, Ctrl-C, `go test -timeout` killing the binary, SIGKILL),
// the kernel closes that pipe, the watchdog reads end-of-file, stops postgres (immediate mode) and
// removes the directory. Should the watchdog itself be killed, the next Start removes what it left:
// each directory records its watchdog's process ID, and a directory whose watchdog is gone is
// stopped and removed (Sweep).
//
// Under root, initdb and postgres refuse to run: the directory is given to the "postgres" user,
// which runs the watchdog and everything it starts.
package pgtemp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// EnvBindir names a directory holding initdb, pg_ctl and postgres, overriding the search of Bindir.
const EnvBindir = "TXLIMIT_PG_BINDIR"

// EnvDisable, set to "off", keeps Start from running (it returns an error saying so): to see the
// message given on a machine without Postgres, on a machine that has it.
const EnvDisable = "TXLIMIT_PRIVATE_CLUSTER"

// live keeps every started cluster reachable: the write end of a watchdog's pipe is an *os.File,
// whose finalizer would close it (and so stop the cluster) once a caller drops the *Cluster.
var (
	liveMu sync.Mutex
	live   []*Cluster
)

// dirPrefix starts the name of every cluster directory, under os.TempDir().
const dirPrefix = "txlimit-pg-"

// Cluster is a running private cluster.
type Cluster struct {
	// URL connects to the cluster's "postgres" database as the superuser postgres, without password.
	URL string
	// Dir is the temporary directory holding the data directory, the log and the socket.
	Dir string

	cmd   *exec.Cmd
	stdin *os.File
}

// watchdog runs as the cluster's owner: initdb, start, report "ready", wait for end-of-file on
// standard input, stop, remove. Arguments: bindir, dir, port.
const watchdog = `
trap '' PIPE  # an owner dead before "ready" must not kill the watchdog: it still has to clean up
bindir=$1 dir=$2 port=$3
cleanup() { "$bindir/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1; rm -rf "$dir"; }
if ! "$bindir/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --locale=C -N >"$dir/initdb.log" 2>&1; then
  echo "initdb failed: $(tail -n 5 "$dir/initdb.log" | tr '\n' ' ')"; rm -rf "$dir"; exit 1
fi
if ! "$bindir/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories='$dir' -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" start >"$dir/pg_ctl.log" 2>&1; then
  echo "pg_ctl start failed: $(tail -n 5 "$dir/postgres.log" "$dir/pg_ctl.log" 2>/dev/null | tr '\n' ' ')"; cleanup; exit 1
fi
echo ready
while read -r _; do :; done
cleanup
`

// Start sweeps clusters left by dead runs, then initdb's and starts a new cluster and waits until
// it accepts connections. It takes a second or two. The cluster lives until Stop or until this
// process ends, whichever comes first.
func Start(ctx context.Context) (*Cluster, error) {
	if os.Getenv(EnvDisable) == "off" {
		return nil, fmt.Errorf("private cluster: disabled by %s=off", EnvDisable)
	}
	bindir, err := Bindir()
	if err != nil {
		return nil, err
	}
	Sweep()
	cred, owner, err := credential()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("private cluster: %w", err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("private cluster: give %s to %s: %w", dir, owner, err)
		}
	}
	port, err := FreePort()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("private cluster: %w", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("private cluster: %w", err)
	}
	cmd := exec.Command("/bin/sh", "-c", watchdog, "pgtemp-watchdog", bindir, dir, strconv.Itoa(port))
	cmd.Stdin = r
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: cred}
	out, err := cmd.StdoutPipe()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("private cluster: %w", err)
	}
	cmd.Stderr = nil
	if err := cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("private cluster: start the watchdog: %w", err)
	}
	_ = r.Close() // the watchdog holds the read end; this process holds only the write end
	_ = os.WriteFile(filepath.Join(dir, "watchdog.pid"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644)
	c := &Cluster{
		URL:   fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port),
		Dir:   dir,
		cmd:   cmd,
		stdin: w,
	}
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(out).ReadString('\n')
		line <- strings.TrimSpace(s)
	}()
	select {
	case s := <-line:
		if s != "ready" {
			_ = c.Stop()
			if s == "" {
				s = "the watchdog exited without a word"
			}
			return nil, fmt.Errorf("private cluster with %s: %s", bindir, s)
		}
	case <-ctx.Done():
		_ = c.Stop()
		return nil, fmt.Errorf("private cluster: %w", ctx.Err())
	}
	liveMu.Lock()
	live = append(live, c)
	liveMu.Unlock()
	return c, nil
}

// Stop stops the cluster and removes its directory, and returns when both are done.
func (c *Cluster) Stop() error {
	if c.stdin == nil {
		return nil
	}
	_ = c.stdin.Close()
	c.stdin = nil
	liveMu.Lock()
	live = slices.DeleteFunc(live, func(x *Cluster) bool { return x == c })
	liveMu.Unlock()
	err := c.cmd.Wait()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return nil // a watchdog that failed to start the cluster has already cleaned up
	}
	return err
}

// Bindir finds the directory of initdb, pg_ctl and postgres: $TXLIMIT_PG_BINDIR, else the
// directory initdb on $PATH resolves to, else the newest /usr/lib/postgresql/*/bin.
func Bindir() (string, error) {
	has := func(dir string) bool {
		for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
			if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || fi.IsDir() {
				return false
			}
		}
		return true
	}
	if dir := os.Getenv(EnvBindir); dir != "" {
		if has(dir) {
			return dir, nil
		}
		return "", fmt.Errorf("private cluster: %s=%s holds no initdb, pg_ctl and postgres", EnvBindir, dir)
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil && has(filepath.Dir(real)) {
			return filepath.Dir(real), nil
		}
		if has(filepath.Dir(p)) {
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, dir := range dirs {
		if has(dir) {
			return dir, nil
		}
	}
	return "", errors.New("private cluster: no Postgres server binaries (initdb, pg_ctl, postgres) on $PATH or under /usr/lib/postgresql/*/bin")
}

// Sweep stops and removes the clusters of dead runs: directories under os.TempDir() named by this
// package whose watchdog process no longer exists. Live runs' clusters are left alone.
func Sweep() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, "watchdog.pid"))
		if err != nil {
			continue // being set up right now, or not ours
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) == nil || !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			continue
		}
		if bindir, err := Bindir(); err == nil {
			cred, _, _ := credential()
			stop := exec.Command(filepath.Join(bindir, "pg_ctl"), "-D", filepath.Join(dir, "data"), "-m", "immediate", "-w", "stop")
			stop.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
			_ = stop.Run()
		}
		_ = os.RemoveAll(dir)
	}
}

// credential is the user the cluster runs as: nil (this user) unless this process is root, which
// initdb and postgres refuse to run as; then the "postgres" user.
func credential() (*syscall.Credential, string, error) {
	if os.Geteuid() != 0 {
		return nil, "", nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, "", fmt.Errorf("private cluster: running as root, and initdb refuses root: no user %q to run it as (%w)", "postgres", err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, "postgres", nil
}

// FreePort asks the kernel for a free loopback TCP port (free a moment ago).
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Wait is how long Start may take at most; callers put it on their context.
const Wait = 2 * time.Minute
