package pgtemp_test

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"runtime"
	"strings"
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

// TestKilledOwner: a process that started a cluster is killed with SIGKILL (as `go test -timeout`
// or an OOM killer would): its watchdog stops the cluster and removes the directory anyway.
func TestKilledOwner(t *testing.T) {
	needBinaries(t)
	if os.Getenv("PGTEMP_HELPER") == "1" {
		c, err := pgtemp.Start(context.Background())
		if err != nil {
			os.Stdout.WriteString("error " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Stdout.WriteString(c.Dir + " " + c.URL + "\n")
		time.Sleep(time.Hour)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledOwner$")
	cmd.Env = append(os.Environ(), "PGTEMP_HELPER=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	dir, url, ok := strings.Cut(strings.TrimSpace(line), " ")
	if !ok || dir == "error" {
		_ = cmd.Process.Kill()
		t.Fatalf("helper: %q", line)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	gone(t, dir)
	if conn, err := pgx.Connect(context.Background(), url); err == nil {
		_ = conn.Close(context.Background())
		t.Fatal("the cluster still answers after its directory was removed")
	}
}

// TestDroppedClusterKeepsRunning: a caller that keeps only the URL (as testdb does) still has a
// cluster after garbage collection; it is removed when the binary ends.
func TestDroppedClusterKeepsRunning(t *testing.T) {
	needBinaries(t)
	ctx := context.Background()
	c, err := pgtemp.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	url := c.URL
	c = nil
	runtime.GC()
	runtime.GC()
	time.Sleep(time.Second)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("after the *Cluster was dropped and collected: %v", err)
	}
	_ = conn.Close(ctx)
}
