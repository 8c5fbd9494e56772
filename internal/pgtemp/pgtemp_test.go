package pgtemp_test

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txlimit/txlimit/internal/pgtemp"
)

func needBinaries(t *testing.T) {
	t.Helper()
	if _, err := pgtemp.Bindir(); err != nil {
		t.Skip(err)
	}
}

// gone waits until dir no longer exists; a loaded machine gets a generous bound.
func gone(t *testing.T, dir string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(dir); os.IsNotExist(err) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s still exists 60 s after its owner went away", dir)
}

// TestStartConnectStop: the cluster answers on its URL, and Stop leaves no directory behind.
func TestStartConnectStop(t *testing.T) {
	needBinaries(t)
	ctx := context.Background()
	start := time.Now()
	c, err := pgtemp.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("private cluster up in %v at %s", time.Since(start).Round(time.Millisecond), c.URL)
	conn, err := pgx.Connect(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	var one int
	if err := conn.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1: %d, %v", one, err)
	}
	_ = conn.Close(ctx)
	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(c.Dir); !os.IsNotExist(err) {
		t.Fatalf("after Stop: %s: %v; want it removed", c.Dir, err)
	}
	if _, err := pgx.Connect(ctx, c.URL); err == nil {
		t.Fatal("the cluster still answers after Stop")
	}
}

// TestKilledOwner: a process that started a cluster and dropped its *Cluster (as testdb does) still
// has a running cluster after garbage collection; when it is killed with SIGKILL (as `go test
// -timeout` or an OOM killer would), its watchdog stops the cluster and removes the directory.
func TestKilledOwner(t *testing.T) {
	needBinaries(t)
	if os.Getenv("PGTEMP_HELPER") == "1" {
		helper()
	}
	dir, url, owner := startHelper(t)
	if _, err := owner.lines.ReadString('\n'); err != nil {
		t.Fatalf("helper: %v", err)
	}
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatalf("after the owner dropped its *Cluster and collected garbage: %v", err)
	}
	_ = conn.Close(context.Background())
	_ = owner.Process.Kill()
	_ = owner.Wait()
	gone(t, dir)
	if conn, err := pgx.Connect(context.Background(), url); err == nil {
		_ = conn.Close(context.Background())
		t.Fatal("the cluster still answers after its directory was removed")
	}
}

// TestSweepRemovesOrphans: when the watchdog itself is killed with SIGKILL along with its owner,
// the cluster is left running; the next Sweep (run by every Start) stops it and removes it.
func TestSweepRemovesOrphans(t *testing.T) {
	needBinaries(t)
	dir, url, owner := startHelper(t)
	b, err := os.ReadFile(dir + "/watchdog.pid")
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = owner.Process.Kill()
	_ = owner.Wait()
	for syscall.Kill(pid, 0) == nil { // until the killed watchdog is reaped
		time.Sleep(50 * time.Millisecond)
	}
	if conn, err := pgx.Connect(context.Background(), url); err != nil {
		t.Fatalf("the orphaned cluster should still run before Sweep: %v", err)
	} else {
		_ = conn.Close(context.Background())
	}
	pgtemp.Sweep()
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("after Sweep: %s: %v; want it removed", dir, err)
	}
	if conn, err := pgx.Connect(context.Background(), url); err == nil {
		_ = conn.Close(context.Background())
		t.Fatal("the orphaned cluster still answers after Sweep")
	}
}

// helper is the child process of the tests above: it starts a cluster, prints its directory and
// URL, and sleeps until it is killed.
func helper() {
	c, err := pgtemp.Start(context.Background())
	if err != nil {
		os.Stdout.WriteString("error " + err.Error() + "\n")
		os.Exit(1)
	}
	os.Stdout.WriteString(c.Dir + " " + c.URL + "\n")
	c = nil
	for range 3 { // the *Cluster is dropped, as testdb drops it: the cluster must keep running
		runtime.GC()
		time.Sleep(300 * time.Millisecond)
	}
	os.Stdout.WriteString("collected\n")
	time.Sleep(time.Hour)
	os.Exit(0)
}

// startHelper runs this test binary as helper and returns the cluster's directory and URL.
func startHelper(t *testing.T) (dir, url string, owner helperProc) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledOwner$")
	cmd.Env = append(os.Environ(), "PGTEMP_HELPER=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewReader(out)
	line, _ := lines.ReadString('\n')
	dir, url, ok := strings.Cut(strings.TrimSpace(line), " ")
	if !ok || dir == "error" {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("helper: %q", line)
	}
	return dir, url, helperProc{cmd, lines}
}

// helperProc is the helper process and the rest of its output.
type helperProc struct {
	*exec.Cmd
	lines *bufio.Reader
}

// TestOwnerKilledDuringStart: the owner dies while initdb runs, before the cluster is ready: the
// watchdog still starts it, finds its owner gone, stops it and removes the directory.
func TestOwnerKilledDuringStart(t *testing.T) {
	needBinaries(t)
	before, _ := filepath.Glob(filepath.Join(os.TempDir(), "txlimit-pg-*"))
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledOwner$")
	cmd.Env = append(os.Environ(), "PGTEMP_HELPER=1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var dir string
	for deadline := time.Now().Add(60 * time.Second); dir == "" && time.Now().Before(deadline); {
		now, _ := filepath.Glob(filepath.Join(os.TempDir(), "txlimit-pg-*"))
		for _, d := range now {
			if !slices.Contains(before, d) {
				dir = d
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if dir == "" {
		t.Fatal("the helper created no cluster directory")
	}
	if _, err := os.Stat(filepath.Join(dir, "data", "postmaster.pid")); err == nil {
		t.Logf("the cluster was already up when its owner was killed; the test shows the plain case")
	}
	gone(t, dir)
}
