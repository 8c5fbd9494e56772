// Package pgbouncertest runs txlimit through a real PgBouncer in transaction pooling mode: decisions
// under each pgx QueryExecMode, LimitMany, Credit, the migrations (up and down, concurrent
// migrators, under load) and the scheduler's reserve-and-run with River in poll-only mode. Its
// tests need TXLIMIT_PGBOUNCER_URL (EnvURL: a URL through PgBouncer to the database of
// TEST_DATABASE_URL or localhost, as user postgres) and are skipped without it: `make
// test-pgbouncer` starts a PgBouncer and sets it (.ci/pgbouncer.sh). docs/deploy.md says what a
// user behind PgBouncer configures; these tests check every line of it.
//
// Other packages' tests reach PgBouncer through New (a role of the test's own whose search_path is
// set with ALTER ROLE, as docs/deploy.md says) and Bouncer.Pool, in each of SafeModes: make
// test-pgbouncer runs the scheduler's whole test suite so, once per mode (TXLIMIT_TEST_VIA=pgbouncer,
// scheduler/setup_test.go). Open and Bouncer.Connect do the same for runnable examples.
package pgbouncertest
