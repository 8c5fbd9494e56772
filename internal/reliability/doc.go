// Package reliability holds txlimit's reliability suite: tests that try hard to break the
// library's promises, run by `make reliability` (and, in its short default form, by CI).
//
// The package has no code of its own. Its tests carry the build tag "reliability", so that
// `go test ./...` skips them; run them with
//
//	make reliability                               # soak 60 s, fuzz 30,000 inputs: what CI runs
//	make reliability SOAK=10m FUZZTIME=300000x     # the long form, by hand
//
// The parts, each printing one summary line that starts with "reliability: <part>:":
//
//  1. soak (TestSoak): workers mixing limits, reservations with River jobs, multi-limit calls
//     and credits, and cancels and settlements of the reserved jobs (soak_sched_test.go), over
//     plain and sharded limits, with random rollbacks and random
//     pg_terminate_backend of their own connections; at the end the stored value of every limit
//     must equal what the committed calls imply, and committed reservations the inserted jobs.
//     Other workers (a quarter as many, at least 2) decide the same keys through a
//     ratelimit.Batcher on the same killed pool; each call must return within a bound, and a
//     Batcher call that failed may only explain a difference by exactly its own counts
//     (soak_batcher_test.go).
//     TXLIMIT_SOAK_DURATION (default 60s) and TXLIMIT_SOAK_WORKERS (default 16) size it.
//  2. restart (TestRestart): a throwaway Postgres cluster of the test's own is stopped and
//     started under load; calls fail closed, nothing panics or leaks goroutines, and decisions
//     succeed again within 5 s of the server's return.
//  3. fuzz: ratelimit's FuzzModel, the reference-model fuzz target (plain and sharded limits,
//     single and multi-limit sequences), for FUZZTIME inputs; fuzz-summary.sh prints its line.
//  4. bad input (TestBadInput): a table of hostile inputs through the public API of ratelimit
//     and scheduler, each answered by the documented typed error with nothing written (the
//     state table and river_job compared before and after each case), and keys and names made of
//     SQL metacharacters and wildcards shown to be ordinary.
//  5. least privilege (TestLeastPrivilege): a fresh role holding only the grants of README.md
//     (the test applies the README's block itself) runs every call of both packages and a River
//     client, and both migrators are refused without changing the schema.
//
// docs/reliability.md says what each part checks and why, and how to read the summary lines.
package reliability
