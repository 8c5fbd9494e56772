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
-- schemas exists and may be used) and the search_path itself, so that the operator command can say
-- where it looked; and the role, with the schemas its search_path names that exist but that it may
-- not use (no USAGE: Postgres skips them), in search_path order, so that it can say why.
SELECT coalesce(current_schema(), '')::text AS schema,
       current_setting('search_path')::text AS search_path,
       current_user::text AS role,
       (SELECT coalesce(array_agg(n.nspname ORDER BY p.i), '{}')
        FROM unnest(string_to_array(current_setting('search_path'), ',')) WITH ORDINALITY AS p(e, i)
        JOIN pg_catalog.pg_namespace n ON n.nspname = CASE
             WHEN btrim(p.e) IN ('$user', '"$user"') THEN current_user::text
             WHEN btrim(p.e) LIKE '"%"' THEN replace(substr(btrim(p.e), 2, length(btrim(p.e)) - 2), '""', '"')
             ELSE lower(btrim(p.e)) END
        WHERE NOT has_schema_privilege(n.oid, 'USAGE'))::text[] AS unusable;

-- name: VersionTableExists :one
-- VersionTableExists reports whether schema holds txlimit's goose version table
-- (migrations.VersionTable), so that `txlimit migrate status` can read it without creating it.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables
               WHERE schemaname = sqlc.arg('schema')::text AND tablename = 'txlimit_goose_version')::boolean AS found;

-- name: MigrationVersions :many
-- MigrationVersions reads the goose version table of the search_path's schema as goose does: a
-- version is applied when it has a row (goose's Down deletes them), at the time of its latest row;
-- version 0 is the row goose adds with the table. It takes no lock and writes nothing.
SELECT DISTINCT ON (v.version_id) v.version_id, v.tstamp
FROM txlimit_goose_version v
ORDER BY v.version_id, v.tstamp DESC;
