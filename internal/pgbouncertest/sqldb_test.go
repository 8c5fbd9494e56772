package pgbouncertest_test

import (
	"context"
	"database/sql"
	"errors"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/lib/pq"

	"github.com/txlimit/txlimit/internal/driver/drivertest"
	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/sqldb"
)

// A database/sql configuration through PgBouncer: the pgx stdlib driver in one of
// pgbouncertest.SafeModes, or lib/pq with or without binary_parameters=yes. open returns a *sql.DB
// through PgBouncer as the test's role; every connection it opens calls beforeExtended, when set,
// just before it writes a message of the extended query protocol (Parse or Bind).
type sqlConfig struct {
	name string
	open func(t *testing.T, b *pgbouncertest.Bouncer, beforeExtended func()) *sql.DB
}

func sqlConfigs() (safe []sqlConfig, libpqDefault sqlConfig) {
	for _, m := range pgbouncertest.SafeModes {
		safe = append(safe, sqlConfig{"pgx_stdlib_" + m.Name, func(t *testing.T, b *pgbouncertest.Bouncer, beforeExtended func()) *sql.DB {
			t.Helper()
			cfg, err := pgx.ParseConfig(b.URL)
			if err != nil {
				t.Fatal(err)
			}
			cfg.User = b.Role
			cfg.DefaultQueryExecMode = m.Mode
			if beforeExtended != nil {
				cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
					c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
					return hookConn{c, beforeExtended}, err
				}
			}
			db := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { _ = db.Close() })
			return db
		}})
	}
	safe = append(safe, sqlConfig{"lib_pq_binary_parameters", libpq(true)})
	return safe, sqlConfig{"lib_pq", libpq(false)}
}

// libpq opens lib/pq through PgBouncer, with binary_parameters=yes when binary is true.
func libpq(binary bool) func(t *testing.T, b *pgbouncertest.Bouncer, beforeExtended func()) *sql.DB {
	return func(t *testing.T, b *pgbouncertest.Bouncer, beforeExtended func()) *sql.DB {
		t.Helper()
		u, err := url.Parse(b.URL)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.User(b.Role)
		q := u.Query()
		q.Set("sslmode", "disable")
		if binary {
			q.Set("binary_parameters", "yes")
		}
		u.RawQuery = q.Encode()
		c, err := pq.NewConnector(u.String())
		if err != nil {
			t.Fatal(err)
		}
		if beforeExtended != nil {
			c.Dialer(hookDialer{beforeExtended})
		}
		db := sql.OpenDB(c)
		t.Cleanup(func() { _ = db.Close() })
		return db
	}
}

// hookConn calls before just before each write that starts with a Parse ('P') or Bind ('B')
// message.
type hookConn struct {
	net.Conn
	before func()
}

func (c hookConn) Write(p []byte) (int, error) {
	if len(p) > 0 && (p[0] == 'P' || p[0] == 'B') {
		c.before()
	}
	return c.Conn.Write(p)
}

type hookDialer struct{ before func() }

func (d hookDialer) Dial(network, addr string) (net.Conn, error) {
	c, err := net.Dial(network, addr)
	return hookConn{c, d.before}, err
}

func (d hookDialer) DialTimeout(network, addr string, timeout time.Duration) (net.Conn, error) {
	c, err := net.DialTimeout(network, addr, timeout)
	return hookConn{c, d.before}, err
}

// pinner takes, on each call of pin, the server connection PgBouncer gave out last (it reuses
// them last in, first out) into a transaction of another client of the same role, then lets go of
// the one it took before: the next statement of the connection under test goes to that one, not
// to the server connection its previous round trip ran on. What a busy application's other
// connections do between two round trips of one statement, made to happen every time.
type pinner struct {
	pool *pgxpool.Pool
	mu   sync.Mutex
	held pgx.Tx
	on   bool
}

func (p *pinner) pin() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.on {
		return
	}
	ctx := context.Background()
	tx, err := p.pool.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, "SELECT 1")
	}
	if err != nil {
		panic(err)
	}
	if p.held != nil {
		_ = p.held.Rollback(ctx)
	}
	p.held = tx
}

// arm turns pin on or off, letting go of the server connection it holds.
func (p *pinner) arm(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.on = on
	if p.held != nil {
		_ = p.held.Rollback(context.Background())
		p.held = nil
	}
}

// TestDatabaseSQLThroughPgBouncer: package sqldb through PgBouncer in transaction pooling mode in
// each database/sql configuration docs/deploy.md calls safe (the pgx stdlib driver in each of
// SafeModes, lib/pq with binary_parameters=yes): the driver contract's script on the *sql.DB, and a
// decision in a *sql.Tx that commits, while before every Parse or Bind the connection sends,
// another client of the role takes the server connection PgBouncer handed out last. A statement
// sent in two round trips outside a transaction then lands on two server connections every time,
// not only under load. lib/pq's default does so (Parse and Describe, then Bind and Execute): on the
// *sql.DB its first statement fails with SQLSTATE 26000, as docs/deploy.md says; in a *sql.Tx,
// which keeps its server connection, it works.
func TestDatabaseSQLThroughPgBouncer(t *testing.T) {
	safe, libpqDefault := sqlConfigs()
	for _, c := range safe {
		t.Run(c.name, func(t *testing.T) {
			db, p := pinnedDB(t, c)
			drivertest.Script(t, sqldb.Wrap(db))
			p.arm(true)
			decideInTx(t, db)
		})
	}
	t.Run(libpqDefault.name, func(t *testing.T) {
		db, p := pinnedDB(t, libpqDefault)
		lim := inline(t)
		_, err := lim.Limit(context.Background(), sqldb.Wrap(db), "x", "k", nil)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "26000" {
			t.Fatalf("lib/pq without binary_parameters on a *sql.DB through PgBouncer: %v; want SQLSTATE 26000 (docs/deploy.md says why)", err)
		}
		p.arm(true)
		decideInTx(t, db)
	})
}

// pinnedDB opens c through PgBouncer on a fresh migrated schema with a pinner armed, one
// connection at most.
func pinnedDB(t *testing.T, c sqlConfig) (*sql.DB, *pinner) {
	t.Helper()
	b, _ := migrated(t, 2)
	p := &pinner{pool: b.Pool(t, pgx.QueryExecModeSimpleProtocol, 2)}
	t.Cleanup(func() { p.arm(false) }) // before the pool closes
	db := c.open(t, b, p.pin)
	db.SetMaxOpenConns(1)
	p.arm(true)
	return db, p
}

// inline returns a limiter with the one limit "x", 1 per hour.
func inline(t *testing.T) *ratelimit.Limiter {
	t.Helper()
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"x": {Rate: 1, Period: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// decideInTx takes one decision in a *sql.Tx of db and commits it.
func decideInTx(t *testing.T, db *sql.DB) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	r, err := inline(t).Limit(ctx, sqldb.Wrap(tx), "x", "tx", nil)
	if err != nil || !r.OK {
		t.Fatalf("in a *sql.Tx: %+v, %v", r, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}
