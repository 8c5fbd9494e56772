// Package cli is txlimit's operator command: migrations, the state of a key, a reset, pruning.
// cmd/txlimit is this package with nothing added; an application embeds it in a command of its
// own to inspect its limits under the definitions it runs with:
//
//	// cmd/myapp-limits/main.go
//	func main() {
//		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
//		defer stop()
//		os.Exit(cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr, &cli.Options{Limits: myapp.Limits}))
//	}
//
// where myapp.Limits is the map the application passes to ratelimit.LimiterConfig.Limits. An
// application that keeps its limits in a JSON file reads it with LoadLimits and gives the same
// file to the command with --config.
//
// # Usage
//
//	txlimit [flags] migrate up|down|status
//	txlimit [flags] inspect NAME KEY
//	txlimit [flags] reset NAME KEY
//	txlimit [flags] prune [NAME]
//
// Flags may come before or after the command and its arguments:
//
//	--dsn URL          the database (postgres:// URL or key=value string); defaults to $DATABASE_URL
//	--schema NAME      the schema txlimit's table is in (sets search_path); defaults to the DSN's
//	--json             one JSON object on stdout (errors: one on stderr) instead of text
//	--config FILE      a JSON file of named limits (see LoadLimits)
//	--timeout D        bound on the whole command; defaults to 5m
//	--rate R --period D [--capacity C] [--kind token-bucket|fixed-window] [--shards N]
//	[--max-reserved M] [--start RFC3339]
//	                   an ad-hoc config for NAME, used instead of a registered one
//
// # Exit codes
//
//	0  done
//	1  the database failed: unreachable, or an error from a statement
//	2  usage: an unknown command or flag, a missing argument, an unreadable config file
//	3  invalid input: an unknown limit name, a bad config or key (ratelimit.ErrInvalid)
//
// The command uses only the public API of packages ratelimit and migrations.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
)

// Exit codes of Run.
const (
	// ExitOK: the command did what it was asked.
	ExitOK = 0
	// ExitDatabase: the database could not be reached or a statement failed.
	ExitDatabase = 1
	// ExitUsage: the command line was wrong (unknown command or flag, missing argument, unreadable
	// config file).
	ExitUsage = 2
	// ExitInvalid: the input was refused by package ratelimit (errors.Is(err, ratelimit.ErrInvalid)),
	// an unknown limit name among them.
	ExitInvalid = 3
)

// Options configure Run. A nil *Options is the zero value.
type Options struct {
	// Limits are the application's named limits, as in ratelimit.LimiterConfig.Limits. A --config
	// file adds to them (its definitions win on a name in both). Defaults to none.
	Limits map[string]ratelimit.Config

	// Getenv reads the environment (DATABASE_URL). Defaults to nil: os.Getenv.
	Getenv func(string) string

	// Name is the program's name in messages. Defaults to "txlimit".
	Name string
}

// usageError is a wrong command line (exit 2).
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{msg: fmt.Sprintf(format, args...)} }

// dbError is a failure of the database (exit 1).
type dbError struct{ err error }

func (e *dbError) Error() string { return e.err.Error() }
func (e *dbError) Unwrap() error { return e.err }

// Run runs the command line args (without the program name) and returns the exit code. It writes
// results to stdout and errors to stderr, and never calls os.Exit, so it can run in-process.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer, opts *Options) int {
	if opts == nil {
		opts = &Options{}
	}
	c := &command{stdout: stdout, stderr: stderr, opts: opts, name: opts.Name}
	if c.name == "" {
		c.name = "txlimit"
	}
	if opts.Getenv == nil {
		c.getenv = os.Getenv
	} else {
		c.getenv = opts.Getenv
	}
	err := c.run(ctx, args)
	if err == nil {
		return ExitOK
	}
	code := ExitDatabase
	var ue *usageError
	switch {
	case errors.As(err, &ue):
		code = ExitUsage
	case errors.Is(err, ratelimit.ErrInvalid):
		code = ExitInvalid
	}
	if errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	if c.json {
		_ = json.NewEncoder(stderr).Encode(map[string]any{"error": err.Error(), "exit_code": code})
	} else {
		fmt.Fprintf(stderr, "%s: %v\n", c.name, err)
		if code == ExitUsage {
			fmt.Fprintf(stderr, "usage: %s [flags] migrate up|down|status | inspect NAME KEY | reset NAME KEY | prune [NAME]\n"+
				"run '%s -h' for the flags\n", c.name, c.name)
		}
	}
	return code
}

type command struct {
	stdout, stderr io.Writer
	opts           *Options
	name           string
	getenv         func(string) string

	json       bool
	dsn        string
	schema     string
	configFile string
	timeout    time.Duration

	// the ad-hoc config
	rate, capacity, maxReserved float64
	period                      time.Duration
	kind                        string
	shards                      int
	start                       string
	set                         map[string]bool
}

func (c *command) flags() *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by Run; -h prints the defaults below
	fs.BoolVar(&c.json, "json", false, "print one JSON object instead of text")
	fs.StringVar(&c.dsn, "dsn", "", "database URL (default $DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", "", "schema of txlimit's table: sets search_path (default: the DSN's)")
	fs.StringVar(&c.configFile, "config", "", "JSON file of named limits")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "bound on the whole command")
	fs.Float64Var(&c.rate, "rate", 0, "ad-hoc config: tokens per period")
	fs.DurationVar(&c.period, "period", 0, "ad-hoc config: the period, e.g. 1m")
	fs.Float64Var(&c.capacity, "capacity", 0, "ad-hoc config: capacity (default: rate)")
	fs.Float64Var(&c.maxReserved, "max-reserved", 0, "ad-hoc config: MaxReserved")
	fs.StringVar(&c.kind, "kind", "token-bucket", "ad-hoc config: token-bucket or fixed-window")
	fs.IntVar(&c.shards, "shards", 0, "ad-hoc config: shards (default 1)")
	fs.StringVar(&c.start, "start", "", "ad-hoc config: fixed window grid anchor, RFC 3339")
	return fs
}

// parse parses flags anywhere among the arguments and returns the positional ones.
func (c *command) parse(args []string) ([]string, error) {
	fs := c.flags()
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fmt.Fprintf(c.stderr, "usage: %s [flags] migrate up|down|status | inspect NAME KEY | reset NAME KEY | prune [NAME]\n", c.name)
				fs.SetOutput(c.stderr)
				fs.PrintDefaults()
				return nil, err
			}
			return nil, usagef("%v", err)
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	c.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { c.set[f.Name] = true })
	return pos, nil
}

func (c *command) run(ctx context.Context, args []string) error {
	pos, err := c.parse(args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		return usagef("no command")
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	cmd, rest := pos[0], pos[1:]
	switch cmd {
	case "migrate":
		if len(rest) != 1 {
			return usagef("migrate takes one of up, down, status")
		}
		return c.migrate(ctx, rest[0])
	case "inspect":
		if len(rest) != 2 {
			return usagef("inspect takes NAME KEY (KEY may be \"\" for a global limit)")
		}
		return c.inspect(ctx, rest[0], rest[1])
	case "reset":
		if len(rest) != 2 {
			return usagef("reset takes NAME KEY")
		}
		return c.reset(ctx, rest[0], rest[1])
	case "prune":
		if len(rest) > 1 {
			return usagef("prune takes at most one NAME")
		}
		return c.prune(ctx, rest)
	}
	return usagef("unknown command %q", cmd)
}

// limiter returns a Limiter of every known limit (Options.Limits, then --config) and the ad-hoc
// config from flags, nil when no --rate was given.
func (c *command) limiter() (*ratelimit.Limiter, *ratelimit.Config, error) {
	lim, _, adhoc, err := c.limits()
	return lim, adhoc, err
}

// limits is limiter that also returns how many limits are registered.
func (c *command) limits() (*ratelimit.Limiter, int, *ratelimit.Config, error) {
	limits := map[string]ratelimit.Config{}
	for name, cfg := range c.opts.Limits {
		limits[name] = cfg
	}
	if c.configFile != "" {
		f, err := os.Open(c.configFile)
		if err != nil {
			return nil, 0, nil, usagef("--config: %v", err)
		}
		defer f.Close()
		file, err := LoadLimits(f)
		if err != nil {
			if errors.Is(err, ratelimit.ErrInvalid) {
				return nil, 0, nil, fmt.Errorf("--config %s: %w", c.configFile, err)
			}
			return nil, 0, nil, usagef("--config %s: %v", c.configFile, err)
		}
		for name, cfg := range file {
			limits[name] = cfg
		}
	}
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits})
	if err != nil {
		return nil, 0, nil, err
	}
	adhoc, err := c.adhoc()
	return lim, len(limits), adhoc, err
}

func (c *command) adhoc() (*ratelimit.Config, error) {
	given := false
	for _, f := range []string{"rate", "period", "capacity", "max-reserved", "kind", "shards", "start"} {
		given = given || c.set[f]
	}
	if !given {
		return nil, nil
	}
	if !c.set["rate"] || !c.set["period"] {
		return nil, usagef("an ad-hoc config needs --rate and --period")
	}
	cfg := &ratelimit.Config{Rate: c.rate, Period: c.period, Capacity: c.capacity, MaxReserved: c.maxReserved, Shards: c.shards}
	k, err := parseKind(c.kind)
	if err != nil {
		return nil, usagef("--kind: %v", err)
	}
	cfg.Kind = k
	if c.start != "" {
		t, err := time.Parse(time.RFC3339Nano, c.start)
		if err != nil {
			return nil, usagef("--start: %v", err)
		}
		cfg.Start = t
	}
	return cfg, nil
}

func parseKind(s string) (ratelimit.Kind, error) {
	switch strings.ReplaceAll(strings.ToLower(s), "_", "-") {
	case "", "token-bucket", "tokenbucket":
		return ratelimit.TokenBucket, nil
	case "fixed-window", "fixedwindow":
		return ratelimit.FixedWindow, nil
	}
	return 0, fmt.Errorf("unknown kind %q: token-bucket or fixed-window", s)
}

// unknownHint adds to an unknown limit's error where the command finds configs.
func unknownHint(err error) error {
	var unknown *ratelimit.UnknownLimitError
	if errors.As(err, &unknown) {
		return fmt.Errorf("%w (the command knows the limits of --config FILE and of the application embedding it; "+
			"or give an ad-hoc config with --rate and --period)", err)
	}
	return err
}

// connConfig parses the DSN and applies --schema.
func (c *command) connConfig() (*pgx.ConnConfig, error) {
	dsn := c.dsn
	if dsn == "" {
		dsn = c.getenv("DATABASE_URL")
	}
	if dsn == "" {
		return nil, usagef("no database: set DATABASE_URL or pass --dsn")
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, usagef("--dsn: %v", err)
	}
	if c.schema != "" {
		cfg.RuntimeParams["search_path"] = c.schema
	}
	return cfg, nil
}

func (c *command) pool(ctx context.Context) (*pgxpool.Pool, error) {
	cc, err := c.connConfig()
	if err != nil {
		return nil, err
	}
	pc, err := pgxpool.ParseConfig("")
	if err != nil {
		return nil, err
	}
	pc.ConnConfig = cc
	pc.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, &dbError{err: fmt.Errorf("connect: %w", err)}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, &dbError{err: fmt.Errorf("connect: %w", err)}
	}
	return pool, nil
}

func (c *command) print(v any, text string) error {
	if c.json {
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	_, err := io.WriteString(c.stdout, text)
	return err
}

// MigrationJSON is one migration in the --json output of migrate.
type MigrationJSON struct {
	// Version is the migration's number.
	Version int64 `json:"version"`
	// File is its file name.
	File string `json:"file"`
	// State is "applied" or "pending" (migrate status), or what was done: "up", "down".
	State string `json:"state"`
	// AppliedAt is when it was applied (migrate status), omitted when pending.
	AppliedAt *time.Time `json:"applied_at,omitempty"`
}

func (c *command) migrate(ctx context.Context, dir string) error {
	if dir != "up" && dir != "down" && dir != "status" {
		return usagef("migrate takes one of up, down, status, not %q", dir)
	}
	cc, err := c.connConfig()
	if err != nil {
		return err
	}
	db := stdlib.OpenDB(*cc)
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return &dbError{err: fmt.Errorf("connect: %w", err)}
	}
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		return &dbError{err: err}
	}
	var out []MigrationJSON
	var text strings.Builder
	switch dir {
	case "up":
		res, err := p.Up(ctx)
		if err != nil {
			return &dbError{err: fmt.Errorf("migrate up: %w", err)}
		}
		for _, r := range res {
			out = append(out, migrationJSON(r.Source, "up", nil))
			fmt.Fprintf(&text, "up    %s\n", fileName(r.Source))
		}
		if len(res) == 0 {
			text.WriteString("up to date\n")
		}
	case "down":
		r, err := p.Down(ctx)
		if errors.Is(err, goose.ErrNoNextVersion) {
			text.WriteString("nothing to roll back\n")
			break
		}
		if err != nil {
			return &dbError{err: fmt.Errorf("migrate down: %w", err)}
		}
		out = append(out, migrationJSON(r.Source, "down", nil))
		fmt.Fprintf(&text, "down  %s\n", fileName(r.Source))
	case "status":
		st, err := p.Status(ctx)
		if err != nil {
			return &dbError{err: fmt.Errorf("migrate status: %w", err)}
		}
		for _, s := range st {
			var at *time.Time
			if s.State == goose.StateApplied {
				t := s.AppliedAt.UTC()
				at = &t
				fmt.Fprintf(&text, "applied  %s  %s\n", t.Format(time.RFC3339), fileName(s.Source))
			} else {
				fmt.Fprintf(&text, "pending  %-20s  %s\n", "", fileName(s.Source))
			}
			out = append(out, migrationJSON(s.Source, string(s.State), at))
		}
	}
	if out == nil {
		out = []MigrationJSON{}
	}
	return c.print(map[string]any{"migrations": out}, text.String())
}

func fileName(s *goose.Source) string {
	if s == nil {
		return ""
	}
	i := strings.LastIndexAny(s.Path, `/\`)
	return s.Path[i+1:]
}

func migrationJSON(s *goose.Source, state string, at *time.Time) MigrationJSON {
	m := MigrationJSON{File: fileName(s), State: state, AppliedAt: at}
	if s != nil {
		m.Version = s.Version
	}
	return m
}

// InspectJSON is the --json output of inspect.
type InspectJSON struct {
	// Name and Key identify the limit.
	Name string `json:"name"`
	Key  string `json:"key"`
	// Config describes the config in force, e.g. "token bucket 10/1m0s cap 3".
	Config string `json:"config"`
	// Value is the number of tokens available now, over every shard.
	Value float64 `json:"value"`
	// Shards has the tokens available now in each shard, indexed by shard.
	Shards []float64 `json:"shards"`
	// LastWrite is the latest stored ts of any shard row; omitted when the key has no row (full).
	LastWrite *time.Time `json:"last_write,omitempty"`
	// At is the database's clock the state was read at.
	At time.Time `json:"at"`
	// NextToken is when a call for one token would be granted: At when it would be now.
	NextToken time.Time `json:"next_token"`
	// NextTokenExact is false for a sharded limit, whose answer holds for the pair of shards one
	// Check picked at random.
	NextTokenExact bool `json:"next_token_exact"`
}

func (c *command) inspect(ctx context.Context, name, key string) error {
	lim, adhoc, err := c.limiter()
	if err != nil {
		return err
	}
	cfg, err := lim.Lookup(name, key, adhoc)
	if err != nil {
		return unknownHint(err)
	}
	pool, err := c.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := lim.State(ctx, pool, name, key, &ratelimit.KeyOpts{Config: adhoc})
	if err != nil {
		return &dbError{err: err}
	}
	chk, err := lim.Check(ctx, pool, name, key, &ratelimit.LimitOpts{Config: adhoc})
	if err != nil {
		if errors.Is(err, ratelimit.ErrInvalid) { // one token can never be granted (capacity < 1)
			return err
		}
		return &dbError{err: err}
	}
	out := InspectJSON{Name: name, Key: key, Config: cfg.String(), Value: st.Value, Shards: st.Shards,
		At: st.Time, NextToken: st.Time, NextTokenExact: len(st.Shards) <= 1}
	if !chk.OK {
		out.NextToken = chk.RetryAt
	}
	if !st.TS.IsZero() {
		ts := st.TS
		out.LastWrite = &ts
	}
	var text strings.Builder
	fmt.Fprintf(&text, "limit   %s\nkey     %q\nconfig  %s\nat      %s\nvalue   %g\n", name, key, out.Config,
		out.At.Format(time.RFC3339Nano), out.Value)
	if out.LastWrite != nil {
		fmt.Fprintf(&text, "written %s\n", out.LastWrite.Format(time.RFC3339Nano))
	} else {
		text.WriteString("written never (no row: the limit is full)\n")
	}
	for i, v := range out.Shards {
		fmt.Fprintf(&text, "shard %d %g\n", i, v)
	}
	switch {
	case !out.NextToken.After(out.At):
		text.WriteString("next    now\n")
	default:
		fmt.Fprintf(&text, "next    %s (in %s)\n", out.NextToken.Format(time.RFC3339Nano), out.NextToken.Sub(out.At))
	}
	if !out.NextTokenExact {
		text.WriteString("        (sharded: for the pair of shards a call picked at random)\n")
	}
	return c.print(out, text.String())
}

func (c *command) reset(ctx context.Context, name, key string) error {
	lim, _, err := c.limiter()
	if err != nil {
		return err
	}
	if _, err := lim.Lookup(name, key, &ratelimit.Config{Rate: 1, Period: time.Second}); err != nil {
		return err // a bad name or key, before connecting
	}
	pool, err := c.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := lim.Reset(ctx, pool, name, key); err != nil {
		if errors.Is(err, ratelimit.ErrInvalid) {
			return err
		}
		return &dbError{err: err}
	}
	return c.print(map[string]any{"name": name, "key": key, "reset": true}, fmt.Sprintf("reset %s %q: full again\n", name, key))
}

// PruneJSON is the --json output of prune.
type PruneJSON struct {
	// Deleted is the number of rows deleted per limit.
	Deleted map[string]int64 `json:"deleted"`
	// Total is the sum of Deleted.
	Total int64 `json:"total"`
}

func (c *command) prune(ctx context.Context, names []string) error {
	lim, registered, adhoc, err := c.limits()
	if err != nil {
		return err
	}
	switch {
	case len(names) == 1:
		if _, err := lim.Lookup(names[0], "", adhoc); err != nil {
			return unknownHint(err)
		}
	case adhoc != nil:
		return usagef("an ad-hoc config needs the limit's NAME: prune NAME --rate ... --period ...")
	case registered == 0:
		return usagef("no limits to prune: pass --config FILE, or prune NAME with an ad-hoc config")
	}
	pool, err := c.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	out := PruneJSON{Deleted: map[string]int64{}}
	if len(names) == 1 {
		n, err := lim.Prune(ctx, pool, names[0], &ratelimit.PruneOpts{Config: adhoc})
		out.Deleted[names[0]] = n
		if err != nil {
			return &dbError{err: err}
		}
	} else {
		if out.Deleted, err = lim.PruneAll(ctx, pool, nil); err != nil {
			return &dbError{err: err}
		}
	}
	names = names[:0]
	for name, n := range out.Deleted {
		out.Total += n
		names = append(names, name)
	}
	sort.Strings(names)
	var text strings.Builder
	for _, name := range names {
		fmt.Fprintf(&text, "%-20s %d rows deleted\n", name, out.Deleted[name])
	}
	fmt.Fprintf(&text, "%-20s %d rows deleted\n", "total", out.Total)
	return c.print(out, text.String())
}
