package sqldb_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/sqldb"
)

// An application on database/sql (sqlx, GORM, ent, bun...) passes its *sql.Tx through Wrap: the
// invitation and the token it costs commit together, or neither does.
func ExampleWrap() {
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"invite": {Rate: 2, Period: 24 * time.Hour},
	}})
	if err != nil {
		panic(err)
	}
	// In an application: db, err := sql.Open("pgx", dsn) with the pgx stdlib driver, or
	// sql.Open("postgres", dsn) with lib/pq. Here, a *sql.DB over the example's pool.
	pool, done := testdb.ForExample()
	defer done()
	var db *sql.DB = stdlib.OpenDBFromPool(pool)
	defer db.Close()
	ctx := context.Background()

	errLater := errors.New("the invitation failed; rolled back")
	invite := func(userID string, fail bool) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() // a no-op after Commit
		res, err := limiter.Limit(ctx, sqldb.Wrap(tx), "invite", userID, nil)
		if err != nil {
			return err
		}
		if !res.OK {
			return fmt.Errorf("limited: retry in %s", res.RetryAfter().Round(time.Hour))
		}
		// ... the application's own writes through tx ...
		if fail {
			return errLater
		}
		return tx.Commit()
	}
	fmt.Println(invite("user-7", false))
	fmt.Println(invite("user-7", true)) // rolled back: its token was not spent
	fmt.Println(invite("user-7", false))
	fmt.Println(invite("user-7", false))
	// Output:
	// <nil>
	// the invitation failed; rolled back
	// <nil>
	// limited: retry in 12h0m0s
}
