package ratelimit_test

import (
	"context"
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// sqlLimits are the limits of the database/sql tests. "llm" has an explicit MaxReserved, since
// reservations need one.
var sqlLimits = map[string]ratelimit.Config{
	"msg":    {Rate: 10, Period: time.Minute, Capacity: 3},
	"llm":    {Rate: 100, Period: time.Second, MaxReserved: 500},
	"ip":     {Rate: 5, Period: time.Minute},
	"global": {Rate: 100, Period: time.Minute},
	"hot":    {Rate: 8, Period: time.Second, Shards: 4},
	"fw":     {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0},
}

// weirdKey is a key that an array literal must quote: a quote, a comma, braces, a backslash, a
// space, non-ASCII and the word NULL.
const weirdKey = `we"ird, {key}\ é NULL`

func newSQLLimiter(t *testing.T) *ratelimit.Limiter {
	t.Helper()
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: sqlLimits, Now: func() time.Time { return t0 }})
	require.NoError(t, err)
	ratelimit.SetShardPicker(lim, func(int) (int, int) { return 0, 1 })
	return lim
}

// state returns Limiter's view of (name, key) (Value today, State after the engine rewrite).
func state(t *testing.T, lim *ratelimit.Limiter, db ratelimit.Executor, name, key string) ratelimit.State {
	t.Helper()
	st, err := lim.State(context.Background(), db, name, key, nil)
	require.NoError(t, err)
	return st
}

// sqlScript runs every kind of call on db at t0, checks the numbers the algebra gives, and returns
// everything the calls answered.
func sqlScript(t *testing.T, lim *ratelimit.Limiter, db ratelimit.Executor) []any {
	t.Helper()
	ctx := context.Background()
	var out []any
	for i := 1; i <= 4; i++ {
		r, err := lim.Limit(ctx, db, "msg", "u1", nil)
		require.NoError(t, err)
		require.Equal(t, i <= 3, r.OK, "message %d", i)
		out = append(out, r)
	}
	require.Equal(t, 6*time.Second, out[3].(ratelimit.Result).RetryAfter()) // 1 token at 10/min

	r, err := lim.LimitN(ctx, db, "llm", "org", 150, &ratelimit.LimitOpts{Reserve: true})
	require.NoError(t, err)
	require.True(t, r.OK)
	require.True(t, r.Reserved)
	require.Equal(t, -50.0, r.Value)
	require.Equal(t, t0.Add(500*time.Millisecond), r.RetryAt)
	out = append(out, r)

	r, err = lim.LimitN(ctx, db, "llm", "org", 451, &ratelimit.LimitOpts{Reserve: true}) // past MaxReserved
	require.NoError(t, err)
	require.False(t, r.OK)
	out = append(out, r)

	r, err = lim.Check(ctx, db, "msg", "u2", nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Equal(t, 2.0, r.Value)
	out = append(out, r)

	reqs := []ratelimit.Request{{Name: "ip", Key: weirdKey, Count: 2}, {Name: "global"}, {Name: "hot", Key: "k"}}
	m, err := lim.LimitMany(ctx, db, reqs, nil)
	require.NoError(t, err)
	require.True(t, m.OK)
	// "hot" reports only the two shards it looked at (0 and 1, 2 tokens each).
	require.Equal(t, []float64{3, 99, 3}, []float64{m.Results[0].Value, m.Results[1].Value, m.Results[2].Value})
	out = append(out, m)

	m, err = lim.CheckMany(ctx, db, []ratelimit.Request{{Name: "ip", Key: weirdKey, Count: 4}, {Name: "global"}}, nil)
	require.NoError(t, err)
	require.False(t, m.OK) // 3 left
	out = append(out, m)

	r, err = lim.LimitN(ctx, db, "hot", "k", 3, nil) // shards 0 and 1 hold 1 and 2: both charged
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Equal(t, []int{0, 1}, r.Shards)
	out = append(out, r)

	r, err = lim.Limit(ctx, db, "fw", "k", nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Equal(t, 4.0, r.Value)
	out = append(out, r)

	c, err := lim.Credit(ctx, db, "msg", "u1", 2, nil)
	require.NoError(t, err)
	require.Equal(t, 2.0, c.Credited)
	require.Equal(t, 2.0, c.Value)
	out = append(out, c)

	st := state(t, lim, db, "hot", "k")
	require.Equal(t, 4.0, st.Value) // 8 - 1 (LimitMany) - 3
	out = append(out, st)
	st = state(t, lim, db, "ip", weirdKey)
	require.Equal(t, 3.0, st.Value)
	out = append(out, st)

	require.NoError(t, lim.Reset(ctx, db, "msg", "u1"))
	st = state(t, lim, db, "msg", "u1")
	require.Equal(t, 3.0, st.Value)
	require.True(t, st.TS.IsZero())
	out = append(out, st)
	return out
}

// TestSQLAdapter runs every call through a *sql.Tx of both drivers: the answers equal those of the
// same calls through a pgx.Tx, a rolled-back transaction charges nothing, a committed one
// charges everything.
func TestSQLAdapter(t *testing.T) {
	t.Parallel()
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, pool := testdb.SQLDB(t, driver, true)
			lim := newSQLLimiter(t)

			// The reference: the same script through pgx, rolled back.
			var want []any
			require.NoError(t, func() error {
				tx, err := pool.Begin(ctx)
				require.NoError(t, err)
				defer tx.Rollback(ctx)
				want = sqlScript(t, lim, tx)
				return tx.Rollback(ctx)
			}())
			require.Zero(t, testdb.CountRows(t, pool))

			// A database/sql transaction that rolls back: the same answers, nothing charged.
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			got := sqlScript(t, lim, ratelimit.SQL(tx))
			require.Equal(t, want, got)
			require.NoError(t, tx.Rollback())
			require.Zero(t, testdb.CountRows(t, pool))
			require.Equal(t, 100.0, state(t, lim, ratelimit.SQL(db), "llm", "org").Value)

			// One that commits: everything charged, as seen through pgx and through database/sql.
			tx, err = db.BeginTx(ctx, nil)
			require.NoError(t, err)
			got = sqlScript(t, lim, ratelimit.SQL(tx))
			require.Equal(t, want, got)
			require.NoError(t, tx.Commit())
			require.Equal(t, -50.0, state(t, lim, pool, "llm", "org").Value)
			require.Equal(t, -50.0, state(t, lim, ratelimit.SQL(db), "llm", "org").Value)
			require.Equal(t, 3.0, state(t, lim, ratelimit.SQL(db), "ip", weirdKey).Value)

			// *sql.DB and *sql.Conn make decisions of their own.
			r, err := lim.Limit(ctx, ratelimit.SQL(db), "ip", weirdKey, nil)
			require.NoError(t, err)
			require.Equal(t, 2.0, r.Value)
			conn, err := db.Conn(ctx)
			require.NoError(t, err)
			defer conn.Close()
			r, err = lim.Limit(ctx, ratelimit.SQL(conn), "ip", weirdKey, nil)
			require.NoError(t, err)
			require.Equal(t, 1.0, r.Value)

			// Prune works through the adapter too: after an hour everything is full again.
			later, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: sqlLimits, Now: func() time.Time { return t0.Add(time.Hour) }})
			require.NoError(t, err)
			n, err := later.Prune(ctx, ratelimit.SQL(db), "ip", nil)
			require.NoError(t, err)
			require.Equal(t, int64(1), n)
		})
	}
}

// TestSQLAdapterErrors: a database error keeps its SQLSTATE as a *pgconn.PgError with either
// driver, a nil handle is refused, and no rows is pgx.ErrNoRows.
func TestSQLAdapterErrors(t *testing.T) {
	t.Parallel()
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, _ := testdb.SQLDB(t, driver, false) // not migrated: no txlimit_state
			lim := newSQLLimiter(t)
			_, err := lim.Limit(ctx, ratelimit.SQL(db), "msg", "u1", nil)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "42P01", pgErr.Code) // undefined_table
			require.Contains(t, err.Error(), `relation "txlimit_state" does not exist`)
			require.False(t, ratelimit.IsRetryable(err))

			var n int
			require.ErrorIs(t, testdb.NoRows(ctx, ratelimit.SQL(db).(testdb.Querier), &n), pgx.ErrNoRows)

			var nilDB *sql.DB
			_, err = lim.Limit(ctx, ratelimit.SQL(nilDB), "msg", "u1", nil)
			require.ErrorIs(t, err, ratelimit.ErrInvalid)
			var nilTx *sql.Tx
			require.Nil(t, ratelimit.SQL(nilTx))
		})
	}
}

// TestSQLAdapterSerializationFailure: a serialization failure through database/sql is retryable
// with either driver, so InSerializableTx-style retry loops work on *sql.Tx too.
func TestSQLAdapterSerializationFailure(t *testing.T) {
	t.Parallel()
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, _ := testdb.SQLDB(t, driver, true)
			lim := newSQLLimiter(t)
			_, err := lim.Limit(ctx, ratelimit.SQL(db), "msg", "u", nil) // the row exists
			require.NoError(t, err)

			late, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
			require.NoError(t, err)
			defer late.Rollback()
			_, err = lim.Check(ctx, ratelimit.SQL(late), "msg", "u", nil) // takes late's snapshot
			require.NoError(t, err)

			early, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
			require.NoError(t, err)
			r, err := lim.Limit(ctx, ratelimit.SQL(early), "msg", "u", nil)
			require.NoError(t, err)
			require.True(t, r.OK)
			require.NoError(t, early.Commit())

			// late's snapshot predates early's write: locking the row cannot succeed.
			_, err = lim.Limit(ctx, ratelimit.SQL(late), "msg", "u", nil)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "40001", pgErr.Code)
			require.True(t, ratelimit.IsRetryable(err))
		})
	}
}

// TestSQLAdapterRoundTrip sends the argument types the engine uses through each driver and back,
// and compares with what pgx itself returns.
func TestSQLAdapterRoundTrip(t *testing.T) {
	t.Parallel()
	ts := pgtype.Timestamptz{Time: time.Date(2026, 1, 2, 3, 4, 5, 123456000, time.UTC), Valid: true}
	cases := []struct {
		pgType string
		v      any
		dst    func() any
	}{
		{"text[]", []string{weirdKey, "", "a", `{}`, `\`}, func() any { return new([]string) }},
		{"text[]", []string(nil), func() any { return new([]string) }},
		{"float8[]", []float64{0.1, 1e-9, 1e15, -2.5, math.MaxFloat64, 1.0 / 3}, func() any { return new([]float64) }},
		{"bigint[]", []int64{0, -1, math.MaxInt64, math.MinInt64}, func() any { return new([]int64) }},
		{"integer[]", []int32{0, 7, math.MaxInt32, math.MinInt32}, func() any { return new([]int32) }},
		{"smallint[]", []int16{0, 1, math.MaxInt16, math.MinInt16}, func() any { return new([]int16) }},
		{"boolean[]", []bool{true, false}, func() any { return new([]bool) }},
		{"timestamptz", ts, func() any { return new(pgtype.Timestamptz) }},
		{"timestamptz", pgtype.Timestamptz{}, func() any { return new(pgtype.Timestamptz) }},
		{"float8", 0.1, func() any { return new(float64) }},
		{"text", weirdKey, func() any { return new(string) }},
	}
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, pool := testdb.SQLDB(t, driver, false)
			for i, c := range cases {
				want, got := c.dst(), c.dst()
				require.NoError(t, testdb.Echo(ctx, pool, c.pgType, c.v, want), "case %d: pgx", i)
				err := testdb.Echo(ctx, ratelimit.SQL(db).(testdb.Querier), c.pgType, c.v, got)
				require.NoError(t, err, "case %d: %s %v", i, c.pgType, c.v)
				if w, ok := want.(*pgtype.Timestamptz); ok { // pgx decodes into time.Local, lib/pq into UTC
					w.Time, got.(*pgtype.Timestamptz).Time = w.Time.UTC(), got.(*pgtype.Timestamptz).Time.UTC()
				}
				require.Equal(t, want, got, "case %d: %s", i, c.pgType)
			}
		})
	}
}
