// Command withdb runs commands, one after the other, each with DATABASE_URL naming a fresh schema
// of its own on a Postgres, so that the examples need nothing but DATABASE_URL and `make demo`
// still works on a bare machine. The Postgres is found or started by package internal/devdb:
// DATABASE_URL when set, else TEST_DATABASE_URL, else the local default, else a container or a
// private throwaway cluster, which is stopped and removed when withdb ends. When none is found it
// names the three ways to provide one.
//
// Each command's schema is created empty before it starts, named in DATABASE_URL's search_path,
// and dropped when it ends, so a command can be run again and again without leftovers. Commands are
// separated by "--"; withdb stops at the first that fails, and exits with its status.
//
//	go run ./internal/cmd/withdb -- go run ./examples/demo -- go run ./examples/llmbudget
package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"github.com/txlimit/txlimit/internal/devdb"
)

func main() {
	var cmds [][]string
	for args := os.Args[1:]; len(args) > 0; {
		i := slices.Index(args, "--")
		if i < 0 {
			i = len(args)
		}
		if i > 0 {
			cmds = append(cmds, args[:i])
		}
		args = args[min(i+1, len(args)):]
	}
	if len(cmds) == 0 {
		fmt.Fprintln(os.Stderr, "usage: withdb [--] command [args...] [-- command [args...]]...")
		os.Exit(2)
	}
	os.Exit(run(cmds))
}

func run(cmds [][]string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	db, err := devdb.Find(ctx, "DATABASE_URL", devdb.EnvTestURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "withdb:", err)
		return 1
	}
	defer func() { _ = db.Stop() }()
	for i, args := range cmds {
		if ctx.Err() != nil {
			return 1 // interrupted: the commands left are not started
		}
		if i > 0 {
			fmt.Println()
		}
		if code := runOne(ctx, db, args); code != 0 {
			return code
		}
	}
	return 0
}

// runOne runs one command with DATABASE_URL naming a fresh schema on db, and says on stderr which
// database and schema (never a password).
func runOne(ctx context.Context, db *devdb.DB, args []string) int {
	schema := devdb.SchemaName("txlimit_withdb_")
	dsn, err := withSearchPath(db.URL, schema)
	if err != nil {
		fmt.Fprintln(os.Stderr, "withdb:", err)
		return 1
	}
	drop, err := devdb.CreateSchema(ctx, db.URL, schema)
	if err != nil {
		fmt.Fprintf(os.Stderr, "withdb: %s: %v\n", db, err)
		return 1
	}
	defer func() {
		if err := drop(); err != nil {
			fmt.Fprintln(os.Stderr, "withdb:", err)
		}
	}()
	found := db.String()
	if db.From != "DATABASE_URL" {
		found = "no DATABASE_URL; " + found
	}
	fmt.Fprintf(os.Stderr, "(withdb: %s; schema %s, dropped at the end)\n", found, schema)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dsn)
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

// withSearchPath returns the connection string dsn with its search_path set to schema (a plain
// identifier), through the options parameter ("-c search_path=schema"), which libpq, pgx and
// lib/pq all pass to the server: added to a postgres:// URL's options, or as a key=value string's
// last keyword (it replaces an options keyword before it). A search_path parameter of dsn itself
// would be sent after options and win, running the command in the user's own schema: a URL's is
// removed, and a key=value string that sets one is refused.
func withSearchPath(dsn, schema string) (string, error) {
	opt := "-csearch_path=" + schema
	if !strings.HasPrefix(dsn, "postgres://") && !strings.HasPrefix(dsn, "postgresql://") {
		if strings.Contains(dsn, "search_path") {
			return "", errors.New("the connection string sets search_path: remove it (withdb runs the command in a fresh schema of its own)")
		}
		return dsn + " options=" + opt, nil
	}
	u, err := url.Parse(dsn)
	if err != nil {
		return "", fmt.Errorf("the database URL does not parse: %w", err)
	}
	q := u.Query()
	q.Del("search_path")
	q.Set("options", strings.TrimSpace(q.Get("options")+" "+opt))
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20") // libpq reads no "+" as a space
	return u.String(), nil
}
