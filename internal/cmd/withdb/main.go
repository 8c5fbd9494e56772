// Command withdb runs a command with DATABASE_URL naming a Postgres, so that the examples need
// nothing but DATABASE_URL and `make demo` still works on a bare machine. It uses, in order:
// DATABASE_URL when set; TEST_DATABASE_URL; the local default (internal/scratch.DefaultURL, or
// $TXLIMIT_LOCAL_URL) when it answers; else a private throwaway cluster (internal/pgtemp) when the
// Postgres server is installed, stopped and removed when the command ends (or, if withdb dies
// first, by the cluster's watchdog). When none is found it names the three ways to provide one.
//
//	go run ./internal/cmd/withdb -- go run ./examples/llmbudget
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txlimit/txlimit/internal/pgtemp"
	"github.com/txlimit/txlimit/internal/scratch"
)

func main() {
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "usage: withdb [--] command [args...]")
		os.Exit(2)
	}
	os.Exit(run(args))
}

func run(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	url, cleanup, err := find(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "withdb:", err)
		return 1
	}
	defer cleanup()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), "DATABASE_URL="+url)
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "withdb:", err)
		return 1
	}
	return 0
}

// find returns the URL of a Postgres and what to do when the command has ended, and says on
// stderr which it found (host, port and database: never a password).
func find(ctx context.Context) (string, func(), error) {
	for _, env := range []string{"DATABASE_URL", "TEST_DATABASE_URL"} {
		if v := os.Getenv(env); v != "" {
			fmt.Fprintf(os.Stderr, "(withdb: the database of %s, %s)\n", env, describe(v))
			return v, func() {}, nil
		}
	}
	local := scratch.DefaultURL
	if v := os.Getenv(scratch.EnvLocalURL); v != "" {
		local = v
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	conn, localErr := pgx.Connect(pctx, local)
	cancel()
	if localErr == nil {
		_ = conn.Close(ctx)
		fmt.Fprintf(os.Stderr, "(withdb: no DATABASE_URL; the Postgres answering on %s)\n", describe(local))
		return local, func() {}, nil
	}
	c, err := pgtemp.Start(ctx)
	if err != nil {
		return "", nil, fmt.Errorf("no Postgres found. Tried, in order:\n  - DATABASE_URL and TEST_DATABASE_URL: not set\n  - %s: %v\n  - %v\n%s",
			local, localErr, err, pgtemp.Ways("DATABASE_URL"))
	}
	fmt.Fprintf(os.Stderr, "(withdb: no DATABASE_URL and nothing on %s: a private throwaway Postgres, %s)\n", describe(local), describe(c.URL))
	return c.URL, func() { _ = c.Stop() }, nil
}

// describe names the database of url by host, port and database name, without user or password.
func describe(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "an unparsable URL"
	}
	return fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
}
