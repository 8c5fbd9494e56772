-- +goose Up

-- Planner ballast: 1,000 rows under the name '' (an empty name is rejected by the library, so no
-- call ever reads or writes them; they hold nothing).
--
-- Why: a table of a few hot limits fits in one or two pages, and for such a table the planner
-- prefers a sequential scan to a primary-key lookup. That is cheap, but under SERIALIZABLE a
-- sequential scan takes a relation-level predicate lock, so every decision conflicts with every
-- concurrent write to the table, whatever its key or shard: sharding a hot limit stops helping and
-- unrelated keys abort each other. With the table at least ~14 pages the planner always looks rows up
-- by primary key; predicate locks are then on index pages and tuples, and since state updates are
-- HOT (they never touch the index) they conflict only on the rows they really share. Measured on a
-- 16-row table: without this, a relation lock; with it, one index-page lock.
INSERT INTO txlimit_state (name, key, shard, value, ts)
SELECT '', lpad(g::text, 4, '0'), 0, 0, 'epoch'::timestamptz
FROM generate_series(1, 1000) AS g;

-- +goose Down
DELETE FROM txlimit_state WHERE name = '';
