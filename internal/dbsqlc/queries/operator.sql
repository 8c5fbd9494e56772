-- name: LimitNames :many
-- LimitNames lists every limit name in txlimit_state with its number of rows (keys times shards
-- written), in name order, for the operator command (package cli): what `txlimit names` prints and
-- how `txlimit prune` finds the names it has no config for. It reads the whole table, locks nothing.
SELECT s.name, count(*)::bigint AS rows
FROM txlimit_state s
GROUP BY s.name
ORDER BY s.name;

-- name: CurrentSchema :one
-- CurrentSchema is the schema the connection's search_path leads to (empty when none of its
-- schemas exists) and the search_path itself, so that the operator command can say where it looked.
SELECT coalesce(current_schema(), '')::text AS schema,
       current_setting('search_path')::text AS search_path;
