// Package ratelimit enforces rate limits stored in Postgres, decided inside the caller's transaction.
//
// # Model
//
// A limit is a name, a Config and a key (a user ID, an IP, "" for a global limit). Its whole state
// is two numbers per row of table txlimit_state: value (tokens, negative while reservations are
// owed) and ts. A missing row is a full, untouched limit. Configs are not stored; every call
// carries its config, registered by name in LimiterConfig.Limits or passed inline.
//
// With r = Rate/Period and cap = Capacity, a token bucket evaluated at now holds
//
//	v = min(value + (now - ts)·r, cap)
//
// and a fixed window, with n = floor((now - ts)/Period) whole windows elapsed, holds
//
//	v = min(value + Rate·n, cap)
//
// A request for count tokens leaves v - count. When that is >= 0 it is granted (Result.OK) and the
// row becomes (v - count, ts'), where ts' is now for a token bucket and ts + n·Period (the start of
// the current window) for a fixed window. When it is < 0 the request is denied and nothing is
// written, unless it asked to Reserve and the debt -(v - count) is within MaxReserved: then it is
// granted as a reservation (Result.Reserved). A limit whose MaxReserved is 0 allows no
// reservations (Reserve is then an *ArgumentError); Unbounded puts no bound on the debt.
//
// RetryAt is, for a reservation, when the rows it charged are out of debt (the caller should act
// then); for a denial, the first microsecond at which the same request would be granted: when the
// tokens it asked for have accrued or, for a reservation refused over MaxReserved, when its debt
// fits. In real arithmetic that is ts' + debt/r for a token bucket and ts' + Period·ceil(debt/Rate)
// for a fixed window; the database computes it on the very rules a decision applies, in float8,
// so one microsecond earlier the same call is still refused. Waits are bounded: RetryAt is at most
// Time plus 2^61 µs (about 73,000 years), and a longer wait is reported as that bound.
// Beyond 2^53 µs (about 285 years) float8 counts time in steps of more than a microsecond, so such
// a RetryAt can lie a few microseconds before the real-arithmetic instant.
//
// Time never runs backwards for a row: a request evaluated at now < ts is evaluated at ts. The
// time is the database's clock (clock_timestamp()) read once per statement, unless
// LimiterConfig.Now supplies one (for tests).
//
// # One engine, any isolation level
//
// Every decision (Limit, LimitN, Check, CheckN, LimitMany, CheckMany, on the Limiter or a Batcher)
// is one SQL statement over a list of requests: a Limit is a list of one, a LimitMany a list of one
// all-or-nothing group, a Batcher's batch a list of its callers' groups. Requests on the same key are decided one after another in
// list order, each group seeing the effect of the groups granted before it. A decision first
// plans on rows read without a lock; a request that is denied there is answered from that read,
// taking no lock (this can under-grant against a concurrent Credit or Reset, never over-grant). It
// then locks the rows the granted groups would charge, in one global order (name, key, shard,
// compared as bytes), which re-reads their latest committed versions under READ COMMITTED and
// raises a serialization failure under REPEATABLE READ or SERIALIZABLE if they changed; a missing
// row is created full (stamped to evaluate exactly as a missing row) and so locked too. It decides
// again on the locked versions, grants only on rows it holds, and writes only the groups that are
// granted. A request alone on its row does all of this as one UPDATE of the row whose condition is
// the grant rule. So a decision is exact at every isolation level, takes one round trip, never
// re-runs, and never over-grants: a database error is returned as an error, never as a grant.
// Every access is a primary-key probe, so under SERIALIZABLE a decision holds tuple or page
// predicate locks only, never one on the whole table, however small the table. docs/spec.md §7
// states it in full.
//
// Pass a pgx.Tx to make a limit part of your transaction: its consumption commits or rolls back
// with your own writes. Pass a *pgxpool.Pool or *pgx.Conn for a decision of its own. On
// database/sql, pass your *sql.Tx (or *sql.DB, *sql.Conn) through package
// github.com/txlimit/txlimit/sqldb: sqldb.Wrap(tx).
// InSerializableTx runs a function in a SERIALIZABLE transaction with bounded, jittered retries.
//
// # Shards
//
// Config.Shards = N splits a hot limit over N rows of the same (name, key): each shard has
// Rate/N, Capacity/N and MaxReserved/N. A call picks two distinct shards a and b at random and
// evaluates both (missing rows are full). If either alone holds count, it charges the one with more
// tokens (a on a tie). Otherwise, if their difference is at most count, it charges both so that they
// end equal, each at (va + vb - count)/2: granted when that is >= 0, a reservation when it is not.
// Otherwise it charges the one with more tokens alone. A reservation's debt is bounded per charged
// shard by MaxReserved/N. Result.Shards names the charged shards. Only the charged shards are
// locked and written; when the shard a call of its own (a list of one request) charges alone is
// held by another transaction, the call takes its other pick instead if that one can serve alone
// (SKIP LOCKED), and waits only when both are held.
//
// Concurrent callers of one key are steered to different shards before they read any row. A
// lone request (a Limit or LimitN, a LimitMany of one request, or a Batcher's batch of one) draws its candidate shards in
// random order, a and b first (up to 16), and takes as a the first candidate that no other transaction is deciding on, and as b the
// candidate after it: with no concurrent caller, exactly the two random picks. "Deciding on" is a
// transaction-scoped advisory lock, pg_try_advisory_xact_lock(k), with k derived from a 64-bit
// FNV-1a hash of name and key, the OID of the state table (so schemas do not share them) and the
// shard, released when the transaction ends. It is a hint, not a guard: exactness rests on the
// row locks alone. Under REPEATABLE READ and
// SERIALIZABLE a candidate is also passed over when it is stale: when a transaction that the
// caller's snapshot cannot see has changed or locked its row, since locking it from that snapshot
// could only fail (the caller's own transaction's writes and locks, a savepoint's included, never
// make a row stale: its later calls on the key use the shards it charged); the candidate stays taken by the caller's transaction until it ends (an
// advisory lock taken in a transaction cannot be let go before). When every candidate is taken
// (or stale), under READ COMMITTED the call goes on with its first candidate: when its plan grants
// and its transaction holds no row lock (it has written and locked nothing: a call on the pool,
// say), it first waits for that candidate's advisory lock, so that it sleeps until the shard's
// holder commits and then plans again on the shard as that left it; it waits at most 100 ms, or
// the transaction's lock_timeout when that is shorter, since the holder need not hold the shard's row
// (its call may have been refused, or charged its other pick). A refusal waits for no advisory
// lock, and a transaction that holds rows may wait for the row itself, as any SQL does, never for
// an advisory lock, where it could close a deadlock with what it holds. Under REPEATABLE READ or
// SERIALIZABLE it writes nothing and returns a *BusyError, a serialization failure (SQLSTATE
// 40001) to retry like any other. Check and CheckN take no advisory lock; a LimitMany of two or
// more requests and a Batcher's longer batches do not use them either. A transaction holds one or
// more such locks per sharded key it decided on, so one that decides on thousands of different
// sharded keys needs room in Postgres's lock table (max_locks_per_transaction).
//
// A Limiter also admits the lone requests it decides on a pool (a *pgxpool.Pool, or a *sql.DB
// through sqldb.Wrap; a Limit or LimitN, or a LimitMany of one request) for one sharded key N at a
// time, one per shard: a caller beyond them waits in the process for a free slot, where waiting
// costs nothing, instead of on a backend of its own for a steering lock. That wait, too, is a hint:
// it lasts at most 100 ms, then the call goes on without a slot (so a slot held by a call that
// waits for a row the waiting caller's own transaction holds delays it, never deadlocks it), and it
// ends with the caller's context. A refused call opens its key: the calls that come after it and
// that it speaks for (of its count or more, and reservations only after a refused reservation) take
// no slot while its RetryAt is ahead (100 ms at the most), so that a flood of refused calls is
// still answered in parallel. A key's slots are those of its pool (the same name and key on another
// pool are another key) and of its number of shards (a call whose inline Config changes Shards
// starts the key afresh with that many). The calls InSerializableTx's function makes on its
// transaction, with the context it is given, when InSerializableTx runs on a *pgxpool.Pool, take a
// slot too and keep it until the transaction ends (its shard stays taken until then; a refused one
// opens its key when it returns, as on the pool); a later call of that transaction on the same key
// takes no other. Calls in other transactions or on a single
// connection (a *pgx.Conn, a *sql.Conn, a Batcher's) take no slot; each Limiter admits its own
// callers. The wait counts in txlimit.decision.duration.
//
// Under REPEATABLE READ and SERIALIZABLE the choice is made with one read fewer when it can be: a
// shard that is read but not charged makes the transaction a reader of whoever charges it, and with
// many callers SERIALIZABLE aborts the resulting read/write dependency cycles. There a single
// request charges its first pick when that shard alone holds count, and reads the second only when
// it does not, then decides between combining and the second alone exactly as above; a CheckN
// there answers the same way, so that it names the shard LimitN would charge. Under READ
// COMMITTED both picks are always read.
//
// # Fixed window grid
//
// Fixed windows start at anchor + k·Period. The anchor is Config.Start when set, else a phase in
// [0, Period) after the Unix epoch taken from an FNV-1a hash of name, a NUL byte and key: spread
// across keys, stable across resets, shared by all shards of a key. A missing row starts at the
// start of the window containing now, full.
//
// # Errors
//
// Bad input returns a typed error (*ConfigError, *ArgumentError, *UnknownLimitError, all matching
// errors.Is(err, ErrInvalid)) before any SQL runs. A denial is a Result with OK false, not an error,
// unless LimitOpts.AsError asks for a *LimitedError. Names are 1 to 256 bytes, keys 0 to
// MaxKeyLen bytes, both valid UTF-8 without NUL bytes; counts are finite, between 10^-9 and
// 10^15.
//
// A context that ends while a decision waits (for a row lock, say) makes the call return the
// context's error. Inside a transaction nothing is then written: pgx gives the connection up, so
// the transaction cannot commit. On a pool or a *pgx.Conn, though, pgx's default reaction to a
// cancelled context is to close the connection without telling the server, which may still finish
// and commit the statement: the caller was told "error" and never acts on a grant, but the tokens
// may be spent. To have the server cancel the statement instead, set the connection config's
// BuildContextWatcherHandler to a *pgconn.CancelRequestContextWatcherHandler.
package ratelimit
