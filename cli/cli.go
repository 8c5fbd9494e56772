// Package cli is txlimit's operator command: migrations, the names in the table, the state of a
// key, a reset, pruning. cmd/txlimit is this package with nothing added; an application embeds it
// in a command of its own to inspect its limits under the definitions it runs with:
//
//	// cmd/myapp-limits/main.go
//	func main() {
//		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
//		code := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr, &cli.Options{Limits: myapp.Limits})
//		stop() // os.Exit runs no deferred call
//		os.Exit(code)
//	}
//
// where myapp.Limits is the map the application passes to ratelimit.LimiterConfig.Limits, with
// the Name and Config of every httplimit.Policy added, so that the command knows every name the
// application writes. An application that keeps its limits in a JSON file reads it with
// LoadLimits and gives the same file to the command with --config.
//
// # Usage
//
//	txlimit [flags] migrate up|down|status
//	txlimit [flags] names
//	txlimit [flags] inspect NAME KEY
//	txlimit [flags] reset NAME KEY
//	txlimit [flags] prune [NAME]
//
// migrate up applies the pending migrations in the schema of --schema (with --create-schema it
// creates that schema first); migrate down rolls back the last one, which for the first migration
// drops txlimit_state and with it the state of every limit: on a terminal it asks for "yes"
// first, and elsewhere it needs --yes; it rolls back the migration it found last (and named when
// asking) or nothing: when another migrator rolled that one back meanwhile, it is exit 1; it refuses a schema that a newer txlimit migrated beyond
// this one's latest migration. migrate status lists the migrations (and those a newer txlimit
// applied, which this one does not embed); it only reads (USAGE on the
// schema and SELECT on txlimit_goose_version are enough), and finds every one pending in a schema
// never migrated, creating nothing there.
//
// names lists every limit name that has rows in the table, with its row count and the config the
// command knows for it, if any.
//
// inspect, reset and prune NAME work on a limit the command knows: one in --config, in the
// application's Options.Limits, or given on the command line with --rate and --period (an ad-hoc
// config). Any other NAME is exit 3, for every command.
//
// prune without NAME prunes every limit the command knows and checks that it knows every name in
// the table: pruning a row needs its limit's config (a row goes only when it holds the limit's full
// capacity at the clock), so a name found in the table without a config is exit 3, naming it, and
// nothing is deleted. Give such limits in --config (httplimit policies and the limits the
// scheduler reserves are ordinary named limits), or prune each with prune NAME --rate R --period D.
//
// The command sends its statements unnamed (pgx.QueryExecModeExec) unless the DSN sets
// default_query_exec_mode, so it works through PgBouncer in transaction pooling mode too; there,
// leave out --schema (PgBouncer refuses search_path at connect) and let the role's search_path
// lead to the schema (docs/deploy.md).
//
// Flags may come before or after the command and its arguments, up to a "--", after which every
// argument is one of the command's (a key that starts with "-": inspect -- NAME -KEY):
//
//	--dsn URL          the database (postgres:// URL or key=value string); defaults to $DATABASE_URL
//	--schema NAME      the schema txlimit's table is in (sets search_path); defaults to the DSN's
//	                   (refused by PgBouncer: there, the role's search_path)
//	--json             one JSON object on stdout (errors: one on stderr) instead of text
//	--config FILE      a JSON file of named limits (see LoadLimits)
//	--timeout D        bound on the whole command (> 0; a command it ends says so); defaults to 5m
//	--yes              migrate down without asking; defaults to false
//	--create-schema    migrate up creates the schema of --schema when it does not exist; defaults to false
//	--rate R --period D [--capacity C] [--kind token-bucket|fixed-window] [--shards N]
//	[--max-reserved M] [--start RFC3339]
//	                   an ad-hoc config for NAME, used instead of a registered one
//
// # Exit codes
//
//	0  done
//	1  the database failed: unreachable, not migrated (the message names the migrate command that
//	   fixes it), migrated by a newer txlimit that dropped a function this one calls (the message
//	   says to install a newer one), a schema the role may not use (the message names the grant),
//	   or an error from a statement
//	2  usage: an unknown command or flag, a missing argument, an unreadable config file; migrate
//	   down not confirmed (no --yes and no terminal to ask on, an answer other than "yes", or an
//	   interrupt or --timeout before the answer)
//	3  invalid input: a limit name the command has no config for (an argument NAME, or for prune a
//	   name found in the table), a bad config or key (ratelimit.ErrInvalid)
//
// The command uses the public API of packages ratelimit and migrations, and reads of its own (the
// names in the table with their row counts, the schema the search_path leads to, and for migrate
// status the version table).
package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/txlimit/txlimit/internal/dbsqlc"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
)

// Exit codes of Run.
const (
	// ExitOK: the command did what it was asked.
	ExitOK = 0
	// ExitDatabase: the database could not be reached, is not migrated, or a statement failed.
	ExitDatabase = 1
	// ExitUsage: the command line was wrong (unknown command or flag, missing argument, unreadable
	// config file), or migrate down was not confirmed.
	ExitUsage = 2
	// ExitInvalid: the input was refused: a limit name the command has no config for, or input
	// package ratelimit refuses (errors.Is(err, ratelimit.ErrInvalid)).
	ExitInvalid = 3
)

// Options configure Run. A nil *Options is the zero value.
type Options struct {
	// Limits are the application's named limits, as in ratelimit.LimiterConfig.Limits. A --config
	// file adds to them (its definitions win on a name in both). Defaults to none.
	Limits map[string]ratelimit.Config

	// Getenv reads the environment (DATABASE_URL). Defaults to nil: os.Getenv.
	Getenv func(string) string

	// Stdin is where migrate down reads its confirmation. The command asks only when Stdin is a
	// terminal (it has a Stat method reporting a character device other than /dev/null, as an
	// *os.File on a terminal does); otherwise migrate down needs --yes. When the context ends before the answer, Run
	// returns and leaves a read of Stdin pending. Defaults to nil: os.Stdin.
	Stdin io.Reader

	// Name is the program's name in messages. Defaults to "txlimit".
	Name string
}

// exitError is an error with its exit code. msg, when set, is the command's own wording of err
// (naming its flags and commands rather than Go calls); err stays reachable with errors.Is and
// errors.As. extra adds fields to the --json error object.
type exitError struct {
	code  int
	msg   string
	err   error
	extra map[string]any
}

func (e *exitError) Error() string {
	if e.msg != "" {
		return e.msg
	}
	return e.err.Error()
}

func (e *exitError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return &exitError{code: ExitUsage, msg: fmt.Sprintf(format, args...)}
}

func dbError(err error) error { return &exitError{code: ExitDatabase, err: err} }

const usageLine = "usage: %s [flags] migrate up|down|status | names | inspect NAME KEY | reset NAME KEY | prune [NAME]\n"

// Run runs the command line args (without the program name) and returns the exit code. It writes
// results to stdout and errors to stderr, and never calls os.Exit, so it can run in-process.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer, opts *Options) int {
	if opts == nil {
		opts = &Options{}
	}
	c := &command{stdout: stdout, stderr: stderr, opts: opts, name: opts.Name, stdin: opts.Stdin}
	if c.name == "" {
		c.name = "txlimit"
	}
	if opts.Getenv == nil {
		c.getenv = os.Getenv
	} else {
		c.getenv = opts.Getenv
	}
	if c.stdin == nil {
		c.stdin = os.Stdin
	}
	err := c.run(ctx, args)
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	err = c.explain(err)
	code := ExitDatabase
	var ee *exitError
	switch {
	case errors.As(err, &ee):
		code = ee.code
	case errors.Is(err, ratelimit.ErrInvalid):
		code = ExitInvalid
	}
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil { // the command's own deadline: --timeout
		err = &exitError{code: code, err: err, msg: fmt.Sprintf("--timeout %s expired: %v", c.timeout, err)}
	}
	if c.json {
		out := map[string]any{"error": err.Error(), "exit_code": code}
		if ee != nil {
			for k, v := range ee.extra {
				out[k] = v
			}
		}
		_ = json.NewEncoder(stderr).Encode(out)
	} else {
		fmt.Fprintf(stderr, "%s: %v\n", c.name, err)
		if code == ExitUsage && ee != nil && ee.err == nil {
			fmt.Fprintf(stderr, usageLine+"run '%s -h' for the flags\n", c.name, c.name)
		}
	}
	return code
}

type command struct {
	stdout, stderr io.Writer
	stdin          io.Reader
	opts           *Options
	name           string
	getenv         func(string) string

	json         bool
	dsn          string
	schema       string
	configFile   string
	timeout      time.Duration
	yes          bool
	createSchema bool

	// the ad-hoc config
	rate, capacity, maxReserved float64
	period                      time.Duration
	kind                        string
	shards                      int
	start                       string
	set                         map[string]bool

	// searchPath is the connection's search_path once connected, and noSchema whether none of its
	// schemas exists and may be used; role is the role connected and unusable the schemas of the
	// search_path that exist but that it may not use; for messages.
	searchPath string
	noSchema   bool
	role       string
	unusable   []string
}

func (c *command) flags() *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by Run; -h prints the defaults below
	fs.BoolVar(&c.json, "json", false, "print one JSON object instead of text")
	fs.StringVar(&c.dsn, "dsn", "", "database URL (default $DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", "", "schema of txlimit's table: sets search_path (default: the DSN's)")
	fs.StringVar(&c.configFile, "config", "", "JSON file of named limits")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "bound on the whole command")
	fs.BoolVar(&c.yes, "yes", false, "migrate down without asking")
	fs.BoolVar(&c.createSchema, "create-schema", false, "migrate up: create the schema of --schema when it does not exist")
	fs.Float64Var(&c.rate, "rate", 0, "ad-hoc config: tokens per period")
	fs.DurationVar(&c.period, "period", 0, "ad-hoc config: the period, e.g. 1m")
	fs.Float64Var(&c.capacity, "capacity", 0, "ad-hoc config: capacity (default: rate)")
	fs.Float64Var(&c.maxReserved, "max-reserved", 0, "ad-hoc config: MaxReserved")
	fs.StringVar(&c.kind, "kind", "token-bucket", "ad-hoc config: token-bucket or fixed-window")
	fs.IntVar(&c.shards, "shards", 0, "ad-hoc config: shards (default 1)")
	fs.StringVar(&c.start, "start", "", "ad-hoc config: fixed window grid anchor, RFC 3339")
	return fs
}

// parse parses flags anywhere among the arguments before a "--" and returns the positional ones:
// those among them, then every argument after the "--".
func (c *command) parse(args []string) ([]string, error) {
	fs := c.flags()
	var pos, after []string
	if i := slices.Index(args, "--"); i >= 0 {
		args, after = args[:i], args[i+1:]
	}
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fmt.Fprintf(c.stderr, usageLine, c.name)
				fs.SetOutput(c.stderr)
				fs.PrintDefaults()
				return nil, err
			}
			// The flag package stops at the first error: a --json after it was not read, though
			// the error is to be reported as JSON then too.
			for _, a := range args {
				if a == "--json" || a == "-json" || a == "--json=true" || a == "-json=true" {
					c.json = true
				}
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
	return append(pos, after...), nil
}

func (c *command) run(ctx context.Context, args []string) error {
	pos, err := c.parse(args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		return usagef("no command")
	}
	if c.timeout <= 0 {
		return usagef("--timeout must be > 0, e.g. 30s (got %s)", c.timeout)
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
	case "names":
		if len(rest) != 0 {
			return usagef("names takes no argument")
		}
		return c.names(ctx)
	case "inspect":
		if len(rest) != 2 {
			return usagef("inspect takes NAME KEY (KEY may be \"\" for a global limit)")
		}
		return c.inspect(ctx, rest[0], rest[1])
	case "reset":
		if len(rest) != 2 {
			return usagef("reset takes NAME KEY (KEY may be \"\" for a global limit)")
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

// limiter returns a Limiter of every known limit (Options.Limits, then --config) with their names,
// sorted, and the ad-hoc config from flags, nil when no ad-hoc flag was given.
func (c *command) limiter() (*ratelimit.Limiter, []string, *ratelimit.Config, error) {
	limits := map[string]ratelimit.Config{}
	for name, cfg := range c.opts.Limits {
		limits[name] = cfg
	}
	if c.configFile != "" {
		f, err := os.Open(c.configFile)
		if err != nil {
			return nil, nil, nil, usagef("--config: %v", err)
		}
		defer f.Close()
		file, err := LoadLimits(f)
		var ce *ratelimit.ConfigError
		switch {
		case errors.As(err, &ce):
			return nil, nil, nil, &exitError{code: ExitInvalid, err: err,
				msg: fmt.Sprintf("--config %s: limit %q: %s", c.configFile, ce.Limit, fieldError(ce, jsonField))}
		case errors.Is(err, ratelimit.ErrInvalid):
			return nil, nil, nil, fmt.Errorf("--config %s: %w", c.configFile, err)
		case err != nil:
			return nil, nil, nil, usagef("--config %s: %v", c.configFile, err)
		}
		for name, cfg := range file {
			limits[name] = cfg
		}
	}
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits})
	if err != nil {
		return nil, nil, nil, err
	}
	names := make([]string, 0, len(limits))
	for name := range limits {
		names = append(names, name)
	}
	sort.Strings(names)
	adhoc, err := c.adhoc()
	return lim, names, adhoc, err
}

// adhoc returns the config of the ad-hoc flags, validated, or nil when none was given.
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
	if _, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"ad-hoc": *cfg}}); err != nil {
		var ce *ratelimit.ConfigError
		if errors.As(err, &ce) {
			return nil, &exitError{code: ExitInvalid, err: err, msg: fieldError(ce, flagField)}
		}
		return nil, err
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

// flagField and jsonField name a Config field as the ad-hoc flags and the --config file do.
var (
	flagField = map[string]string{"Kind": "--kind", "Rate": "--rate", "Period": "--period", "Capacity": "--capacity",
		"MaxReserved": "--max-reserved", "Shards": "--shards", "Start": "--start"}
	jsonField = map[string]string{"Kind": `"kind"`, "Rate": `"rate"`, "Period": `"period"`, "Capacity": `"capacity"`,
		"MaxReserved": `"max_reserved"`, "Shards": `"shards"`, "Start": `"start"`}
)

// fieldError says what is wrong with a config field in the words of the command line: the flag or
// JSON field instead of the Go field, the values the command takes instead of Go names.
func fieldError(ce *ratelimit.ConfigError, names map[string]string) string {
	name, ok := names[ce.Field]
	if !ok {
		name = ce.Field
	}
	reason := ce.Reason
	switch ce.Field {
	case "Period":
		reason = strings.TrimSuffix(reason, " (e.g. time.Second)")
	case "Kind":
		reason = "must be token-bucket or fixed-window"
	case "Start":
		reason = "applies only to a fixed window: give " + names["Kind"] + " fixed-window, or no " + name
	}
	return fmt.Sprintf("%s %s (got %v)", name, reason, ce.Value)
}

// explain words an error of package ratelimit in the command's own terms: its flags and commands
// rather than the Go calls that fix it. The error stays reachable (errors.Is, errors.As).
func (c *command) explain(err error) error {
	var ee *exitError
	if errors.As(err, &ee) && ee.msg != "" {
		return err // worded already
	}
	code := ExitDatabase
	if ee != nil {
		code = ee.code
	}
	var (
		unknown *ratelimit.UnknownLimitError
		setup   *ratelimit.SetupError
		arg     *ratelimit.ArgumentError
	)
	switch {
	case errors.As(err, &unknown):
		return &exitError{code: ExitInvalid, err: err, msg: c.unknownMessage(unknown.Name)}
	case errors.As(err, &setup):
		return &exitError{code: code, err: err, msg: c.setupMessage(setup)}
	case errors.As(err, &arg) && arg.Op != "New" && (arg.Arg == "name" || arg.Arg == "key"): // an argument NAME or KEY
		return &exitError{code: ExitInvalid, err: err, msg: fmt.Sprintf("%s %s", strings.ToUpper(arg.Arg), arg.Reason)}
	}
	return err
}

// unknownMessage says that name has no config and where the command takes one.
func (c *command) unknownMessage(name string) string {
	_, known, _, _ := c.limiter()
	msg := fmt.Sprintf("give limit %q a config in --config FILE, or with --rate and --period (unknown limit; ", name)
	switch {
	case len(known) == 0 && c.configFile != "":
		msg += fmt.Sprintf("no limit is configured: %s defines none)", c.configFile)
	case len(known) == 0:
		msg += "no limit is configured: no --config given)"
	case len(known) <= 10:
		msg += fmt.Sprintf("configured: %s)", strings.Join(known, ", "))
	default:
		msg += fmt.Sprintf("configured: %s and %d more)", strings.Join(known[:10], ", "), len(known)-10)
	}
	return msg
}

// migrateUp is the command that migrates the schema this command looks in.
func (c *command) migrateUp() string {
	cmd := c.name + " migrate up"
	if c.schema != "" {
		cmd += " --schema " + quoteArg(c.schema)
	}
	return cmd
}

// quoteArg quotes s for a POSIX shell when it needs it.
func quoteArg(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("_-./:=,", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// setupMessage words a *ratelimit.SetupError: the migrate command that fixes it first.
func (c *command) setupMessage(se *ratelimit.SetupError) string {
	where := fmt.Sprintf("search_path %q", se.SearchPath)
	if se.SearchPath == "" {
		where = "the connection's search_path"
	}
	if se.Problem != nil && se.Version >= se.Want { // a function this one calls is gone from a schema at its version or later
		what := se.Problem.Error()
		var pgErr *pgconn.PgError
		if errors.As(se.Err, &pgErr) && pgErr.Code == "42883" {
			what = fmt.Sprintf("has no function %s, which this %s calls (SQLSTATE %s)", strings.TrimSuffix(strings.TrimPrefix(
				withoutArgs(pgErr.Message), "function "), " does not exist"), c.name, pgErr.Code)
		}
		if se.Version == se.Want { // another build's in-place migrations, or a dropped function: re-apply them
			down := c.name + " migrate down --yes"
			if c.schema != "" {
				down += " --schema " + quoteArg(c.schema)
			}
			return fmt.Sprintf("run \"%s\" %d times (down to version 1, which keeps txlimit_state), then \"%s\": "+
				"the schema (%s) is at this %s's migration version (%d) but %s", down, se.Want-1, c.migrateUp(), where, c.name, se.Version, what)
		}
		return fmt.Sprintf("install a newer %s: the schema (%s) is at migration version %d, newer than this %s's latest (%d), and %s",
			c.name, where, se.Version, c.name, se.Want, what)
	}
	if se.Err == nil {
		return fmt.Sprintf("run \"%s\" (on the same database): %s leads to a schema at migration version %d, this %s needs %d",
			c.migrateUp(), where, se.Version, c.name, se.Want)
	}
	missing := "txlimit's table"
	var pgErr *pgconn.PgError
	if errors.As(se.Err, &pgErr) {
		missing = withoutArgs(pgErr.Message) + ", SQLSTATE " + pgErr.Code
	}
	if msg := c.noUsage(); msg != "" {
		return fmt.Sprintf("%s (%s)", msg, missing)
	}
	if c.noSchema {
		return fmt.Sprintf("not migrated: run \"%s --create-schema\" (on the same database), or pass --schema with the schema txlimit was migrated into "+
			"(no schema of %s exists: %s)", c.migrateUp(), where, missing)
	}
	return fmt.Sprintf("not migrated: run \"%s\" (on the same database), or pass --schema with the schema txlimit was migrated into "+
		"(%s: %s)", c.migrateUp(), where, missing)
}

// withoutArgs is Postgres's message without a function's argument types.
func withoutArgs(msg string) string {
	if i, j := strings.IndexByte(msg, '('), strings.LastIndexByte(msg, ')'); i >= 0 && j > i {
		return msg[:i] + msg[j+1:]
	}
	return msg
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
	// pgx's default exec mode prepares named statements, which a transaction pooler (PgBouncer)
	// runs on whichever server connection comes next: the command sends each statement unnamed
	// instead (docs/deploy.md), unless the DSN chooses a mode itself.
	if pc, err := pgconn.ParseConfig(dsn); err == nil {
		if _, chosen := pc.RuntimeParams["default_query_exec_mode"]; !chosen {
			cfg.DefaultQueryExecMode = pgx.QueryExecModeExec
		}
	}
	if c.schema != "" {
		cfg.RuntimeParams["search_path"] = c.schema
	}
	return cfg, nil
}

// pool connects with at most maxConns connections and reads where the search_path leads.
func (c *command) pool(ctx context.Context, maxConns int32) (*pgxpool.Pool, dbsqlc.CurrentSchemaRow, error) {
	var where dbsqlc.CurrentSchemaRow
	cc, err := c.connConfig()
	if err != nil {
		return nil, where, err
	}
	pc, err := pgxpool.ParseConfig("")
	if err != nil {
		return nil, where, err
	}
	pc.ConnConfig = cc
	pc.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, where, c.connectError(err)
	}
	if where, err = dbsqlc.New().CurrentSchema(ctx, pool); err != nil {
		pool.Close()
		return nil, where, c.connectError(err)
	}
	c.searchPath, c.noSchema, c.role, c.unusable = where.SearchPath, where.Schema == "", where.Role, where.Unusable
	return pool, where, nil
}

// noUsage says, when no schema of the search_path may be used and one exists that the role may not
// use, what to do instead of creating it: "" otherwise.
func (c *command) noUsage() string {
	if !c.noSchema || len(c.unusable) == 0 {
		return ""
	}
	schema := c.unusable[0]
	return fmt.Sprintf("no USAGE on schema %q (of search_path %q) for role %s: connect as the schema's owner, or run "+
		"GRANT USAGE ON SCHEMA %s TO %s as the owner, with the README's other grants (a role that decides but does not migrate)",
		schema, c.searchPath, c.role, pgx.Identifier{schema}.Sanitize(), pgx.Identifier{c.role}.Sanitize())
}

// connectError is the error of a failed connection. A server that refuses search_path as a
// startup parameter (PgBouncer 1.18) refuses --schema: the message says what to do instead.
func (c *command) connectError(err error) error {
	var pgErr *pgconn.PgError
	if c.schema != "" && errors.As(err, &pgErr) && pgErr.Code == "08P01" && strings.Contains(pgErr.Message, "search_path") {
		return &exitError{code: ExitDatabase, err: err, msg: fmt.Sprintf("--schema sets search_path when connecting, which this server refuses "+
			"(PgBouncer does): leave out --schema and set the role's search_path instead (ALTER ROLE ... SET search_path = %s; "+
			"docs/deploy.md), or connect to Postgres directly (%v)", c.schema, pgErr)}
	}
	return dbError(fmt.Errorf("connect: %w", err))
}

// noSchemaError is the error of a search_path none of whose schemas exists: the fix, then what
// is wrong.
func (c *command) noSchemaError(where dbsqlc.CurrentSchemaRow, fix string) error {
	return dbError(fmt.Errorf("%s (no schema of search_path %q exists)", fix, where.SearchPath))
}

// tableError turns a failure of the command's own reads on a schema without txlimit's table into
// the *ratelimit.SetupError package ratelimit would return, so that explain words it alike.
func (c *command) tableError(op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" && strings.Contains(pgErr.Message, "txlimit_") {
		return dbError(&ratelimit.SetupError{Op: op, Fix: "migrations.Up", SearchPath: c.searchPath, Err: err})
	}
	return dbError(err)
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
	// File is its file name; "" for a migration this txlimit does not embed, which a newer txlimit
	// applied (migrate status).
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
	for _, f := range []string{"rate", "period", "capacity", "max-reserved", "kind", "shards", "start"} {
		if c.set[f] {
			return usagef("--%s is not for migrate: migrations need no limit config", f)
		}
	}
	if c.configFile != "" { // not used here, but a file that does not load is an error for every command
		if _, _, _, err := c.limiter(); err != nil {
			return err
		}
	}
	if c.createSchema && dir != "up" {
		return usagef("--create-schema is for migrate up")
	}
	if c.yes && dir != "down" {
		return usagef("--yes is for migrate down")
	}
	// goose's locked operations hold one connection for the migrations and another for the lock.
	pool, where, err := c.pool(ctx, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	if msg := c.noUsage(); msg != "" {
		return dbError(errors.New(msg))
	}
	if where.Schema == "" {
		switch {
		case dir != "up":
			return c.noSchemaError(where, "pass --schema with the schema txlimit was migrated into: nothing is migrated here")
		case !c.createSchema:
			return c.noSchemaError(where, fmt.Sprintf("run \"%s --create-schema\" to create the schema, or pass --schema with an existing one", c.migrateUp()))
		}
	}
	var out []MigrationJSON
	var text strings.Builder
	var applied []*goose.MigrationResult
	switch dir {
	case "up":
		opts := []migrations.Option{migrations.Applied(&applied)}
		if c.createSchema {
			opts = append(opts, migrations.CreateSchema())
		}
		if err := migrations.Up(ctx, pool, opts...); err != nil {
			return dbError(fmt.Errorf("migrate up: %w", err))
		}
		// What this command applied itself: another migrator may have applied some, or all, while
		// it waited for the migration lock.
		for _, r := range applied {
			out = append(out, migrationJSON(r.Source, "up", nil))
			fmt.Fprintf(&text, "up    %s\n", fileName(r.Source))
		}
		if len(out) == 0 {
			text.WriteString("up to date\n")
		}
	case "down":
		// Read what to roll back without the migration lock (only Down takes it), so that a
		// refused or unconfirmed down has written nothing.
		st, dbVersion, err := status(ctx, pool, where.Schema)
		if err != nil {
			return err
		}
		if latest := migrations.Latest(); dbVersion > latest {
			return dbError(fmt.Errorf("migrate down: schema is at version %d, newer than this %s's latest (%d): "+
				"roll it back with the %s that migrated it (schema %q): nothing was rolled back", dbVersion, c.name, latest, c.name, where.Schema))
		}
		var last *goose.MigrationStatus
		for _, s := range st {
			if s.State == goose.StateApplied && (last == nil || s.Source.Version > last.Source.Version) {
				last = s
			}
		}
		if last == nil {
			text.WriteString("nothing to roll back\n")
			break
		}
		if err := c.confirmDown(ctx, pool, where.Schema, last.Source); err != nil {
			return err
		}
		db := stdlib.OpenDBFromPool(pool)
		defer db.Close()
		p, err := migrations.NewProvider(ctx, db)
		if err != nil {
			return dbError(err)
		}
		// Exactly the migration read above (and named by the prompt), checked under the migration
		// lock: when another migrator rolled it back meanwhile, "down" would roll back the one
		// before, which no one confirmed.
		r, err := p.ApplyVersion(ctx, last.Source.Version, false)
		if errors.Is(err, goose.ErrNotApplied) {
			return &exitError{code: ExitDatabase, err: err, msg: fmt.Sprintf("migrate down: %s is no longer applied "+
				"(another migrator rolled it back meanwhile): nothing was rolled back", fileName(last.Source))}
		}
		if err != nil {
			return dbError(fmt.Errorf("migrate down: %w", err))
		}
		out = append(out, migrationJSON(r.Source, "down", nil))
		fmt.Fprintf(&text, "down  %s\n", fileName(r.Source))
	case "status":
		st, _, err := status(ctx, pool, where.Schema)
		if err != nil {
			return err
		}
		for _, s := range st {
			var at *time.Time
			if s.State == goose.StateApplied {
				t := s.AppliedAt.UTC()
				at = &t
				if s.Source.Path == "" {
					fmt.Fprintf(&text, "applied  %s  version %d, not in this %s: a newer %s migrated the schema\n",
						t.Format(time.RFC3339), s.Source.Version, c.name, c.name)
				} else {
					fmt.Fprintf(&text, "applied  %s  %s\n", t.Format(time.RFC3339), fileName(s.Source))
				}
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

// status lists the embedded migrations and their state in schema, and returns the highest version
// the schema's version table records (0 when none), which may be a migration newer than this
// build's. It reads the version table as goose does, with plain SELECTs: it takes no migration lock
// and creates nothing, so it needs no more than SELECT on the table, never waits for a running
// migrator, and finds every migration pending in a schema without the table.
func status(ctx context.Context, pool *pgxpool.Pool, schema string) ([]*goose.MigrationStatus, int64, error) {
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil {
		return nil, 0, err
	}
	st := make([]*goose.MigrationStatus, 0, len(names))
	for _, name := range names {
		v, err := goose.NumericComponent(name)
		if err != nil {
			return nil, 0, fmt.Errorf("migrate status: embedded migration %s: %w", name, err)
		}
		st = append(st, &goose.MigrationStatus{Source: &goose.Source{Type: goose.TypeSQL, Path: name, Version: v}, State: goose.StatePending})
	}
	sort.Slice(st, func(i, j int) bool { return st[i].Source.Version < st[j].Source.Version })
	q := dbsqlc.New()
	exists, err := q.VersionTableExists(ctx, pool, schema)
	if err != nil {
		return nil, 0, dbError(fmt.Errorf("migrate status: look up %s in schema %q: %w", migrations.VersionTable, schema, err))
	}
	if !exists {
		return st, 0, nil
	}
	rows, err := q.MigrationVersions(ctx, pool) // schema is current_schema(): the search_path's
	if err != nil {
		return nil, 0, dbError(fmt.Errorf("migrate status: read %s in schema %q: %w", migrations.VersionTable, schema, err))
	}
	applied := map[int64]time.Time{}
	var dbVersion int64
	for _, r := range rows {
		applied[r.VersionID] = r.Tstamp.Time
		dbVersion = max(dbVersion, r.VersionID)
	}
	for _, s := range st {
		if at, ok := applied[s.Source.Version]; ok {
			s.State, s.AppliedAt = goose.StateApplied, at
			delete(applied, s.Source.Version)
		}
	}
	// What is left was applied by a newer txlimit: listed too, without a file.
	for v, at := range applied {
		if v > 0 { // goose's row 0 marks the table's creation
			st = append(st, &goose.MigrationStatus{Source: &goose.Source{Version: v}, State: goose.StateApplied, AppliedAt: at})
		}
	}
	sort.Slice(st, func(i, j int) bool { return st[i].Source.Version < st[j].Source.Version })
	return st, dbVersion, nil
}

// errNotConfirmed is the cause of a migrate down that was not confirmed.
var errNotConfirmed = errors.New("migrate down not confirmed")

// confirmDown asks whether to roll back m, unless --yes was given: on a terminal it reads "yes",
// and gives up when ctx ends first (an interrupt, --timeout); elsewhere it refuses.
func (c *command) confirmDown(ctx context.Context, pool *pgxpool.Pool, schema string, m *goose.Source) error {
	if c.yes {
		return nil
	}
	what := fmt.Sprintf("migrate down rolls back %s in schema %q", fileName(m), schema)
	if m.Version == 1 {
		what += ": it drops txlimit_state, the state of every limit"
		if rows, err := dbsqlc.New().LimitNames(ctx, pool); err == nil {
			var n int64
			for _, r := range rows {
				n += r.Rows
			}
			what += fmt.Sprintf(" (%s of %s)", plural(n, "row"), plural(int64(len(rows)), "limit"))
		}
	}
	if !isTerminal(c.stdin) {
		return &exitError{code: ExitUsage, err: errNotConfirmed,
			msg: what + "; pass --yes to roll back where no terminal can confirm: nothing was rolled back"}
	}
	fmt.Fprintf(c.stderr, "%s.\nType yes to roll back: ", what)
	// The answer is read aside, so that an interrupt or --timeout ends the wait: a read from a
	// terminal heeds no context. On that path the reader is left blocked until the next line or
	// the end of the input, which for a process that is about to exit is nothing.
	answers := make(chan string, 1)
	go func() {
		answer, _ := bufio.NewReader(c.stdin).ReadString('\n')
		answers <- answer
	}()
	var answer string
	select {
	case answer = <-answers:
	case <-ctx.Done():
		why := "interrupted"
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			why = "--timeout expired"
		}
		fmt.Fprintln(c.stderr)
		return &exitError{code: ExitUsage, err: errNotConfirmed,
			msg: fmt.Sprintf("migrate down not confirmed (%s before an answer): nothing was rolled back", why)}
	}
	if strings.TrimSpace(answer) != "yes" {
		return &exitError{code: ExitUsage, err: errNotConfirmed, msg: "migrate down not confirmed: nothing was rolled back"}
	}
	return nil
}

// plural is "1 row", "2 rows".
func plural(n int64, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// isTerminal reports whether r is a terminal: it has a Stat method (an *os.File) that reports a
// character device.
func isTerminal(r io.Reader) bool {
	f, ok := r.(interface{ Stat() (os.FileInfo, error) })
	if !ok {
		return false
	}
	fi, err := f.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	// /dev/null is a character device too, and what cron, systemd and docker run without -i give
	// a program as its input: no one there to answer.
	null, err := os.Stat(os.DevNull)
	return err != nil || !os.SameFile(fi, null)
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

// NamesJSON is the --json output of names.
type NamesJSON struct {
	// Names has one element per limit name with rows in the table, in name order.
	Names []NameJSON `json:"names"`
	// Total is the number of rows in the table.
	Total int64 `json:"total"`
}

// NameJSON is one limit name in the table.
type NameJSON struct {
	// Name is the limit's name.
	Name string `json:"name"`
	// Rows is its number of rows: one per key and shard written.
	Rows int64 `json:"rows"`
	// Config describes the config the command knows for it (--config, Options.Limits), e.g.
	// "token bucket 10/1m0s cap 3"; omitted when it knows none, and then prune cannot prune it.
	Config string `json:"config,omitempty"`
}

func (c *command) names(ctx context.Context) error {
	lim, _, adhoc, err := c.limiter()
	if err != nil {
		return err
	}
	if adhoc != nil {
		return usagef("names takes no ad-hoc config: --rate, --period and the like go with inspect, reset or prune NAME")
	}
	pool, _, err := c.pool(ctx, 1)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := dbsqlc.New().LimitNames(ctx, pool)
	if err != nil {
		return c.tableError("names", err)
	}
	out := NamesJSON{Names: []NameJSON{}}
	width := len("total")
	for _, r := range rows {
		n := NameJSON{Name: r.Name, Rows: r.Rows}
		if cfg, err := lim.Lookup(r.Name, "", nil); err == nil {
			n.Config = cfg.String()
		}
		out.Names = append(out.Names, n)
		out.Total += r.Rows
		width = max(width, len(r.Name))
	}
	var text strings.Builder
	fmt.Fprintf(&text, "%-*s %10s  %s\n", width, "NAME", "ROWS", "CONFIG")
	for _, n := range out.Names {
		cfg := n.Config
		if cfg == "" {
			cfg = "none (prune needs one: --config FILE)"
		}
		fmt.Fprintf(&text, "%-*s %10d  %s\n", width, n.Name, n.Rows, cfg)
	}
	fmt.Fprintf(&text, "%-*s %10d\n", width, "total", out.Total)
	return c.print(out, text.String())
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
	// NextToken is when a call for one token would be granted: At when it would be now. Omitted
	// (nil) when no call can ever be granted one token at once: a capacity below 1, or, for a
	// sharded limit, two shards holding less than 1 together.
	NextToken *time.Time `json:"next_token,omitempty"`
	// NextTokenExact is false for a sharded limit, whose answer holds for the pair of shards one
	// Check picked at random.
	NextTokenExact bool `json:"next_token_exact"`
}

func (c *command) inspect(ctx context.Context, name, key string) error {
	lim, _, adhoc, err := c.limiter()
	if err != nil {
		return err
	}
	cfg, err := lim.Lookup(name, key, adhoc)
	if err != nil {
		return err
	}
	pool, _, err := c.pool(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := lim.State(ctx, pool, name, key, &ratelimit.LimitOpts{Config: adhoc})
	if err != nil {
		return dbError(err)
	}
	out := InspectJSON{Name: name, Key: key, Config: cfg.String(), Value: st.Value, Shards: st.Shards,
		At: st.Time, NextTokenExact: len(st.Shards) <= 1}
	chk, err := lim.Check(ctx, pool, name, key, &ratelimit.LimitOpts{Config: adhoc})
	switch {
	case errors.Is(err, ratelimit.ErrInvalid): // one token can never be granted at once (capacity < 1): no next token
	case err != nil:
		return dbError(err)
	case chk.OK:
		out.NextToken = &st.Time
	default:
		out.NextToken = &chk.RetryAt
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
	case out.NextToken == nil:
		text.WriteString("next    never: a call for one token exceeds what the limit can grant at once\n")
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
	lim, _, adhoc, err := c.limiter()
	if err != nil {
		return err
	}
	// Reset needs no config, but a name the command does not know is most likely a typo: refuse
	// it, as inspect and prune do, before connecting.
	if _, err := lim.Lookup(name, key, adhoc); err != nil {
		return err
	}
	pool, _, err := c.pool(ctx, 1)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := lim.Reset(ctx, pool, name, key); err != nil {
		if errors.Is(err, ratelimit.ErrInvalid) {
			return err
		}
		return dbError(err)
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
	lim, known, adhoc, err := c.limiter()
	if err != nil {
		return err
	}
	if len(names) == 1 {
		if _, err := lim.Lookup(names[0], "", adhoc); err != nil {
			return err
		}
	} else if adhoc != nil {
		return usagef("an ad-hoc config needs the limit's NAME: prune NAME --rate R --period D")
	}
	pool, _, err := c.pool(ctx, 1)
	if err != nil {
		return err
	}
	defer pool.Close()
	out := PruneJSON{Deleted: map[string]int64{}}
	if len(names) == 1 {
		n, err := lim.Prune(ctx, pool, names[0], &ratelimit.PruneOpts{Config: adhoc})
		out.Deleted[names[0]] = n
		if err != nil {
			return dbError(err)
		}
	} else {
		// Every name in the table must have a config: refuse before deleting anything otherwise.
		rows, err := dbsqlc.New().LimitNames(ctx, pool)
		if err != nil {
			return c.tableError("prune", err)
		}
		var unconfigured []string
		extra := map[string]int64{}
		for _, r := range rows {
			if _, ok := sort.Find(len(known), func(i int) int { return strings.Compare(r.Name, known[i]) }); !ok {
				unconfigured = append(unconfigured, fmt.Sprintf("%q (%s)", r.Name, plural(r.Rows, "row")))
				extra[r.Name] = r.Rows
			}
		}
		if len(unconfigured) > 0 {
			one := "NAME"
			if len(extra) == 1 {
				for name := range extra {
					one = quoteArg(name)
				}
			}
			return &exitError{code: ExitInvalid, extra: map[string]any{"unconfigured": extra}, msg: fmt.Sprintf(
				"prune: the table holds limits with no config here: %s; a row is pruned only when it holds its limit's full capacity, "+
					"so pruning needs the limit's config: give it in --config FILE, or prune the limit alone with "+
					"\"%s prune %s --rate R --period D\" (and --capacity, --kind, --shards, --start as it is configured); nothing was deleted",
				strings.Join(unconfigured, ", "), c.name, one)}
		}
		if out.Deleted, err = lim.PruneAll(ctx, pool, nil); err != nil {
			return dbError(err)
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
